"""launch_single_task: train one timm Swin/ViT job on the chosen backend.

`--nproc_per_node N` re-launches this module N times through torch.distributed.run (torchrun) on
the backends whose replicas are processes; jax and xla drive N devices from this process.
`USE_ACCEL=1` selects the XLA compiler path when `--backend` is not given.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

START = time.perf_counter()  # before the heavy imports below: time_to_first_step counts them

from accel import BackendUnavailable, RecompileError, settle  # noqa: E402
from accel.backends import Supports  # noqa: E402
from accel.cli.config import RunConfig, from_dict, get_path, leaf_fields  # noqa: E402
from accel.cli.data.augment import AugmentError  # noqa: E402
from accel.cli.data.folder import BadImageError, DatasetError  # noqa: E402
from accel.cli.job import backend_config  # noqa: E402
from accel.cli.messages import as_flags  # noqa: E402
from accel.cli.models.factory import ModelError  # noqa: E402
from accel.cli.models.pretrained import PretrainedError  # noqa: E402
from accel.cli.options import build_parser, config_from_args  # noqa: E402
from accel.cli.resolve import resolve  # noqa: E402
from accel.cli.signals import NonFiniteLoss, TrainingStopped  # noqa: E402
from accel.config import AccelError  # noqa: E402
from accel.distributed import (  # noqa: E402
    destroy_process_group,
    first_difference,
    launched_by_torchrun,
    meet_as_hosts,
    process_index,
)
from accel.workers.lifetime import exit_with_parent  # noqa: E402

USER_ERRORS = (
    AccelError,
    BackendUnavailable,
    ModelError,
    PretrainedError,
    AugmentError,
    DatasetError,
    BadImageError,
)
EXIT_USER_ERROR = 2
EXIT_RECOMPILES = 3
EXIT_NONFINITE = 4
EXIT_CODES = {EXIT_USER_ERROR, EXIT_RECOMPILES, EXIT_NONFINITE}
SPAWNED = "ACCEL_SPAWNED"  # set for the ranks this launcher starts
RESOLVED = "ACCEL_RESOLVED_CONFIG"  # the launcher's resolved config (JSON), for those ranks


def job_exit_code(failures: Mapping[int, Any]) -> tuple[int, list[int]]:
    """The job's exit code and the failed ranks, those that failed on their own first: one of
    our exit codes, then any failure but the SIGTERM the launcher sends to the survivors (torch
    2.15 may record that before the failure that caused it), each group by time."""

    def own(f) -> bool:
        return f.exitcode in EXIT_CODES

    def rank_key(r: int) -> tuple:
        f = failures[r]
        return (not own(f), f.exitcode == -signal.SIGTERM, f.timestamp, r)

    order = sorted(failures, key=rank_key)
    first = failures[order[0]]
    return (first.exitcode if own(first) else 1), order


def rendezvous(cfg: RunConfig) -> list[str]:
    """torchrun's arguments for how this host's processes find the others: a single host, a
    static rendezvous at rank 0's address (--master_addr), or a c10d one (--rdzv_endpoint)."""
    hosts = cfg.hosts
    if hosts.nnodes == 1:
        return ["--standalone"]
    # Read by the static rendezvous (timeout) and by c10d (join_timeout).
    timeout = cfg.accel.mesh.rdzv_timeout
    wait = f"timeout={timeout},join_timeout={timeout}"
    args = [f"--nnodes={hosts.nnodes}", f"--rdzv_conf={wait}"]
    if hosts.rdzv_endpoint:
        backend = ("--rdzv_backend=c10d", f"--rdzv_endpoint={hosts.rdzv_endpoint}")
        return [*args, *backend, f"--rdzv_id={cfg.run_name}"]
    place = (f"--node_rank={hosts.node_rank}", f"--master_addr={hosts.master_addr}")
    return [*args, *place, f"--master_port={hosts.master_port}"]


