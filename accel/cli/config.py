"""The command line's run configuration: small frozen dataclasses of its own task, data and hosts,
beside the library's own `BackendConfig` (RunConfig.accel), which it holds rather than declares
again. The command line is generated from them (options.py), the launcher settles what is left
open (resolve.py), job.py hands RunConfig.accel to `accel.prepare`, and the final config is saved
in the run folder.

Each of the command line's own options is declared once, as a field with its help, flag and
range; each of the library's settings that is a flag is declared once, in LIBRARY_FLAGS: the one
place where a library field (`step.accum`) meets the flag the command line spells it with
(`--grad_accum`).

Field metadata keys: help, flag (default --<name>), choices, min/max (inclusive), above/below
(exclusive), group (help section of a top-level field), cli=False (not an option), resume="same"
(a checkpoint resumes only with the same value: it shapes the model or orders the data).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from accel.cli.console import BEST_METRICS
from accel.cli.data.config import DataConfig
from accel.cli.models.factory import ModelConfig
from accel.config import (
    AccelError,
    BackendConfig,
    MeshConfig,
    StepConfig,
    shared_compile_cache,
)

RECIPE_NAMES = ("swin_tiny_in1k", "deit_base_in1k", "vit_finetune")  # accel/recipes.py
DEFAULT_EPOCHS = 1  # the run length when neither --steps nor --epochs is given


def option(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


RUN, PRECISION, OUTPUT = "Run", "Precision and kernels", "Output, checkpoints and logging"


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its schedule and the weights' moving average (the step's gradient
    clipping and accumulation are the library's: LIBRARY_FLAGS)."""

    lr: float = option(1e-3, "peak learning rate (AdamW)", above=0)
    weight_decay: float = option(0.05, "AdamW weight decay (not on norms and biases)", min=0)
    betas: tuple[float, float] = option((0.9, 0.999), "AdamW betas", min=0, below=1)
    warmup_steps: int = option(0, "linear warm-up steps of the cosine schedule", min=0)
    min_lr: float = option(1e-6, "learning rate at the end of the schedule", min=0)
    warmup_epochs: float = option(0.0, "warm-up epochs (added to --warmup_steps)", min=0)
    layer_decay: float = option(
        0.0,
        "layer-wise learning-rate decay, timm's (0 = off; 0.65-0.75 to fine-tune a ViT)",
        min=0,
        max=1,
    )
    # timm's ModelEmaV3 policy, which job.py turns into the decay function the library's
    # `step.ema` takes (the library takes a decay or a function of the step, not these three).
    model_ema: bool = option(False, "keep an exponential moving average of the weights")
    model_ema_decay: float = option(0.9998, "its decay", min=0, below=1)
    model_ema_warmup: bool = option(False, "warm the decay up, as timm's ModelEmaV3")


@dataclass(frozen=True)
class HostsConfig:
    """The hosts a job spans and how they meet (the mesh over their devices is the library's)."""

    nnodes: int = option(1, "hosts the job spans (one launcher a host)", min=1)
    node_rank: int = option(0, "this host's place among them (with --master_addr)", min=0)
    master_addr: str = option("", "rank 0's host, reachable from every node (static rendezvous)")
    master_port: int = option(29500, "rank 0's port (static rendezvous)", min=1, max=65535)
    rdzv_endpoint: str = option(
        "", "host:port of a c10d rendezvous (instead of --master_addr/--master_port)"
    )


def command_line_defaults() -> BackendConfig:
    """The library's settings as a run of the command line starts them: gradients clipped at a
    norm of 1 (--clip_grad's default; a script's prepare() clips only when asked), and one
    process or device until --nproc_per_node says more (ACCEL_DEVICES is a script's)."""
    return BackendConfig(step=StepConfig(clip_grad=1.0), mesh=MeshConfig(devices=1))


