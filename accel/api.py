"""accel.prepare: a model, its optimizer and its loss put on a backend, as an Engine. The
backend comes from `backend=`, else ACCEL_BACKEND, else USE_ACCEL=1, else eager; its settings
from the keywords or one `config=` (accel/config.py), settled and checked here once."""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.backends import check_supported, resolve_backend
from accel.backends.base import (
    BackendUnavailable,
    LossFn,
    ModelInit,
)
from accel.checkpoint import flatten
from accel.config import (
    AMP_LEVELS,
    ATTENTION_CHOICES,
    REMAT_CHOICES,
    SHARD_MODES,
    AccelError,
    AmpDtype,
    AmpLevel,
    AttentionChoice,
    BackendConfig,
    BackendName,
    MeshConfig,
    RematChoice,
    ShardMode,
    StepConfig,
    shared_compile_cache,
)
from accel.distributed import first_difference, init_process_group
from accel.engine import EmaDecayFn, Engine
from accel.loop import LoopPart
from accel.optim import LearningRates, OptimizerSpec, ScheduleFn
from accel.parallel.tensor_parallel import resolve_plan, weight_splits
from accel.ties import tied_names
from accel.user_model import TrainedOnRead
from accel.workers import fork_server

Schedule = ScheduleFn | torch.optim.lr_scheduler.LRScheduler | None


