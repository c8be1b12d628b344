"""launch_single_task: train one timm Swin/ViT job on the chosen backend.

`--nproc_per_node N` re-launches this module N times through torch.distributed.run (torchrun).
`USE_ACCEL=1` selects the XLA compiler path when `--backend` is not given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from types import ModuleType

START = time.perf_counter()  # before the heavy imports below: time_to_first_step counts them

from accel.amp import check_amp_level  # noqa: E402
from accel.backends import BackendUnavailable, backend_module  # noqa: E402
from accel.backends.base import RecompileError  # noqa: E402
from accel.config import (  # noqa: E402
    AMP_LEVELS,
    BACKENDS,
    NAN_POLICIES,
    PP_SCHEDULES,
    SHARD_MODES,
    ConfigError,
    OptimConfig,
    RunConfig,
)
from accel.distributed import (  # noqa: E402
    DistContext,
    destroy_process_group,
    env_context,
    init_process_group,
    launched_by_torchrun,
)
from accel.parallel.mesh import check_mesh, mesh_lines  # noqa: E402
from accel.signals import NonFiniteLoss, TrainingStopped  # noqa: E402
from data.collate import MixupConfig  # noqa: E402
from data.folder import BadImageError, DatasetError  # noqa: E402
from data.loaders import DataConfig, dataset_num_classes  # noqa: E402
from models.factory import ModelConfig, UnknownModelError, check_model_name  # noqa: E402

USER_ERRORS = (ConfigError, BackendUnavailable, UnknownModelError, DatasetError, BadImageError)
EXIT_USER_ERROR = 2
EXIT_RECOMPILES = 3
EXIT_NONFINITE = 4
DEFAULT_EPOCHS = 1  # the run length when neither --steps nor --epochs is given


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="launch_single_task",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--compare",
        default="",
        help="run the same job on each of these backends (e.g. eager,xla) and print a table: "
        "img/s, speed-up over the first, time to first step, compiles after warm-up",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="default: eager, or the XLA path when USE_ACCEL=1",
    )
    p.add_argument(
        "--model", default="vit_micro", help="any timm model name, or vit_micro/swin_micro"
    )
    p.add_argument("--pool", choices=("token", "avg"), default="token", help="classifier pooling")
    p.add_argument(
        "--drop_path",
        type=float,
        default=None,
        help="stochastic depth rate (default: the model's own)",
    )
    p.add_argument(
        "--img_size", type=int, default=None, help="input side (default: the model's own)"
    )
    p.add_argument("--data", default="synthetic", help="'synthetic' or an ImageNet-layout folder")
    p.add_argument("--num_classes", type=int, default=10, help="synthetic data only")
    p.add_argument("--synthetic_length", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=32, help="per device and micro-step")
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default: {DEFAULT_EPOCHS} epoch)"
    )
    length.add_argument("--epochs", type=int, default=None)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--clip_grad", type=float, default=1.0, help="max grad norm, 0 = off")
    p.add_argument("--amp_level", default="O0", help=f"one of {', '.join(AMP_LEVELS)}")
    p.add_argument("--amp_dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument(
        "--kernel-opt",
        dest="kernel_opt",
        action="store_true",
        help="the backend's extra fused paths: compile: inductor max-autotune; xla: syncfree "
        "AdamW (eager's AdamW is always fused, jax's attention always JAX's)",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="activation checkpointing where memory is short: eager/compile: timm's per-block "
        "gradient checkpointing; jax: jax.checkpoint saving only the layers' matmul outputs",
    )
    p.add_argument(
        "--shard",
        choices=SHARD_MODES,
        default="none",
        help="split weights, gradients and optimizer state over the data-parallel replicas: "
        "full (FSDP2 per block on eager/compile; sharded arrays on jax), grad_op (weights kept "
        "gathered through the step: ZeRO-2's traffic), none (replicas)",
    )
    p.add_argument(
        "--tp_head",
        type=int,
        default=1,
        help="split the classifier's classes over N ranks (eager, compile): a dp x tp mesh of "
        "--nproc_per_node processes; logits and loss stay split",
    )
    p.add_argument(
        "--pp", type=int, default=1, help="cut a ViT into N pipeline stages (eager): dp x pp mesh"
    )
    p.add_argument("--pp_schedule", choices=PP_SCHEDULES, default="1f1b")
    p.add_argument(
        "--pp_microbatches", type=int, default=4, help="micro-batches per batch in the pipeline"
    )
    p.add_argument("--mixup", type=float, default=0.0, help="mixup alpha (0 = off)")
    p.add_argument("--cutmix", type=float, default=0.0, help="cutmix alpha (0 = off)")
    p.add_argument("--mixup_off_epoch", type=int, default=0, help="stop mixup from this epoch")
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=2, help="data loader workers per process")
    p.add_argument(
        "--data_device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="where training JPEGs are decoded and cropped: gpu (nvJPEG, in the training "
        "process) or cpu (the loader workers); auto: gpu when training from a folder on a CUDA GPU",
    )
    p.add_argument(
        "--strict-data",
        dest="strict_data",
        action="store_true",
        help="stop at the first unreadable image instead of skipping it",
    )
    p.add_argument(
        "--nan_policy",
        choices=NAN_POLICIES,
        default="stop",
        help="a step with a non-finite loss or gradient never updates the weights; then skip "
        "it and go on, or stop (checkpoint, exit 4) at the next loss fetch (--log_every)",
    )
    p.add_argument("--nproc_per_node", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs")
    p.add_argument("--run_name", default="", help="default: a timestamp")
    p.add_argument("--save_every", type=int, default=0, help="steps between checkpoints")
    p.add_argument("--keep_checkpoints", type=int, default=3)
    p.add_argument("--resume", default="", help="'auto' (latest of this run) or a checkpoint path")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument(
        "--timing_warmup_steps", type=int, default=2, help="first steps left out of img/s"
    )
    p.add_argument("--no-eval", dest="eval", action="store_false", help="skip final evaluation")
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=0.0,
        help="accelerator bf16 peak TFLOP/s for MFU (default: looked up by device)",
    )
    xla = p.add_argument_group("XLA compiler backends (xla, jax)")
    xla.add_argument(
        "--max_recompiles",
        type=int,
        default=-1,
        help="stop when more graphs than this compile after warm-up (-1: no limit)",
    )
    xla.add_argument(
        "--compile_cache",
        default="",
        help="persistent compilation cache folder (default OUTPUT/.compile_cache/)",
    )
    xla.add_argument("--loader_prefetch", type=int, default=8, help="host batches queued ahead")
    xla.add_argument("--device_prefetch", type=int, default=4, help="device batches queued ahead")
    xla.add_argument(
        "--grad_reduce",
        choices=("all_reduce", "optimizer_step"),
        default="all_reduce",
        help="xla: explicit xm.all_reduce of the gradients, or torch_xla's "
        "reduce_gradients (what xm.optimizer_step does)",
    )
    return p


def resolve_backend(requested: str | None, env: dict[str, str]) -> tuple[str, str]:
    """(backend, why) from --backend and USE_ACCEL."""
    if requested:
        return requested, "--backend"
    if env.get("USE_ACCEL", "0") not in ("", "0"):
        import torch

        if torch.cuda.is_available():
            return "jax", "USE_ACCEL=1 and a CUDA GPU is visible (XLA:GPU through JAX)"
        return "xla", "USE_ACCEL=1 and no CUDA GPU is visible (torch_xla)"
    return "eager", "default, USE_ACCEL unset"


def run_length(args: argparse.Namespace) -> tuple[int, int]:
    """(steps, epochs): the default length where neither is given (announced in run()); a given
    0 stays 0, and validate() refuses it."""
    if args.steps is None and args.epochs is None:
        return 0, DEFAULT_EPOCHS
    return args.steps or 0, args.epochs or 0


def config_from_args(args: argparse.Namespace, backend: str) -> RunConfig:
    steps, epochs = run_length(args)
    mixup = MixupConfig(
        mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, off_epoch=args.mixup_off_epoch
    )
    data = DataConfig(
        source=args.data,
        num_classes=args.num_classes,
        synthetic_length=args.synthetic_length,
        workers=args.workers,
        label_smoothing=args.label_smoothing,
        mixup=mixup,
        strict=args.strict_data,
        decode_on={"auto": "auto", "cpu": "workers", "gpu": "cuda"}[args.data_device],
    )
    optim = OptimConfig(
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        clip_grad=args.clip_grad,
        grad_accum=args.grad_accum,
    )
    return RunConfig(
        backend=backend,
        model=ModelConfig(args.model, args.num_classes, args.pool, args.drop_path, args.img_size),
        data=data,
        optim=optim,
        batch_size=args.batch_size,
        steps=steps,
        epochs=epochs,
        amp_level=args.amp_level,
        amp_dtype=args.amp_dtype,
        kernel_opt=args.kernel_opt,
        remat=args.remat,
        shard=args.shard,
        tp_head=args.tp_head,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
        seed=args.seed,
        output=args.output,
        run_name=args.run_name,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        log_every=args.log_every,
        timing_warmup_steps=args.timing_warmup_steps,
        eval=args.eval,
        nproc_per_node=args.nproc_per_node,
        max_recompiles=args.max_recompiles,
        compile_cache=args.compile_cache,
        loader_prefetch=args.loader_prefetch,
        device_prefetch=args.device_prefetch,
        grad_reduce=args.grad_reduce,
        peak_tflops=args.peak_tflops,
        nan_policy=args.nan_policy,
    )


def validate(cfg: RunConfig) -> ModuleType:
    """Fail fast, before any process starts, on input that cannot work."""
    check_amp_level(cfg.amp_level)
    check_model_name(cfg.model.name)
    if cfg.batch_size < 1 or cfg.optim.grad_accum < 1 or cfg.nproc_per_node < 1:
        raise ConfigError("--batch_size, --grad_accum and --nproc_per_node must be >= 1")
    if cfg.data.mixup.enabled and cfg.batch_size % 2:
        raise ConfigError(f"--mixup/--cutmix need an even --batch_size, got {cfg.batch_size}")
    if cfg.steps < 0 or cfg.epochs < 0 or not (cfg.steps or cfg.epochs):
        raise ConfigError("give a positive --steps or --epochs")
    if not cfg.data.is_synthetic:
        dataset_num_classes(cfg.data)  # raises DatasetError for a missing or empty folder
    _check_gpu_count(cfg)
    check_mesh(cfg)
    return backend_module(cfg.backend)  # raises BackendUnavailable with the install command


def _check_gpu_count(cfg: RunConfig) -> None:
    if cfg.backend not in ("eager", "compile"):
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and cfg.nproc_per_node > gpus:
        raise ConfigError(f"--nproc_per_node {cfg.nproc_per_node} exceeds the {gpus} visible GPUs")


def resolve_decode_on(cfg: RunConfig) -> str | None:
    """Settle where JPEGs are decoded (--data_device): on the GPU by default when training from
    a folder on one, where a GPU decoder works. Returns a line to print when it falls back."""
    data = cfg.data
    if data.decode_on not in ("auto", "cuda"):
        return None
    import torch

    if data.is_synthetic:
        reason = "--data synthetic has no JPEGs to decode"
    elif cfg.backend == "xla":
        reason = "the xla backend does not train on a CUDA GPU"
    elif not torch.cuda.is_available():
        reason = "no CUDA GPU is visible to torch"
    else:
        reason = None
    if reason and data.decode_on == "cuda":
        raise ConfigError(f"--data_device gpu: {reason}")
    data.decode_on = "workers"
    if reason:
        return None
    from data.device_decode import device_decoding_error

    refused = device_decoding_error(torch.device("cuda"))
    if refused:
        return f"no GPU JPEG decoder ({refused}): JPEGs are decoded by the CPU workers"
    data.decode_on = "cuda"
    return None


def resolve_run_name(cfg: RunConfig) -> str:
    """The run folder name: given, the latest run when resuming, or a new timestamp."""
    if cfg.run_name:
        return cfg.run_name
    parent = Path(cfg.output) / cfg.model.name / cfg.backend
    if cfg.resume == "auto" and parent.is_dir():
        runs = sorted(
            (p for p in parent.iterdir() if (p / "checkpoints").is_dir()),
            key=lambda p: p.stat().st_mtime,
        )
        if runs:
            return runs[-1].name
    return datetime.now().strftime("run-%Y%m%d-%H%M%S-%f")


def spawn(cfg: RunConfig, argv: list[str]) -> int:
    """Start nproc_per_node copies of this module through torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args = [
        "--standalone",
        f"--nproc_per_node={cfg.nproc_per_node}",
        "--module",
        "accel.launch_single_task",
        *argv,
        "--backend",
        cfg.backend,
        "--run_name",
        cfg.run_name,
    ]
    try:
        torchrun(args)
    except ChildFailedError as err:
        # The ranks' own exit code where they agree on one of ours, as in one process. A rank
        # that exits 1 (an unexpected error) is left out of the vote and named last: when one
        # rank stops on bad input, the others' collectives fail with it, and whether they exit
        # before torchrun stops them is a race.
        failures = sorted(err.failures.items(), key=lambda item: item[1].exitcode == 1)
        ranks = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in failures)
        error(f"training failed on {ranks}")
        ours = {EXIT_USER_ERROR, EXIT_RECOMPILES, EXIT_NONFINITE}
        codes = {f.exitcode for f in err.failures.values()} - {1}
        return codes.pop() if len(codes) == 1 and codes <= ours else 1
    return 0