@dataclass(frozen=True)
class RunConfig:
    accel: BackendConfig = field(default_factory=command_line_defaults)
    recipe: str = option(
        "",
        "a published recipe's hyper-parameters (explicit options override them)",
        choices=("", *RECIPE_NAMES),
        group=RUN,
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    hosts: HostsConfig = field(default_factory=HostsConfig)
    batch_size: int = option(32, "images per device and micro-step", min=1, group=RUN)
    steps: int | None = option(
        None, f"optimizer steps (default: {DEFAULT_EPOCHS} epoch)", min=1, group=RUN
    )
    epochs: int | None = option(None, "epochs (instead of --steps)", min=1, group=RUN)
    nan_policy: str = option(
        "stop",
        "a step with a non-finite loss or gradient never updates the weights; then skip it and "
        "go on, or stop (checkpoint, exit 4) at the next loss fetch (--log_every)",
        choices=("skip", "stop"),
        group=RUN,
    )
    output: str = option("runs", "output folder", group=OUTPUT)
    run_name: str = option("", "run folder name (default: a timestamp)", group=OUTPUT)
    resume: str = option(
        "", "'auto' (latest checkpoint of this run) or a checkpoint path", group=OUTPUT
    )
    save_every: int = option(
        0, "steps between checkpoints (0: at the end only)", min=0, group=OUTPUT
    )
    keep_checkpoints: int = option(3, "checkpoints kept (0 keeps all)", min=0, group=OUTPUT)
    save: bool = option(
        True,
        "write no checkpoint at the end (a benchmark's run); a stop by a signal or a non-finite "
        "loss still writes one, to resume from",
        flag="--no-save",
        group=OUTPUT,
    )
    checkpoint_best: str = option(
        "",
        "also keep the best evaluation's checkpoint by this metric (RUN/checkpoints/best.pt, "
        "beside the newest): each --eval_every evaluation and the final one",
        choices=("", *BEST_METRICS),
        group=OUTPUT,
    )
    log_every: int = option(
        10, "steps between loss fetches and log lines (loss, lr, img/s)", min=1, group=OUTPUT
    )
    eval: bool = option(True, "skip the final evaluation", flag="--no-eval", group=OUTPUT)
    eval_only: bool = option(
        False,
        "evaluate the --resume checkpoint or --pretrained(_path) weights, without training",
        group=OUTPUT,
    )
    eval_every: int = option(
        0, "epochs between evaluations during training (0: at the end only)", min=0, group=OUTPUT
    )
    timing_warmup_steps: int = option(2, "first steps left out of img/s", min=0, group=OUTPUT)
    peak_tflops: float = option(
        0.0, "accelerator bf16 peak TFLOP/s for MFU (default: looked up)", min=0, group=OUTPUT
    )

    @property
    def backend(self) -> str | None:
        """The backend's name (None until the launcher settles it)."""
        return self.accel.backend

    @property
    def seed(self) -> int:
        """The run's seed: the step's random draws, and the command line's weights, data order
        and augmentation too."""
        return self.accel.step.seed

    def compile_cache_dir(self) -> Path:
        """--compile_cache, else ACCEL_COMPILE_CACHE/BACKEND (one folder for many runs' outputs,
        so that a run reuses what another compiled), else OUTPUT/.compile_cache/BACKEND."""
        if self.accel.compiler.cache_dir:
            return Path(self.accel.compiler.cache_dir)
        backend = str(self.backend)
        return shared_compile_cache(backend) or Path(self.output) / ".compile_cache" / backend

    def run_dir(self) -> Path:
        return Path(self.output) / self.model.name / str(self.backend) / self.run_name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# --- the library's settings as flags ----------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One of the library's settings (a field of accel.config.BackendConfig, under
    RunConfig.accel) as a flag: how the command line spells it, its help and metadata (the
    keys above)."""

    field: str  # its path in BackendConfig: "step.accum"
    flag: str  # "--grad_accum"
    help: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Placed:
    """Library flags shown together in --help, in a section, beside one of the command line's
    own options (`after` it, or `before` it), as the seed's --help has always shown them."""

    section: str
    flags: tuple[Flag, ...]
    after: str = ""
    before: str = ""