def cache_dir(backend: str) -> Path:
    """Where compiled programs persist between runs (JAX's and torch_xla's persistent caches):
    ACCEL_COMPILE_CACHE/BACKEND where that is set, else the user's cache folder."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return shared_compile_cache(backend) or root / "accel" / backend


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise AccelError(f"{name} must be a whole number, got '{raw}'")
    return int(raw)


def choose_backend(requested: str | None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(backend, why): the name asked for, else ACCEL_BACKEND, else USE_ACCEL=1, else eager.

    >>> choose_backend("jax")
    ('jax', 'asked for by name')
    """
    return resolve_backend(requested, env)


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    schedule: Schedule = None,
    clip_grad: float = 0.0,
    accum: int = 1,
    amp: AmpLevel = "O0",
    amp_dtype: AmpDtype = "bfloat16",
    ema: float | EmaDecayFn | None = None,
    backend: BackendName | None = None,
    devices: int | None = None,
    shard: ShardMode = "none",
    tp: int = 1,
    tp_plan: Mapping[str, str] | None = None,
    pp: int = 1,
    seed: int = 0,
    attention: AttentionChoice = "auto",
    remat: RematChoice = "none",
    quiet: bool = False,
    init: ModelInit | None = None,
    state: LoopPart | None = None,
    config: BackendConfig | None = None,
) -> Engine:
    """Put `model`, `optimizer` and `loss_fn` on the chosen backend; returns the Engine.

    model: any nn.Module (timm, torchvision, your own); or one built on the meta device
        (`with torch.device("meta"):`) with `init` building it with its starting values, so
        that a sharded layout never holds a whole copy on every rank.
    optimizer: a torch.optim.AdamW, Adam or SGD over the model's parameters, with its param
        groups (their own lr and weight decay; timm's `lr_scale` for layer decay). accel rebuilds
        it over the tensors it updates (jax: translates it to optax); yours is not stepped.
    loss_fn: (model, batch) -> scalar tensor, or (loss, {name: scalar tensor}) whose extras
        (training accuracy, say) come back with the loss in `fetch`; `batch` is the tuple given
        to `step`. Call the model inside: every backend traces it. Read no value on the host
        (no `.item()`).
    schedule: the base learning rate as a function of the optimizer step (each group keeps its
        ratio to the first group's rate), or a torch LRScheduler bound to `optimizer` that accel
        steps. Without it each step takes `optimizer`'s groups' rates as they are then: step
        your own scheduler (per step or per epoch) as you always have.
    clip_grad: the gradients' global norm limit, after the mean over replicas (0: none).
    accum: micro-batches each `step` batch is split into (same result, less memory).
    amp: O0 fp32; O1 autocast; O2 low-precision weights with fp32 masters; O3 all low precision.
    ema: keep an exponential moving average of the weights with this decay (or a function of
        the optimizer steps done, this one included, giving it).
    backend: eager, compile, xla or jax (default: ACCEL_BACKEND, USE_ACCEL, else eager).
    devices: devices one process drives (xla's SPMD mesh, jax's local devices; default:
        ACCEL_DEVICES, else 1); under torchrun (eager, compile) each process is one replica.
    shard: "none" (every replica holds the whole model and optimizer state); "full" splits
        weights, gradients and optimizer state over the replicas (FSDP2 per block on eager and
        compile, FSDPv2 on an xla mesh, sharded arrays on jax devices); "grad_op" (eager,
        compile, jax) splits the gradients and optimizer state and keeps each unit's gathered
        weights from the forward to the backward. With one replica there is nothing to split.
    tp: ranks (eager, compile: processes; xla, jax: devices) each transformer block's linear
        layers are split over, Megatron's way: attention's qkv and the MLP's fc1 by output
        features, attention's proj and fc2 by input features. The blocks of timm's and
        torchvision's ViT and Swin are found by module type; for a model of your own give
        `tp_plan`. The rest of the ranks split the data (and with `shard`, the weights): 4
        processes at tp=2 are 2 data groups of 2.
    tp_plan: {module name or fnmatch pattern: "colwise" | "rowwise" | "colwise_gather" |
        "rowwise_whole" | "replicate"}, the linear layers tp splits (see
        accel.parallel.tensor_parallel): {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}.
    pp: pipeline stages (eager; the command line's ViT classifier and its loss only).
    seed: the seed of the random draws inside `step` (dropout, stochastic depth), on every
        backend: each data replica draws its own stream, derived from `seed` and its replica
        index, and saved with a checkpoint. A step neither reads nor advances torch's global
        generator: your data order, augmentation and initial weights stay yours to seed.
    attention: the jax backend's attention kernels: "xla" (XLA's own ops, no custom call),
        "cudnn" (cuDNN flash attention wherever it takes the shape, on a CUDA GPU) or "auto"
        (by shape: cuDNN for long unbiased sequences such as ViT's, XLA for biased or
        short ones such as Swin's windows; accel/backends/jax/attention.py). The other
        backends run torch's own attention.
    remat: recompute each block's activations in the backward, for memory: "none" (keep
        them all), "dots" (keep each block's matmul outputs, recompute the rest) or "full"
        (keep only each block's input); the same losses whichever (accel/parallel/remat.py).
        eager and compile run it through torch.utils.checkpoint, jax through jax.checkpoint;
        xla refuses it in one line.
    quiet: say nothing at start (default: one line naming the backend and why).
    state: an object with a `step` count and state_dict/load_state_dict (a
        torch.distributed.checkpoint Stateful) that `save` and `load` keep; its `step` counts
        the optimizer steps (default: a step count alone).
    config: every backend setting at once, as the library's typed config (accel.config:
        StepConfig, MeshConfig and CompilerConfig: the split classifier, the pipeline, remat,
        compile cache and recompile limits among them); the keywords above then stay unset.
    """
    if fork_server.importing_main:  # a loader's fork server imports the script, and runs no step
        raise AccelError("prepare runs as the script is imported: call it under its main guard")
    keywords = dict(
        backend=backend, clip_grad=clip_grad, accum=accum, amp=amp, amp_dtype=amp_dtype,
        devices=devices, shard=shard, tp=tp, tp_plan=tp_plan, pp=pp, seed=seed,
        attention=attention, remat=remat,
    )  # fmt: skip
    given = [k for k, v in keywords.items() if v != CONFIG_KEYWORDS[k]]
    if config is not None and given:
        raise AccelError(
            f"give the backend's settings as config= or as keywords, not both ({', '.join(given)}"
            " given with config=)"
        )
    config = config or keyword_config(ema=ema is not None, **keywords)
    if config.step.ema and ema is None:
        ema = DEFAULT_EMA_DECAY
    name, why = choose_backend(config.backend or None)
    config = settled(config, name, ema)
    try:  # it runs here, and runs every setting given (float16, a shard mode, ...)
        module = check_supported(config)
    except BackendUnavailable as err:
        raise AccelError(str(err)) from None
    if not any(p.requires_grad for p in model.parameters()):
        raise AccelError(
            f"{type(model).__name__} has no trainable parameter (requires_grad is False on every "
            "one): there is nothing to train"
        )
    check_float32(model)
    splits: dict[str, int] = {}
    if config.mesh.tp > 1:  # what splits, refused in one line before anything is built
        splits = weight_splits(model, resolve_plan(model, config.mesh.tp_plan, config.mesh.tp))
    check_ties(model, config, splits)
    spec = OptimizerSpec.of(optimizer, model)
    refused = spec.refusals()
    if refused:
        raise AccelError(f"accel cannot run {spec.kind} with {', '.join(refused)}")
    # The one place a process joins its peers: the process group (eager, compile), xla's
    # runtime, jax.distributed; the command line and the user's script read it from the Engine.
    ctx = module.context(config)
    if module.SUPPORTS.replicas == "processes":  # jax's processes meet through jax.distributed
        init_process_group(ctx)
        check_same_on_every_rank(config)
    runner = module.build(config, ctx)
    if runner.threaded and multiprocessing.get_start_method(allow_none=True) is None:
        # Workers forked from a process whose runtime runs threads (JAX) may deadlock, and
        # Python warns of it: the script's DataLoaders start theirs from a fork server (Python
        # 3.14's default on Linux), unless the script chose a start method itself. The server
        # imports torch and the script once, not each worker of each pass.
        multiprocessing.set_start_method("forkserver")
        fork_server.preload()
    runner.adopt(model, spec, loss_fn, init)
    if not quiet and ctx.is_main:
        print(f"accel: {name} backend ({why})", file=sys.stderr, flush=True)
    decay = ema if callable(ema) else (ema or 0.0) if config.step.ema else 0.0
    # The user's scheduler steps their optimizer's rates; accel's optimizer steps, theirs never
    # does, so torch's warning that the scheduler stepped first would be wrong every time.
    warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
    rates = LearningRates(spec, schedule, optimizer)
    engine = Engine(
        runner, ctx, rates, config.step.accum, decay, state, config.compiler.max_recompiles, model
    )
    if not runner.trains_in_place and not any(p.is_meta for p in model.parameters()):
        TrainedOnRead(engine, model)  # jax: the script's model reads as the trained one
    return engine