def rendezvous_failure(cfg: RunConfig, err: BaseException) -> str:
    hosts = cfg.hosts
    where = hosts.rdzv_endpoint or f"{hosts.master_addr}:{hosts.master_port}"
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"the {hosts.nnodes} nodes did not all join the rendezvous at {where} within "
        f"--rdzv_timeout {cfg.accel.mesh.rdzv_timeout} s ({reason})"
    )


class _ExitBarrierRace(logging.Filter):
    """Across hosts, the host that keeps the rendezvous store may close it while another host's
    agent still waits on the job's exit barrier; torch logs that agent's harmless failure as an
    error with a stack trace, after every rank has finished."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Error waiting on exit barrier" not in record.getMessage()


def quiet_exit_barrier() -> None:
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_ExitBarrierRace())


def spawn(cfg: RunConfig, argv: list[str]) -> int:
    """Start nproc_per_node copies of this module on this host through torchrun."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun

    args = [
        *rendezvous(cfg),
        f"--nproc_per_node={cfg.accel.mesh.devices}",
        "--module",
        "accel.launch_single_task",
        *argv,
        *("--backend", str(cfg.backend), "--run_name", cfg.run_name),
    ]
    os.environ[SPAWNED] = "1"  # the ranks leave the launcher's lines to the launcher
    os.environ[RESOLVED] = cfg.to_json()  # inherited by the ranks alone
    quiet_exit_barrier()
    try:
        torchrun(args)
    except ChildFailedError as err:
        code, order = job_exit_code(err.failures)
        ranks = ", ".join(f"rank {r} (exit {err.failures[r].exitcode})" for r in order)
        error(f"training failed on {ranks}")
        return code
    except (RendezvousError, DistError, TimeoutError) as err:
        error(rendezvous_failure(cfg, err))
        return EXIT_USER_ERROR
    finally:
        os.environ.pop(RESOLVED, None)
    return 0


def same_everywhere(cfg: RunConfig) -> None:
    """Every rank (on every node) was started with the same options, this host's own aside.
    The library's settings (RunConfig.accel) prepare has compared already, as for any script:
    here only the command line's own."""
    local = ("hosts.node_rank", "data.workers")
    mine = {
        path: get_path(cfg, path)
        for path, _, _ in leaf_fields(RunConfig)
        if path not in local and not path.startswith("accel.")
    }
    difference = first_difference(mine)
    if difference:
        raise AccelError(f"the ranks were started with different options: {difference}")


def train_here(cfg: RunConfig) -> RunConfig:
    """Train in this process. `accel.prepare`, called as the Trainer builds its engine, joins
    the process to its peers (the process group, xla's runtime, jax.distributed): the command
    line reads its place from the engine, and takes rank 0's run folder. The options prepare
    does not take are compared across the ranks once it has. The config the run trained."""
    from accel.cli.train import Trainer

    try:
        trainer = Trainer(cfg, START)
        same_everywhere(trainer.cfg)
        trainer.train()
        return trainer.cfg
    finally:
        destroy_process_group()


def settled(cfg: RunConfig) -> tuple[RunConfig, Supports, list[str]]:
    """The checked, settled config: resolved once, by the launcher; the ranks it starts take
    its result (checking the data, the model and the memory again on every rank would only
    repeat the work, and a rank could settle differently: a run name, a default)."""
    given = os.environ.get(RESOLVED) if launched_by_torchrun() else None
    if given is None:  # the launcher, or a rank torchrun started without it
        return resolve(cfg, dict(os.environ))
    resolved = from_dict(RunConfig, json.loads(given))
    return resolved, settle(backend_config(resolved)).supports, []