_SPLIT = (
    "split weights, gradients and optimizer state over the data-parallel replicas: full (FSDP2 "
    "per block on eager/compile; sharded arrays on jax), grad_op (weights kept gathered through "
    "the step: ZeRO-2's traffic), none (replicas)"
)
_ATTENTION = (
    "jax's attention: XLA's ops, cuDNN flash attention (CUDA GPU), a fused Pallas kernel for "
    "short biased windows (pallas), or by shape (auto: cuDNN for long unbiased sequences, pallas "
    "for Swin's windows on a GPU, XLA for the rest); the other backends use torch's"
)
_REMAT = (
    "recompute each block's activations in the backward, for memory: none, dots (keep the "
    "matmuls' outputs) or full"
)

# Every library setting the command line offers, and the flag it offers it as. Fields of
# BackendConfig not listed here are not flags: step.ema (job.py makes it from --model_ema*) and
# mesh.tp_plan (found by module type).
LIBRARY_FLAGS: tuple[Placed, ...] = (
    Placed(RUN, before="recipe", flags=(
        Flag("backend", "--backend", "default: eager, or the XLA path when USE_ACCEL=1"),
    )),
    Placed(RUN, after="epochs", flags=(
        Flag("step.seed", "--seed", "seed of weights, data order, augmentation and dropout",
             {"resume": "same"}),
    )),
    Placed("optim", after="optim.min_lr", flags=(
        Flag("step.clip_grad", "--clip_grad", "max gradient norm (0 = no clipping)", {"min": 0}),
        Flag("step.accum", "--grad_accum", "micro-steps per optimizer step", {"min": 1}),
    )),
    Placed("hosts", before="hosts.nnodes", flags=(
        Flag("mesh.devices", "--nproc_per_node",
             "processes (eager, compile) or devices (xla, jax)", {"min": 1}),
        Flag("mesh.shard", "--shard", _SPLIT),
        Flag("mesh.tp", "--tp", "split each transformer block's attention and MLP over N ranks "
             "(Megatron's columns and rows): a dp x tp mesh", {"min": 1}),
        Flag("mesh.tp_head", "--tp_head",
             "split the classifier's classes over N ranks (the --tp ranks where given)",
             {"min": 1}),
        Flag("mesh.pp", "--pp", "cut a ViT into N pipeline stages: a dp x pp mesh", {"min": 1}),
        Flag("mesh.pp_schedule", "--pp_schedule", "pipeline schedule"),
        Flag("mesh.pp_microbatches", "--pp_microbatches",
             "micro-batches a batch streams through the pipeline in", {"min": 1}),
    )),
    Placed("hosts", after="hosts.rdzv_endpoint", flags=(
        Flag("mesh.rdzv_timeout", "--rdzv_timeout", "seconds to wait for every node to join",
             {"min": 1}),
    )),
    Placed("compiler", after="hosts.rdzv_endpoint", flags=(
        Flag("compiler.max_recompiles", "--max_recompiles",
             "stop when more graphs than this compile after warm-up (-1: no limit)",
             {"min": -1}),
        Flag("compiler.cache_dir", "--compile_cache",
             "persistent compilation cache folder (default ACCEL_COMPILE_CACHE/BACKEND where "
             "that is set, else OUTPUT/.compile_cache/BACKEND)"),
        Flag("compiler.loader_prefetch", "--loader_prefetch",
             "host batches queued ahead of the device transfer", {"min": 1}),
        Flag("compiler.device_prefetch", "--device_prefetch",
             "batches already on the device ahead of the step", {"min": 1}),
        Flag("compiler.grad_reduce", "--grad_reduce",
             "xla: explicit xm.all_reduce of the gradients, or torch_xla's reduce_gradients "
             "(what xm.optimizer_step does)"),
    )),
    Placed(PRECISION, after="nan_policy", flags=(
        Flag("step.amp", "--amp_level", "mixed precision level"),
        Flag("step.amp_dtype", "--amp_dtype", "low-precision dtype"),
        Flag("step.kernel_opt", "--kernel-opt",
             "the backend's extra fused paths (--backends lists them)"),
        Flag("step.remat", "--remat", _REMAT),
        Flag("step.attention", "--attention", _ATTENTION),
    )),
)  # fmt: skip