def one_line(err: BaseException) -> str:
    """Errors re-raised from data workers carry the worker traceback: keep its last line."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else type(err).__name__
    name = type(err).__name__
    return last.split(f"{name}: ", 1)[-1]


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        from accel.compare import parse_backends, run_comparison

        return run_comparison(argv, parse_backends(args.compare), args.model, args.output)
    backend, why = resolve_backend(args.backend, dict(os.environ))
    cfg = config_from_args(args, backend)
    ctx = env_context()
    if ctx.is_main:
        print(f"accel: backend {backend} ({why})", flush=True)
    if args.steps is None and args.epochs is None and ctx.is_main:
        print(
            f"accel: no --steps or --epochs given: training {DEFAULT_EPOCHS} epoch of {args.data}",
            flush=True,
        )
    module = validate(cfg)
    notes = [resolve_decode_on(cfg), *mesh_lines(cfg)]
    for note in filter(None, notes if ctx.is_main else ()):
        print(f"accel: {note}", flush=True)
    cfg.run_name = resolve_run_name(cfg)
    if cfg.nproc_per_node > 1 and not launched_by_torchrun():
        if not hasattr(module, "launch_replicas"):
            return spawn(cfg, argv)
        from accel.train import run_replica

        module.launch_replicas(cfg, run_replica)  # the backend's own multi-replica launcher
    else:
        train_here(cfg, ctx)
    if ctx.is_main:
        summary = json.loads((cfg.run_dir() / "summary.json").read_text())
        print(
            f"accel: {summary['images_per_sec']:.1f} img/s ({backend}, {cfg.model.name}, "
            f"world size {summary['world_size']}); summary in {cfg.run_dir() / 'summary.json'}"
        )
    return 0


def train_here(cfg: RunConfig, ctx: DistContext) -> None:
    from accel.train import Trainer

    init_process_group(ctx)
    try:
        Trainer(cfg, ctx, START).train()
    finally:
        destroy_process_group()


def error(message: str) -> None:
    """One line on stderr; a process started by torchrun says which rank it is."""
    rank = f" (rank {env_context().rank})" if launched_by_torchrun() else ""
    print(f"launch_single_task: error{rank}: {message}", file=sys.stderr, flush=True)


def one_line_warnings() -> None:
    """The project's own warnings (skipped files, empty classes, ...) print as one line, without
    the source line Python adds after each, above the progress bar (tqdm.write); other
    libraries' keep their usual format."""
    from tqdm import tqdm

    if getattr(warnings.showwarning, "one_line", False):  # main() may run more than once
        return
    ours = tuple(str(Path(__file__).resolve().parents[1] / pkg) for pkg in ("accel", "data"))
    usual = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not str(filename).startswith(ours):
            return usual(message, category, filename, lineno, file, line)
        tqdm.write(f"warning: {message}", file=file or sys.stderr)

    show.one_line = True
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    one_line_warnings()
    try:
        return run(sys.argv[1:] if argv is None else argv)
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
