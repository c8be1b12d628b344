"""Shared helpers for the test suite."""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import psutil
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from accel.backends.host_reads import HOST_READS
from accel.cli.config import RunConfig, leaf_fields, options, replace_path
from accel.cli.data.config import DataConfig
from accel.cli.models.factory import ModelConfig
from tests.forking import EXIT_UNSAFE_FORK, check_parent

ROOT = Path(__file__).resolve().parents[1]
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
# The backends this stack can run: torch_xla and jax are optional installs.
INSTALLED = tuple(b for b in ("eager", "compile", "xla", "jax") if HAS_XLA or b != "xla")
INSTALLED = tuple(b for b in INSTALLED if HAS_JAX or b != "jax")
# An option by its flag's name ("grad_accum"), its own name ("accum") or its path
# ("accel.step.accum"); nested configs by theirs.
PATHS = {path.rsplit(".", 1)[-1]: path for path, _, _ in leaf_fields(RunConfig)}
PATHS.update({o.flag.lstrip("-").replace("-", "_"): o.path for o in options()})
PATHS.update({f.name: f.name for f in dataclasses.fields(RunConfig)}, mixup="data.mixup")


def micro_config(
    tmp_path: Path, backend: str = "eager", model: str = "vit_micro", **overrides
) -> RunConfig:
    """A small, fast, deterministic run as the launcher would settle it (no workers, no eval
    unless asked); `overrides` by option name, e.g. shard="full", lr=1e-2."""
    cfg = RunConfig(
        model=ModelConfig(model, num_classes=10),
        data=DataConfig(workers=0, synthetic_length=128),
        batch_size=8,
        steps=5,
        output=str(tmp_path),
        run_name="t",
        eval=False,
        log_every=100,
    )
    cfg = replace_path(cfg, "accel.backend", backend)
    for key, value in overrides.items():
        cfg = replace_path(cfg, PATHS.get(key, key), value)
    return cfg


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS holding `flags` after the suite's own (conftest.py: the compile's optimisation
    level), for a command's environment."""
    return " ".join((os.environ.get("XLA_FLAGS", ""), *flags)).strip()


TWO_HOST_DEVICES = "--xla_force_host_platform_device_count=2"  # JAX's and XLA's on a CPU
# XLA's default code generation, for runs whose steps outweigh their compiles.
DEFAULT_XLA = {"XLA_FLAGS": ""}
# The suite's XLA flags with XLA's fusion emitters back in place of its elemental ones
# (conftest.py), for runs compared at float rounding with runs whose graphs differ from theirs.
FUSION_EMITTERS = {
    "XLA_FLAGS": " ".join(
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_cpu_use_fusion_emitters")
    )
}