@dataclass(frozen=True)
class Option:
    """One flag of launch_single_task, the command line's own or the library's: the field it
    sets (its dotted path in RunConfig), its type and default there, its help section and its
    metadata."""

    path: str
    kind: Any
    default: Any
    section: str
    meta: Mapping[str, Any]

    @property
    def flag(self) -> str:
        return self.meta.get("flag", "--" + self.path.rsplit(".", 1)[-1])

    @property
    def metavar(self) -> str:
        return self.meta.get("metavar", self.path.rsplit(".", 1)[-1].upper())

    @property
    def choices(self) -> tuple[Any, ...]:
        """Its metadata's choices, else a Literal type's values."""
        kind = self.kind
        if typing.get_origin(kind) is typing.Union:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        literal = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else ()
        return tuple(self.meta.get("choices", literal))


def _own_option(path: str, f: dataclasses.Field, kind: Any) -> Option:
    section = f.metadata.get("group", RUN) if "." not in path else path.rsplit(".", 1)[0]
    return Option(path, kind, f.default, section, f.metadata)


def _library_option(
    placed: Placed, flag: Flag, types: Mapping[str, Any], defaults: RunConfig
) -> Option:
    path = f"accel.{flag.field}"
    # Shown as the flag's name (NPROC_PER_NODE), not the library field's (DEVICES).
    metavar = flag.flag.lstrip("-").upper()
    meta = {"help": flag.help, "flag": flag.flag, "metavar": metavar, **flag.meta}
    return Option(path, types[path], get_path(defaults, path), placed.section, meta)


def options() -> list[Option]:
    """Every flag of launch_single_task's config, in --help's order: the command line's own
    fields (but cli=False) with the library's flags placed among them."""
    leaves = leaf_fields(RunConfig)
    types = {path: kind for path, _, kind in leaves}
    defaults = RunConfig()  # the library's fields' defaults as the command line starts them
    out: list[Option] = []
    for path, f, kind in leaves:
        if path.startswith("accel.") or f.metadata.get("cli") is False:
            continue
        own = _own_option(path, f, kind)
        before = [p for p in LIBRARY_FLAGS if p.before == path]
        after = [p for p in LIBRARY_FLAGS if p.after == path]
        out += [_library_option(p, flag, types, defaults) for p in before for flag in p.flags]
        out.append(own)
        out += [_library_option(p, flag, types, defaults) for p in after for flag in p.flags]
    return out


# --- reading and walking the dataclass tree --------------------------------------------------
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, type) of every non-dataclass field, depth first."""
    out = []
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        kind = types[f.name]
        if dataclasses.is_dataclass(kind):
            out += leaf_fields(cast(type, kind), f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, kind))
    return out


def from_dict(cls: type, raw: dict[str, Any], base: Any = None) -> Any:
    """A (frozen) dataclass from a nested dict, the defaults (`base`'s values, else the class's)
    for what it leaves out; the inverse of dataclasses.asdict, and how the parsed command line
    becomes a config."""
    base = cls() if base is None else base
    types = field_types(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        kind, value = types[f.name], raw[f.name]
        if dataclasses.is_dataclass(kind):
            value = from_dict(cast(type, kind), value, getattr(base, f.name))
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return dataclasses.replace(base, **values)


def get_path(cfg: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        cfg = getattr(cfg, key)
    return cfg


def set_nested(nested: dict, dotted: str, value: Any, keep: bool = False) -> None:
    """Set a dotted key in a nested dict of options (`keep`: unless it is already set)."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        nested = nested.setdefault(key, {})
    if keep:
        nested.setdefault(leaf, value)
    else:
        nested[leaf] = value