def check_same_on_every_rank(cfg: BackendConfig) -> None:
    """Every rank builds the same backend: a setting that differs between ranks (a seed or a
    mesh read from the rank or the host) is refused in one line on every rank before anything is
    built, where the build would hang in a collective or each rank would train differently. The
    compile cache is the host's own, and may differ."""
    settings = flatten(dataclasses.asdict(cfg))
    mine = {k.split(".", 1)[-1]: v for k, v in settings.items() if k != "compiler.cache_dir"}
    difference = first_difference(mine)
    if difference:
        raise AccelError(f"the ranks called prepare with different options: {difference}")


def check_ties(model: nn.Module, cfg: BackendConfig, splits: dict[str, int]) -> None:
    """A tensor the model holds under two names (tied weights) stays one tensor on every
    layout but two: a pipeline may put the two names on different stages, and tp= splitting
    one of them would leave the other whole. Those are refused in one line, naming both."""
    for alias, name in tied_names(model).items():
        if cfg.mesh.pp > 1:
            why = "a pipeline may put them on different stages"
        elif alias in splits or name in splits:
            why = "tp= would split one and leave the other whole"
        else:
            continue
        raise AccelError(
            f"{alias} is tied to {name} (one tensor under two names): {why}; untie them "
            "(give each its own parameter) or train without it"
        )