def free_port(taken: set[int] = set()) -> int:  # noqa: B006 (the ports handed out so far)
    """A TCP port on 127.0.0.1 that nothing listens on now, never the same one twice in a
    session; tests take theirs through conftest's `free_port` fixture."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


class Launched(NamedTuple):
    """What a launch in this process gave: unpacks as (exit code, stdout, stderr), and reads as
    the subprocess.CompletedProcess of the same command would (returncode, stdout, stderr)."""

    returncode: int
    stdout: str
    stderr: str


def launch(*args: str, env: dict | None = None) -> Launched:
    """launch_single_task's main(argv) in this process, where what is checked is the run's
    outputs and not the process: its exit code, stdout and stderr. One process only: a job of
    several ranks goes through run_cli, and its test is marked slow."""
    from accel.cli.launch import main

    with as_a_command(env) as (out, err):
        code = main(list(args))
    return Launched(code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def as_a_command(env: dict | None, argv: list[str] | None = None):
    """This process's environment (`env` over it), sys.argv and standard streams as a command's
    would be, all restored after; yields the (stdout, stderr) buffers."""
    saved_env, saved_argv = dict(os.environ), sys.argv
    os.environ.update(env or {})
    sys.argv = argv if argv is not None else sys.argv
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv


CLI = "accel.launch_single_task"  # the command line: `python -m accel.launch_single_task`

# The ranks' fork server imports tests/rank_server.py alone, which imports what every forked
# process needs (torch, timm, accel's command line, these helpers) and checks that none of it
# started a thread: the server forks without exec (tests/forking.py).
RANK_PRELOAD = ["tests.rank_server"]


def train_ranks(
    output: Path, *args: str, env: dict | None = None, timeout: int = 900
) -> tuple[dict, str]:
    """train_cli's run for a job whose subject is its losses, not its launcher: each of the
    `--nproc_per_node` ranks is what torchrun would start (launch_single_task's main with RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set), forked by torch.multiprocessing
    from a fork server that imported torch, timm and accel once (set_forkserver_preload, made
    for this), instead of each rank and the launcher being a fresh interpreter paying those
    imports. Rank 0 speaks for the job, as the launcher does: its summary.json and stdout.
    The launcher's own behaviour (its flags, rendezvous, two nodes, signals) is tested through
    torchrun, with train_cli and run_cli."""
    argv = [*args, "--output", str(output), "--run_name", "r"]
    ranks = int(argv[argv.index("--nproc_per_node") + 1])
    logs = fork_ranks(ranks, None, argv, Path(output), env, timeout)
    return read_summary(output), logs[0]


def script_ranks(
    ranks: int, module: str, *args: str, logs: Path, env: dict | None = None, timeout: int = 900
) -> str:
    """`torchrun --standalone --nproc_per_node RANKS -m MODULE ARGS` for a user's script whose
    subject is what it trains, not torchrun: its ranks forked as train_ranks forks
    launch_single_task's, each running the module as `python -m` would (runpy, __main__, its
    sys.argv); the ranks' output in LOGS/rank-N.log. Rank 0's output."""
    return fork_ranks(ranks, module, list(args), logs, env, timeout)[0]


def fork_ranks(
    ranks: int, module: str | None, argv: list[str], logs: Path, env: dict | None, timeout: int
) -> list[str]:
    """The ranks of train_ranks (`module` None) and script_ranks, each to its end; each must exit
    0. Every rank's output."""
    port = str(free_port())
    files = [Path(logs) / f"rank-{rank}.log" for rank in range(ranks)]
    Path(logs).mkdir(parents=True, exist_ok=True)
    for log in files:
        log.write_text("")  # each rank appends its stdout and stderr (run_forked)
    # torchrun's variables, and one thread a rank, as torchrun gives several ranks on one host
    torchrun = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(ranks))
    torchrun.update(LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    jobs = [
        (module, argv, {**(env or {}), **torchrun, "RANK": str(r), "LOCAL_RANK": str(r)}, f, f)
        for r, f in enumerate(files)
    ]
    codes = fork_processes(jobs, timeout)
    output_of = [log.read_text() for log in files]
    assert codes == [0] * ranks, (codes, [text[-3000:] for text in output_of])
    return output_of


def fork_module(
    module: str, *args: str, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """run_module's `python -m MODULE ARGS` for a program whose subject is what it computes, not
    a fresh interpreter: in a process forked from the suite's fork server (which imported torch,
    timm and accel once), with this process's environment and `env` over it, in the project
    root. The torch_xla or JAX it runs it imports and starts itself, reading its flags and
    device count from that environment, as a fresh interpreter does. Its exit code, stdout and
    stderr."""
    folder = Path(tempfile.mkdtemp(prefix="forked-", dir=Command.folder))
    out, err = folder / "stdout", folder / "stderr"
    job = (module, list(args), {**os.environ, **(env or {})}, out, err)
    (code,) = fork_processes([job], timeout)
    stdout, stderr = out.read_text(), err.read_text()
    return subprocess.CompletedProcess(["-m", module, *args], code, stdout, stderr)


def train_forked(output: Path, *args: str, env: dict | None = None) -> tuple[dict, str]:
    """train_cli's run (one process: its XLA's or JAX's device count and flags its own) as
    fork_module's `python -m accel.launch_single_task`: its summary.json and stdout."""
    argv = (*args, "--output", str(output), "--run_name", "r")
    done = fork_module(CLI, *argv, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_summary(output), done.stdout


def fork_processes(jobs: list[tuple], timeout: int) -> list[int | None]:
    """Each job (module or None, argv, environment over the server's, stdout file, stderr file)
    in a process forked from the suite's fork server (torch.multiprocessing's, which imported
    RANK_PRELOAD once: set_forkserver_preload, made for this; one that runs no thread as it
    forks, tests/rank_server.py), all at once, each to its end or killed at `timeout`: their
    exit codes."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    processes = [context.Process(target=run_forked, args=job) for job in jobs]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [process.exitcode for process in processes]


def run_forked(module: str | None, argv: list[str], env: dict, out: str, err: str) -> None:
    """One job of fork_processes, in a process of the fork server's: `env` over its environment,
    stdout and stderr to the files (the file descriptors, so that what C++ prints goes there
    too, and faulthandler's stacks of every thread where the process crashes), in the project
    root; launch_single_task's main(argv), or `module` run as `python -m MODULE ARGV` runs it.
    Where the server ran threads as it forked, or an import of its started one, the process
    refuses to run (exit EXIT_UNSAFE_FORK), saying so."""
    from accel.cli.launch import main

    for fd, path in ((1, out), (2, err)):
        with open(path, "a") as file:
            os.dup2(file.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    server = sys.modules.get("tests.rank_server")
    refused = check_parent(getattr(server, "REFUSED", ""))
    if refused or getattr(server, "REFUSED", ""):
        print(refused or f"refusing to run: {server.REFUSED}", file=sys.stderr, flush=True)
        sys.exit(EXIT_UNSAFE_FORK)
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # torch was imported by the server, before this could reach it
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(ROOT)
    if module is None:
        code = main(argv)
    else:
        sys.argv = [module, *argv]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # multiprocessing makes it the process's exit code


def train(output: Path, *args: str, env: dict | None = None) -> tuple[dict, str]:
    """train_cli's run in this process: a run named 'r' that must succeed, its summary.json and
    stdout."""
    code, stdout, stderr = launch(*args, "--output", str(output), "--run_name", "r", env=env)
    assert code == 0, stderr[-3000:]
    return read_summary(output), stdout


class Command:
    """A Python command in a fresh interpreter, as a user starts it, with what the suite uses of
    subprocess.Popen (pid, poll, wait, send_signal, terminate, kill, returncode, args) and
    stdout and stderr as text files to read while it runs (stdin is /dev/null); files rather
    than pipes, so that a command that prints much never waits for the test to read.
    `python -m accel.launch_single_task ARGV` unless `script` (`python SCRIPT ARGV`) or `module`
    (`python -m MODULE ARGV`) says otherwise."""

    folder: Path | None = None  # where the files go: set by conftest for the session
    count = 0

    def __init__(
        self,
        argv: list[str],
        env: dict | None = None,
        script: str | None = None,
        cwd: Path = ROOT,
        new_session: bool = False,
        module: str = CLI,
    ):
        python = [script, *argv] if script else ["-m", module, *argv]
        Command.count += 1
        base = (Command.folder or Path(tempfile.mkdtemp())) / f"command-{Command.count}"
        out, err = base.with_suffix(".out"), base.with_suffix(".err")
        with out.open("w") as stdout, err.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, *python],
                cwd=cwd,
                # A command that hangs shows where: SIGABRT (run_command's at its timeout)
                # prints each thread's Python stack, in it and in every process it starts.
                env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=new_session,
            )
        self.args, self.pid = self.process.args, self.process.pid
        self.stdout = out.open()  # closed by communicate
        self.stderr = err.open()
        self.stdin = None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (minus the signal's number if one ended it); TimeoutExpired past
        `timeout` seconds."""
        return self.process.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end; all of stdout and stderr (from where reading has got to)."""
        self.wait(timeout)
        out, err = self.stdout.read(), self.stderr.read()
        self.stdout.close()
        self.stderr.close()
        return out, err


def start_cli(*args: str, env: dict | None = None) -> Command:
    """launch_single_task in the background, to signal or kill it while it trains."""
    return Command(list(args), env)


def run_command(command: Command, timeout: int) -> subprocess.CompletedProcess:
    """`command` to its end, as subprocess.run. Past `timeout` it fails with the stacks of every
    thread of it and of the processes it started (each aborted, faulthandler printing them), and
    the end of its output; none of them is left running."""
    try:
        out, err = command.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_hung(command)
        raise AssertionError(
            f"{shlex.join(command.args)} ran past {timeout} s: its stdout's end\n{out[-2000:]}\n"
            f"its stderr's end, with each process's stacks\n{err[-12000:]}"
        ) from None
    return subprocess.CompletedProcess(command.args, command.returncode, out, err)


def stop_hung(command: Command) -> tuple[str, str]:
    """Abort `command` and every process under it (their stacks then reach its stderr, which
    they share), kill what is left; its stdout and stderr."""
    try:
        parent = psutil.Process(command.pid)
        family = [*reversed(parent.children(recursive=True)), parent]
    except psutil.NoSuchProcess:
        family = []
    # All stopped where they hang, then aborted one at a time, the deepest first: stacks written
    # to the one stderr at once would interleave, and a parent would move on once its child ended.
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.suspend()
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGABRT)
            process.resume()
            psutil.wait_procs([process], timeout=5)
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return command.communicate()


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m accel.launch_single_task ARGS` (with `env` over this process's environment) in
    a process of its own."""
    return run_command(Command(list(args), env), timeout)


def run_script(
    script: str, *args: str, env: dict | None = None, cwd: Path = ROOT, timeout: int = 600
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in `cwd`, in a process of its own."""
    return run_command(Command(list(args), env, str(Path(cwd) / script), cwd), timeout)


def run_module(
    module: str, *args: str, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (torchrun is `torch.distributed.run`) in the project root, in a
    process of its own."""
    return run_command(Command(list(args), env, module=module), timeout)


def train_cli(output: Path, *args: str, env: dict | None = None) -> tuple[dict, str]:
    """A launch_single_task run named 'r' that must succeed: its summary.json and stdout."""
    result = run_cli(*args, "--output", str(output), "--run_name", "r", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_summary(output), result.stdout


def run_python(
    code: str, timeout: int = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -c code` in the project root (with `env` over this process's environment)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_cli_without(package: str, *args: str) -> subprocess.CompletedProcess:
    """launch_single_task in a process where `package` cannot be imported (as if not installed)."""
    code = (
        f"import sys; sys.modules[{package!r}] = None; "
        "from accel.cli.launch import main; "
        f"sys.exit(main({list(args)!r}))"
    )
    return run_python(code)


def read_summary(output: Path) -> dict:
    found = sorted(Path(output).glob("*/*/*/summary.json"))
    assert found, f"no summary.json under {output}"
    return json.loads(found[-1].read_text())


def flat_tensors(state: dict, prefix: str = "") -> dict:
    """{'model.x': tensor, 'optim.x.exp_avg': tensor, ...} of a nested state."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def checkpoint_tensors(path: Path) -> dict:
    """A checkpoint's model, optimizer and EMA tensors by flattened name; a folder's gathered whole
    with torch.distributed.checkpoint's own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if path.is_dir():
        whole = path.with_name(f".{path.name}.whole.pt")  # beside it, under the test's tmp_path
        try:
            dcp_to_torch_save(path, whole)
            state = torch.load(whole, weights_only=True)
        finally:
            whole.unlink(missing_ok=True)
    else:
        state = torch.load(path, weights_only=True)["state"]
    sections = ("model", "optim", "ema")
    return {k: v for k, v in flat_tensors(state).items() if k.split(".")[0] in sections}


def backend_tensors(backend) -> dict:
    """What a backend would save now, whole, by flattened name."""
    from accel.checkpoint import to_cpu

    return flat_tensors(to_cpu(backend.checkpoint_state()))


def engine_tensors(engine) -> dict:
    """What an Engine would save now (its checkpoint's tensors), whole, by flattened name."""
    from accel.checkpoint import to_cpu

    return flat_tensors(to_cpu(engine.checkpoints.parts().tensors.state_dict()))


def rank_process(launcher: psutil.Process, rank: str) -> psutil.Process | None:
    """The launcher's process of `rank`, once started; children that come and go while it looks
    (the loader's short-lived helpers) are passed over."""
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == rank and "accel.launch_single_task" in " ".join(
                child.cmdline()
            ):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


# --- a user's own script, for the public API's tests ----------------------------------------
class Net(nn.Module):
    """A user's own model: a conv stem (jax differentiates the convolution itself), a norm, a
    head."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x).mean((2, 3))
        return self.head(nn.functional.gelu(self.norm(features)))


def api_loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def api_metric_fn(model: nn.Module, batch: tuple) -> dict:
    images, labels = batch
    return {"correct": (model(images).argmax(-1) == labels).sum(), "count": len(labels)}


def colour_batches(count: int = 5, size: int = 16, seed: int = 0) -> list[tuple]:
    """Images whose class sets their mean colour."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.rand(5, 3, 1, 1, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(count):
        labels = torch.randint(0, 5, (size,), generator=g)
        out.append((colours[labels] + 0.3 * torch.randn(size, 3, 8, 8, generator=g), labels))
    return out


def grouped(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """Two param groups: no weight decay on norms and biases, and the head at twice the rate."""
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.startswith("head")]
    flat = [p for p in model.parameters() if p.ndim <= 1]
    head = [model.head.weight]
    groups = [
        {"params": decay},
        {"params": flat, "weight_decay": 0.0},
        {"params": head, "lr": 2 * LR[kind]},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=LR[kind], momentum=0.9, nesterov=True, weight_decay=1e-3)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=LR[kind], weight_decay=1e-3)
    return torch.optim.AdamW(groups, lr=LR[kind], weight_decay=0.05)


LR = {"adamw": 1e-2, "adam": 1e-2, "sgd": 0.1}


# A batch of four tensors of four ranks, and a loss that reads every one.
def four_tensor_batches(count: int = 3, size: int = 8) -> list[tuple]:
    """Images [N, 3, 8, 8], soft targets [N, 5], per-sample weights [N] and masks [N, 8, 8]."""
    g = torch.Generator().manual_seed(3)
    out = []
    for images, labels in colour_batches(count, size):
        targets = nn.functional.one_hot(labels, 5).float() * 0.9 + 0.02
        weights = torch.rand(size, generator=g) + 0.5
        masks = (torch.rand(size, 8, 8, generator=g) > 0.2).float()
        out.append((images, targets, weights, masks))
    return out


def four_tensor_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, targets, weights, masks = batch
    logits = model(images * masks[:, None])
    per_sample = -(targets * logits.log_softmax(-1)).sum(-1)
    return (weights * per_sample).sum() / weights.sum()


def four_tensor_run(backend: str, devices: int = 1) -> tuple[list, list[float], list[str]]:
    """The loader's batches' shapes and dtypes, the losses of three steps, and on an xla mesh
    the sharding of each tensor of the first batch (torch_xla's public sharded view)."""
    import accel

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = accel.prepare(
        model, optimizer, four_tensor_loss, backend=backend, devices=devices, quiet=True
    )
    loaded = list(engine.loader(four_tensor_batches()))
    kept = [[(list(t.shape), str(t.dtype)) for t in batch] for batch in loaded]
    split = []
    if backend == "xla" and devices > 1:
        import torch_xla.distributed.spmd as xs

        split = [xs.wrap_if_sharded(t).sharding_spec for t in loaded[0]]
    return kept, [r.loss for r in engine.fetch([engine.step(*b) for b in loaded])], split


class HostReads(TorchFunctionMode):
    """Records every tensor method that hands a value to Python (a wait for the device)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def dirty_mock_imagenet(folder: Path, val_per_class: int) -> Path:
    """3 classes of 6 real JPEGs for training, plus every awkward kind of file in the first."""
    from accel.cli.data.prepare import prepare_mock_imagenet

    root = prepare_mock_imagenet(
        folder / "imagenet",
        classes=3,
        per_class=6,
        val_per_class=val_per_class,
        size=40,
        progress=False,
    )
    add_bad_files(root)
    return root


def add_bad_files(root: Path) -> dict[str, Path]:
    """Real files of every awkward kind in the first class folder of train/."""
    import numpy as np
    from PIL import Image

    folder = sorted((root / "train").iterdir())[0]
    good = next(folder.glob("*.JPEG")).read_bytes()
    rgb = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    files = {
        "truncated": folder / "truncated.jpg",
        "empty": folder / "empty.jpg",
        "not_image": folder / "notes.png",
        "gray": folder / "gray.jpg",
        "rgba": folder / "rgba.png",
        "cmyk": folder / "cmyk.jpg",
    }
    files["truncated"].write_bytes(good[: len(good) // 2])
    files["empty"].write_bytes(b"")
    files["not_image"].write_text("this is not an image\n")
    Image.fromarray(rgb[..., 0], mode="L").save(files["gray"])
    Image.fromarray(np.dstack([rgb, rgb[..., :1]]), mode="RGBA").save(files["rgba"])
    Image.fromarray(rgb, mode="RGB").convert("CMYK").save(files["cmyk"])
    return files


# --- the NaN-on-white model's runs (tests/nan_model.py) --------------------------------------
NAN_EPOCHS = 2


def nan_config(tmp_path, backend: str, data, **kw):
    """Two epochs of the NaN-on-white model on `data`, a checkpoint after every step."""
    from tests import nan_model

    return micro_config(
        tmp_path,
        backend=backend,
        model=nan_model.NAME,
        source=str(data),
        num_classes=2,
        batch_size=4,
        steps=None,
        epochs=NAN_EPOCHS,
        save_every=1,
        keep_checkpoints=0,
        log_every=1,
        **kw,
    )


def same_state(fa: dict, fb: dict) -> bool:
    """Equal weights and optimizer state; state not created yet counts as AdamW's zeros."""
    import torch

    if {k for k in fa if k.startswith("model.")} != {k for k in fb if k.startswith("model.")}:
        return False
    for k in fa.keys() | fb.keys():
        x = fa.get(k, torch.zeros_like(fb.get(k, torch.zeros(()))))
        y = fb.get(k, torch.zeros_like(x))
        if not torch.equal(x.float(), y.float()):
            return False
    return True


def nan_rank(rank: int, cfg, port: int) -> None:
    """One of two spawned ranks training `cfg` (the NaN-on-white model, sharded or piped)."""
    from accel.cli.train import Trainer
    from accel.distributed import destroy_process_group
    from tests import nan_model  # noqa: F401 (registers the model in this spawned process)

    # torchrun's variables: prepare joins the process group from them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", LOCAL_RANK=str(rank))
    try:
        Trainer(cfg).train()
    finally:
        destroy_process_group()


def job_backend(cfg, ctx=None):
    """The backend of a command-line config with the command line's job adopted, as
    accel.prepare builds it, for tests that look inside a backend (its layout, its core); `ctx`
    for a process group the test started itself."""
    from accel.backends import backend_module
    from accel.cli.job import adamw, backend_config, run_model
    from accel.cli.task import classifier_loss
    from accel.distributed import DistContext
    from accel.optim import OptimizerSpec

    model, init = run_model(cfg)
    spec = OptimizerSpec.of(adamw(model, cfg.optim), model)
    backend = backend_module(cfg.backend).build(backend_config(cfg), ctx or DistContext())
    backend.adopt(model, spec, classifier_loss, init)
    return backend


def steps_reading_nothing(engine, backend: str, data: list) -> list:
    """Two warm-up steps (compiles, first-step allocations), then the rest of `data`'s steps,
    asserting that none reads a value back to the host before fetch (jax: a device-to-host
    transfer raises); the handles of those steps."""
    engine.fetch([engine.step(*b) for b in data[:2]])
    if backend == "jax":
        import jax

        with jax.transfer_guard_device_to_host("disallow"):
            return [engine.step(*b) for b in data[2:]]
    with HostReads() as reads:
        handles = [engine.step(*b) for b in data[2:]]
    assert reads.seen == []
    return handles


def gpu_tier_only(markexpr: str) -> bool:
    """Whether pytest's -m expression selects the GPU tier alone ('gpu', 'gpu and not slow')."""
    return re.fullmatch(r"\s*gpu(\s+and\s+.+)?\s*", markexpr) is not None


def jax_platform_default(markexpr: str, cuda_visible: bool) -> str | None:
    """The JAX_PLATFORMS the suite sets where the environment leaves it unset: the CPU tiers run
    JAX on its CPU platform, as they run torch_xla on PJRT CPU; a run of the GPU tier alone
    (`pytest -m gpu`) where a CUDA device is visible sets nothing, so JAX takes the GPU, and the
    tier's jax tests assert that it did.

    >>> jax_platform_default("gpu", cuda_visible=True) is None
    True
    >>> jax_platform_default("not slow and not gpu", cuda_visible=True)
    'cpu'
    """
    return None if cuda_visible and gpu_tier_only(markexpr) else "cpu"