def join_processes(cfg: RunConfig) -> None:
    """--nnodes for a backend whose replicas are devices (jax): its processes, one a host, meet
    at the coordinator the rendezvous options name (accel.distributed.meet_as_hosts), where the
    user has not named one."""
    hosts = cfg.hosts
    if hosts.nnodes > 1:
        address = hosts.rdzv_endpoint or f"{hosts.master_addr}:{hosts.master_port}"
        meet_as_hosts(address, hosts.nnodes, hosts.node_rank)


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.backends:
        from accel.backends import support_matrix

        print(support_matrix(as_flags))
        return 0
    cfg = config_from_args(args)
    if args.compare or args.repeats is not None:  # --repeats alone is refused by parse_repeats
        from accel.cli.compare import parse_backends, parse_repeats, run_comparison

        repeats = parse_repeats(args.repeats, args.compare)
        backends = parse_backends(args.compare)
        return run_comparison(argv, backends, cfg.model.name, cfg.output, repeats)
    if launched_by_torchrun():
        exit_with_parent()  # a rank never outlives the launcher that started it
    cfg, supports, notes = settled(cfg)
    processes = supports.replicas == "processes"
    if not processes:
        join_processes(cfg)
    # The first process of the first node speaks (the rank torchrun or srun gave this process,
    # or its place among the hosts).
    speaks = process_index() == 0 and SPAWNED not in os.environ and cfg.hosts.node_rank == 0
    for note in notes if speaks else ():
        print(f"accel: {note}", flush=True)
    several = cfg.accel.mesh.devices > 1 or cfg.hosts.nnodes > 1
    if several and processes and not launched_by_torchrun():
        code = spawn(cfg, argv)
        if code:
            return code
    else:
        cfg = train_here(cfg)
    if speaks:
        print(f"accel: {outcome(cfg)}; summary in {cfg.run_dir() / 'summary.json'}")
    return 0


def outcome(cfg: RunConfig) -> str:
    """The finished run's result in a few words, read from its summary.json."""
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    if cfg.eval_only:
        return (
            f"top-1 {summary['eval_acc']:.4f}, top-5 {summary['eval_acc5']:.4f}, "
            f"loss {summary['eval_loss']:.4f}"
        )
    return (
        f"{summary['images_per_sec']:.1f} img/s ({cfg.backend}, {cfg.model.name}, "
        f"world size {summary['world_size']})"
    )


def one_line(err: BaseException) -> str:
    """Errors re-raised from data workers carry the worker traceback: keep its last line."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else type(err).__name__
    name = type(err).__name__
    return last.split(f"{name}: ", 1)[-1]


def error(message: str) -> None:
    """One line on stderr; a process started by torchrun says which rank it is."""
    rank = f" (rank {os.environ.get('RANK', 0)})" if launched_by_torchrun() else ""
    print(f"launch_single_task: error{rank}: {as_flags(message)}", file=sys.stderr, flush=True)


def one_line_warnings() -> None:
    """The project's own warnings (skipped files, empty classes, ...) print as one line, without
    the source line Python adds after each, above the progress bar (tqdm.write); other
    libraries' keep their usual format."""
    from tqdm import tqdm

    if getattr(warnings.showwarning, "one_line", False):  # main() may run more than once
        return
    ours = str(Path(__file__).resolve().parents[1])  # the accel package
    usual = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not str(filename).startswith(ours):
            return usual(message, category, filename, lineno, file, line)
        tqdm.write(f"warning: {as_flags(str(message))}", file=file or sys.stderr)

    show.one_line = True  # type: ignore[attr-defined]  # a marker on the function, read above
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    one_line_warnings()
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except SystemExit as done:  # argparse: --help, or a usage error it has printed
        return done.code if isinstance(done.code, int) else EXIT_USER_ERROR
    except USER_ERRORS as err:
        error(one_line(err))
        return EXIT_USER_ERROR
    except RecompileError as err:
        error(one_line(err))
        return EXIT_RECOMPILES
    except NonFiniteLoss as err:
        error(str(err))
        return EXIT_NONFINITE
    except TrainingStopped as stop:
        print(f"accel: {stop}", flush=True)
        return 130 if stop.signal_name == "SIGINT" else 0
    except KeyboardInterrupt:
        print("launch_single_task: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