def check_float32(model: nn.Module) -> None:
    """accel trains a float32 model, in the precision `amp=` asks for; a model given in another
    floating dtype is refused in one line on every backend alike, rather than cast (eager's
    and xla's steps would cast it to the AMP level's dtype, jax cannot take it)."""
    found = next(
        ((n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point()
         and p.dtype != torch.float32),
        None,
    )  # fmt: skip
    if found is None:
        return
    name, dtype = found
    raise AccelError(
        f"{type(model).__name__}'s parameters are {dtype} ({name}): give prepare the float32 "
        "model (model.float()) and choose the precision with amp= ('O1' autocast, 'O2' "
        "bfloat16 weights with float32 masters, 'O3' all in bfloat16)"
    )


DEFAULT_EMA_DECAY = 0.9998  # timm's ModelEmaV3 default, for config=StepConfig(ema=True)
# prepare's keywords that are also BackendConfig fields, with their defaults: read from its
# signature, so that the defaults are written once.
CONFIG_KEYWORDS = {
    name: parameter.default
    for name, parameter in inspect.signature(prepare).parameters.items()
    if name in ("backend", "clip_grad", "accum", "amp", "amp_dtype", "devices", "shard", "tp")
    or name in ("tp_plan", "pp", "seed", "attention", "remat")
}


def keyword_config(ema: bool, **keywords: Any) -> BackendConfig:
    """prepare's keywords (those of CONFIG_KEYWORDS) as the library's config, checked later by
    `settled`; `ema`: whether an EMA is kept."""
    k = keywords
    step = StepConfig(
        k["amp"], k["amp_dtype"], k["clip_grad"], k["accum"], ema, k["seed"],
        attention=k["attention"], remat=k["remat"],
    )  # fmt: skip
    mesh = MeshConfig(k["devices"] or 0, k["shard"], k["tp"], k["tp_plan"], pp=k["pp"])
    return BackendConfig(k["backend"] or "", step, mesh)  # type: ignore[arg-type]  # "": open


def settled(cfg: BackendConfig, name: str, ema: float | EmaDecayFn | None) -> BackendConfig:
    """`cfg` checked, on backend `name`, with what was left open filled in."""
    step, mesh = cfg.step, cfg.mesh
    if step.amp not in AMP_LEVELS:
        raise AccelError(f"amp must be one of {', '.join(AMP_LEVELS)}, got '{step.amp}'")
    if mesh.shard not in SHARD_MODES:
        raise AccelError(f"shard must be one of {', '.join(SHARD_MODES)}, got '{mesh.shard}'")
    if step.remat not in REMAT_CHOICES:
        raise AccelError(f"remat must be one of {', '.join(REMAT_CHOICES)}, got {step.remat!r}")
    if step.attention not in ATTENTION_CHOICES:
        raise AccelError(
            f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got '{step.attention}'"
        )
    if isinstance(ema, float | int) and not 0 <= ema < 1:
        raise AccelError(f"ema is a decay in [0, 1), got {ema}")
    if not mesh.devices:
        mesh = replace(mesh, devices=env_int("ACCEL_DEVICES", 1))
    if min(step.accum, mesh.devices, mesh.tp, mesh.pp) < 1:
        raise AccelError("accum, devices, tp and pp must be at least 1")
    compiler = cfg.compiler
    if not compiler.cache_dir:
        compiler = replace(compiler, cache_dir=str(cache_dir(name)))
    return replace(cfg, backend=name, mesh=mesh, compiler=compiler)  # type: ignore[arg-type]


__all__ = ["choose_backend", "prepare"]