def replace_path(cfg: Any, dotted: str, value: Any) -> Any:
    """A copy of a frozen config with one (nested) field changed."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace_path(getattr(cfg, head), rest, value)})


def data_replicas(cfg: RunConfig) -> int:
    """Devices the data is split over: every node's processes or devices, over the
    model-parallel size (the ranks of a tp or pp group train on the same batch)."""
    mesh = cfg.accel.mesh
    return cfg.hosts.nnodes * mesh.devices // (max(mesh.tp, mesh.tp_head) * mesh.pp)


def global_batch(cfg: RunConfig) -> int:
    """Images an optimizer step trains on: what a checkpoint must resume with (its data order
    is then the saved run's where the replicas are too; --batch_size may be split otherwise)."""
    return cfg.batch_size * data_replicas(cfg) * cfg.accel.step.accum


def resume_keys() -> list[str]:
    """Options a checkpoint must be resumed with unchanged (metadata resume="same")."""
    return [o.path for o in options() if o.meta.get("resume") == "same"]


# --- validation: ranges from the metadata, then what ties options together --------------------
def _range_error(flag: str, value: Any, meta: Mapping[str, Any]) -> str | None:
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            return f"{flag} must be a finite number, got {v}"
        for key, ok, word in (
            ("min", lambda x, b: x >= b, ">="),
            ("max", lambda x, b: x <= b, "<="),
            ("above", lambda x, b: x > b, ">"),
            ("below", lambda x, b: x < b, "<"),
        ):
            if key in meta and isinstance(v, int | float) and not ok(v, meta[key]):
                return f"{flag} must be {word} {meta[key]}, got {value}"
    return None


def check_ranges(cfg: RunConfig) -> None:
    """Every option against the range and choices it declares."""
    for opt in options():
        value = get_path(cfg, opt.path)
        if value is None:
            continue
        if opt.choices and value not in opt.choices:
            raise AccelError(f"{opt.flag}: '{value}' is not one of {', '.join(opt.choices)}")
        problem = _range_error(opt.flag, value, opt.meta)
        if problem:
            raise AccelError(problem)


def check_combinations(cfg: RunConfig) -> None:
    """Options that cannot work together, whatever the backend."""
    hosts = cfg.hosts
    if cfg.steps is not None and cfg.epochs is not None:
        raise AccelError("give --steps or --epochs, not both")
    if cfg.data.mixup.enabled and cfg.batch_size % 2:
        raise AccelError(f"--mixup/--cutmix need an even --batch_size, got {cfg.batch_size}")
    if hosts.nnodes > 1 and not (hosts.master_addr or hosts.rdzv_endpoint):
        raise AccelError("--nnodes > 1 needs --master_addr (and --master_port) or --rdzv_endpoint")
    if hosts.nnodes > 1 and not cfg.run_name:
        raise AccelError("--nnodes > 1: give every node the same --run_name")
    if hosts.node_rank >= hosts.nnodes:
        raise AccelError(f"--node_rank {hosts.node_rank} is not below --nnodes {hosts.nnodes}")
    check_training_options(cfg)


def check_training_options(cfg: RunConfig) -> None:
    """Augmentation, fine-tuning, evaluation and checkpoint options that cannot work together."""
    data, model = cfg.data, cfg.model
    for flag, (low, high) in (("--scale", data.scale), ("--ratio", data.ratio)):
        if low > high:
            raise AccelError(f"{flag} {low} {high}: the first value is the lower bound")
    if data.reprob > 0 and cfg.accel.mesh.pp > 1:
        raise AccelError("--reprob with --pp: random erasing is not part of the pipeline stages")
    if model.pretrained and model.pretrained_path:
        raise AccelError("give --pretrained or --pretrained_path, not both")
    if cfg.eval_only and not (cfg.resume or model.pretrained or model.pretrained_path):
        raise AccelError("--eval_only evaluates --resume's checkpoint or --pretrained(_path)")
    if not cfg.save and cfg.save_every:
        raise AccelError(f"--no-save with --save_every {cfg.save_every}: give one or the other")
    if cfg.checkpoint_best and not (cfg.eval or cfg.eval_every):
        raise AccelError(
            f"--checkpoint_best {cfg.checkpoint_best} with --no-eval and no --eval_every: "
            "no evaluation picks a best"
        )
    if cfg.checkpoint_best and not cfg.save:
        raise AccelError("--checkpoint_best with --no-save: give one or the other")


def validate(cfg: RunConfig) -> None:
    check_ranges(cfg)
    check_combinations(cfg)
