"""accel in your own training script: the backend switch as a library.

    import accel

    engine = accel.prepare(model, optimizer, loss_fn, schedule=lr_at, clip_grad=1.0, amp="O1")
    pending = []
    for images, targets in engine.loader(train_loader):
        pending.append(engine.step(images, targets))   # the whole optimizer step, on the device
        if len(pending) == 50:
            print(engine.fetch(pending)); pending.clear()   # one host sync for the group
    print(engine.evaluate(val_loader, metric_fn))
    engine.save("checkpoint.pt")

The backend comes from `backend=`, else ACCEL_BACKEND=eager|compile|xla|jax, else USE_ACCEL=1 (the
XLA compiler: jax on a CUDA GPU, xla elsewhere), else eager: as the command line reads them.

Why a loss function and not `loss.backward()`: the jax backend needs forward, loss, backward and
update as one pure function (torchax's make_train_step, torch_xla.compile(step, full_graph=True)
take the whole step too), so accel runs the whole optimizer step: gradient accumulation, AMP, the
gradient mean over replicas, clipping, the update, the EMA and the non-finite skip. The command
line's Trainer drives the same backends through the same calls.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from accel.backends import check_supported, resolve_backend
from accel.backends.base import (
    Backend,
    BackendStats,
    BackendUnavailable,
    LossFn,
    MetricFn,
    ModelInit,
    RecompileError,
    StepResult,
)
from accel.backends.host_reads import user_frame
from accel.checkpoint import (
    BackendTensors,
    CheckpointParts,
    RandomStates,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from accel.config import (
    AMP_LEVELS,
    ATTENTION_CHOICES,
    SHARD_MODES,
    AmpDtype,
    AmpLevel,
    AttentionChoice,
    BackendConfig,
    BackendName,
    ConfigError,
    MeshConfig,
    ShardMode,
    StepConfig,
    shared_compile_cache,
)
from accel.data import fork_server
from accel.distributed import DistContext, init_process_group
from accel.optim import LearningRates, OptimizerSpec, ScheduleFn
from accel.parallel.fsdp import full_value
from accel.parallel.tensor_parallel import resolve_plan

AccelError = ConfigError  # every refusal: one line, raised before any weight changes
Schedule = ScheduleFn | torch.optim.lr_scheduler.LRScheduler | None
EmaDecayFn = Callable[[int], float]  # the EMA decay by the optimizer steps done, this one included


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
    seed: the seed of the backend's own random draws (dropout, stochastic depth on jax and xla).
    attention: the jax backend's attention kernels: "xla" (XLA's own ops, no custom call),
        "cudnn" (cuDNN flash attention wherever it takes the shape, on a CUDA GPU) or "auto"
        (by shape: cuDNN for long unbiased sequences such as ViT's, XLA for biased or
        short ones such as Swin's windows; accel/backends/jax_attention.py). The other
        backends run torch's own attention.
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
    mesh = (devices, shard, tp, tp_plan, pp)
    given = keyword_config(backend, clip_grad, accum, amp, amp_dtype, mesh, seed, attention)
    if config is not None and given != keyword_config(*KEYWORD_DEFAULTS):
        raise AccelError("give the backend's settings as config= or as keywords, not both")
    cfg = config or replace(given, step=replace(given.step, ema=ema is not None))
    if cfg.step.ema and ema is None:
        ema = DEFAULT_EMA_DECAY
    name, why = choose_backend(cfg.backend or None)
    cfg = settled(cfg, name, ema)
    try:  # it runs here, and runs every setting given (float16, a shard mode, ...)
        module = check_supported(cfg)
    except BackendUnavailable as err:
        raise AccelError(str(err)) from None
    if not any(p.requires_grad for p in model.parameters()):
        raise AccelError(
            f"{type(model).__name__} has no trainable parameter (requires_grad is False on every "
            "one): there is nothing to train"
        )
    if cfg.mesh.tp > 1:  # what splits, refused in one line before anything is built
        resolve_plan(model, cfg.mesh.tp_plan, cfg.mesh.tp)
    spec = OptimizerSpec.of(optimizer, model)
    refused = spec.refusals()
    if refused:
        raise AccelError(f"accel cannot run {spec.kind} with {', '.join(refused)}")
    ctx = module.context(cfg)
    if module.SUPPORTS.replicas == "processes":  # jax's processes meet through jax.distributed
        init_process_group(ctx)
    runner = module.build(cfg, ctx)
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
    decay = ema if callable(ema) else (ema or 0.0) if cfg.step.ema else 0.0
    # The user's scheduler steps their optimizer's rates; accel's optimizer steps, theirs never
    # does, so torch's warning that the scheduler stepped first would be wrong every time.
    warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
    rates = LearningRates(spec, schedule, optimizer)
    engine = Engine(runner, ctx, rates, cfg.step.accum, decay, state)
    engine.max_recompiles = cfg.compiler.max_recompiles
    engine.model_given = model
    if not runner.trains_in_place and not any(p.is_meta for p in model.parameters()):
        TrainedOnRead(engine, model)  # jax: the script's model reads as the trained one
    return engine


# prepare's own
KEYWORD_DEFAULTS = (None, 0.0, 1, "O0", "bfloat16", (None, "none", 1, None, 1), 0, "auto")
DEFAULT_EMA_DECAY = 0.9998  # timm's ModelEmaV3 default, for config=StepConfig(ema=True)


def keyword_config(
    backend: str | None,
    clip_grad: float,
    accum: int,
    amp: str,
    amp_dtype: str,
    mesh: tuple[int | None, str, int, Mapping[str, str] | None, int],
    seed: int,
    attention: str = "auto",
) -> BackendConfig:
    """prepare's keywords as the library's config (checked by `settled`); `mesh`: devices,
    shard, tp, tp_plan and pp."""
    step = StepConfig(amp, amp_dtype, clip_grad, accum, seed=seed)  # type: ignore[arg-type]
    step = replace(step, attention=attention)  # type: ignore[arg-type]
    devices, shard, tp, tp_plan, pp = mesh
    layout = MeshConfig(devices or 0, shard, tp, tp_plan, pp=pp)  # type: ignore[arg-type]
    return BackendConfig(backend or "", step, layout)  # type: ignore[arg-type]


def settled(cfg: BackendConfig, name: str, ema: float | EmaDecayFn | None) -> BackendConfig:
    """`cfg` checked, on backend `name`, with what was left open filled in."""
    step, mesh = cfg.step, cfg.mesh
    if step.amp not in AMP_LEVELS:
        raise AccelError(f"amp must be one of {', '.join(AMP_LEVELS)}, got '{step.amp}'")
    if mesh.shard not in SHARD_MODES:
        raise AccelError(f"shard must be one of {', '.join(SHARD_MODES)}, got '{mesh.shard}'")
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


class Engine:
    """A model, optimizer and loss on one backend, made by `accel.prepare`: steps, fetches,
    evaluation and checkpoints, the same calls on every backend.

    >>> import torch, accel
    >>> model = torch.nn.Linear(4, 2)
    >>> loss_fn = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])
    >>> engine = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
    ...                        backend="eager", quiet=True)
    >>> handle = engine.step(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    >>> engine.fetch([handle])[0].applied
    True
    """

    def __init__(
        self,
        backend: Backend,
        ctx: DistContext,
        rates: Callable[[int], float | list[float]],
        accum: int = 1,
        ema: float | EmaDecayFn = 0.0,
        state: LoopPart | None = None,
    ):
        """Made by `prepare` (not public). `rates`: the learning rate(s) of an optimizer step,
        by the steps done before it. `ema`: the EMA decay (0: none), or a function of the steps
        done, this one included. `state`: the loop state checkpoints carry (`state.step`)."""
        self.runner, self.ctx, self.rates = backend, ctx, rates
        self.accum, self.ema = accum, ema
        self.state = StepCount() if state is None else state
        self.lr: float | list[float] = 0.0  # the rate(s) the last step took
        self.model_given: nn.Module | None = None  # the model prepare was handed
        self.shapes: tuple | None = None  # the last step's batch shapes
        self.shapes_seen: set[tuple] = set()  # those the step was compiled for
        self.skips = SkipWatch()
        self.max_recompiles = -1  # graphs compiled after warm-up before a step stops (-1: any)
        self.changes = 0  # steps and loads so far: what changed the trained weights
        self.synced = 0  # the changes the given model holds (sync_model)
        self.reading = False  # the engine reads the given model: its read hooks stand by

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (skipped non-finite ones included)."""
        return self.state.step

    @property
    def backend(self) -> str:
        """The backend's name: eager, compile, xla or jax."""
        return self.runner.name

    @property
    def is_main(self) -> bool:
        """Whether this is the first process (the one that writes files and prints)."""
        return self.ctx.is_main

    @property
    def rank(self) -> int:
        """This process's data-parallel rank (0 with one process)."""
        return self.runner.data_parallel[0]

    @property
    def data_ranks(self) -> int:
        """Processes the data is split over (the ranks of a model-parallel group read the
        same batches): give each its part, e.g. DistributedSampler(num_replicas=data_ranks,
        rank=rank)."""
        return self.runner.data_parallel[1]

    @property
    def local_devices(self) -> int:
        """Devices this process feeds: its loader's batch holds one device batch for each."""
        return self.runner.local_replicas

    @property
    def replicas(self) -> int:
        """How many parts the global batch is split into: processes or devices."""
        return self.data_ranks * self.local_devices

    @property
    def pin_memory(self) -> bool:
        """Whether a DataLoader feeding `loader` should pin its batches (CUDA copies)."""
        return self.runner.pin_memory

    @property
    def sharded_checkpoint(self) -> bool:
        """Whether `save` writes a folder each rank writes its own part to (DCP), rather than
        one file from rank 0."""
        return self.runner.sharded_checkpoint

    def loader(self, batches: Iterable[Sequence[torch.Tensor]]) -> Iterator[tuple]:
        """Your loader's batches on the device, prefetched (MpDeviceLoader on xla, a pinned
        side stream on CUDA, sharded device puts on jax). Under several processes each rank
        must read its own part of the data: a DataLoader needs a DistributedSampler."""
        check_sharded(batches, self.data_ranks)
        check_workers(batches)
        return self.runner.device_batches(tuple(b) for b in batches)

    def step(self, *batch: Any) -> Any:
        """One whole optimizer step on `batch` (what `loss_fn` takes as its batch); returns a
        handle that stays on the device until `fetch`. The batch is split into the `accum`
        micro-batches here; `step_micro_batches` takes them already split."""
        if len(batch) == 1 and isinstance(batch[0], tuple | list):
            batch = tuple(batch[0])
        check_batch(batch)
        try:
            return self.step_micro_batches(self.micro_batches(batch))
        except BackendUnavailable as err:  # an op the backend cannot lower: one line
            raise AccelError(str(err)) from None

    def step_micro_batches(self, micro_batches: list[Any]) -> Any:
        """One optimizer step over batches already split for gradient accumulation (`accum`
        device batches from `loader`); a handle, as `step`. An op the backend cannot lower
        raises BackendUnavailable."""
        done = self.state.step
        self.lr = self.rates(done)
        decay = self.ema(done + 1) if callable(self.ema) else self.ema
        shapes = tuple(tuple(getattr(t, "shape", ())) for t in micro_batches[0])
        started = time.perf_counter()
        with user_errors("step"):
            handle = self.runner.train_step(micro_batches, self.lr, decay)
        before, self.shapes = self.shapes, shapes
        self.state.step = done + 1
        self.changes += 1
        new = shapes not in self.shapes_seen  # a compiling backend compiled the step for them
        self.shapes_seen.add(shapes)
        self.check_recompiles()  # past the limit: the error, not the notice
        if new and before is not None and self.runner.compiles_per_shape and self.is_main:
            seconds = time.perf_counter() - started
            say(
                f"the {self.backend} step compiled again ({seconds:.1f} s) for batch shapes "
                f"{shape_text(shapes)}, after {shape_text(before)}: keep them fixed (a "
                "DataLoader's drop_last=True)"
            )
        return handle

    def check_recompiles(self) -> None:
        """More graphs compiled after warm-up than `max_recompiles` (CompilerConfig): stop, in
        one line naming the likely cause. The policy of every backend that compiles."""
        limit = self.max_recompiles
        if limit < 0:
            return
        compiled = self.runner.compiles_after_warmup()
        if compiled <= limit:
            return
        if len(self.shapes_seen) > 1:
            shapes = ", ".join(shape_text(s) for s in sorted(self.shapes_seen))
            cause = (
                f"the batch shapes changed between steps ({shapes}); keep them fixed (a "
                "DataLoader's drop_last=True, padded and masked evaluation batches)"
            )
        else:
            cause = (
                "the traced step changed with fixed batch shapes (a Python branch on a tensor "
                "value, .item() inside the step, or a changing Python constant); "
                f"{self.runner.explain_compiles}"
            )
        raise RecompileError(f"{compiled} graphs compiled after warm-up (limit {limit}): {cause}")

    def micro_batches(self, batch: tuple) -> list[tuple]:
        size = batch[0].shape[0]
        if size % self.accum:
            raise AccelError(f"a batch of {size} does not split into accum={self.accum} parts")
        return self.runner.split(batch, self.accum)

    def fetch(self, handles: Sequence[Any]) -> list[StepResult]:
        """The steps' (loss, applied) on the host: one sync for the whole group. `loss` is the
        mean over replicas; `applied` is False where a non-finite loss or gradient skipped the
        update."""
        results = self.runner.fetch_results(list(handles))
        self.skips.watch(results, self.is_main)
        return results

    def evaluate(
        self, batches: Iterable[Sequence[torch.Tensor]], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        """Sums of `metric_fn(model, batch)` ({name: tensor}) over the batches and the ranks,
        on the host; with `ema`, of the EMA weights. Divide the sums yourself (a count is one
        of them)."""
        check_sharded(batches, self.data_ranks)
        check_workers(batches)
        with user_errors("evaluation"):
            return self.runner.evaluate_sums((tuple(b) for b in batches), metric_fn, ema)

    @property
    def model(self) -> EvalModel:
        """The trained model for your own evaluation loop: `engine.model(images)` runs it in
        eval mode without gradients on the backend and returns torch tensors on the inputs'
        device (the host for jax's), whatever the backend."""
        return EvalModel(self)

    # --- what was trained -----------------------------------------------------------------------
    def state_dict(self, ema: bool = False) -> dict[str, torch.Tensor]:
        """The trained weights (with `ema`, their moving average) and the model's buffers, on
        the host, under your model's own names and dtypes: `model.load_state_dict(
        engine.state_dict())` gives a model that evaluates as `evaluate` does, whatever the
        backend. Call it on every rank: split weights (shard="full") are gathered tensor by
        tensor. A pipeline keeps stages on different ranks: save a checkpoint and export it
        (`accel-export`) instead."""
        state = self.runner.checkpoint_state()
        if ema and "ema" not in state:
            raise AccelError("no EMA weights kept: prepare(..., ema=DECAY)")
        tensors = {**state["model"], **(state["ema"] if ema else {})}
        dtypes = self.dtypes()
        out = {}
        for name, value in tensors.items():
            whole = full_value(value).detach()
            out[name] = whole.to("cpu", dtype=dtypes.get(name, whole.dtype), copy=True)
        missing = set(dtypes) - set(out)
        if missing:
            raise AccelError(
                f"this layout keeps {len(missing)} of the model's tensors on other ranks (a "
                "pipeline): engine.save(path), then accel-export gives the whole state"
            )
        return out

    def dtypes(self) -> dict[str, torch.dtype]:
        model = self.model_given
        if model is None:
            return {}
        reading, self.reading = self.reading, True
        try:
            return {n: t.dtype for n, t in model.state_dict().items()}
        finally:
            self.reading = reading

    def sync_model(self) -> nn.Module:
        """Your model, holding the trained weights; returns it. On eager, compile and xla it is
        the module trained (moved to the device), so this changes nothing; jax trains arrays of
        its own and copies them in here, and whenever the script reads that model (its
        state_dict() or its forward: TrainedOnRead). Call it on every rank."""
        model = self.model_given
        if model is None:
            raise AccelError("this engine was given no model to sync")
        if not self.runner.trains_in_place:
            changes = self.changes
            model.load_state_dict(self.state_dict())
            self.synced = changes
        return model

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank; every rank gets the same answer (a collective:
        call it on every rank)."""
        return self.runner.any_rank(flag)

    # --- timing and accounting ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device work queued so far (to time steps from the host)."""
        self.runner.synchronize()

    def mark_warmup_done(self) -> None:
        """Count compiles from here on: `stats().compiles_after_warmup` are recompiles, and a
        step past CompilerConfig's `max_recompiles` of them raises RecompileError."""
        self.runner.mark_warmup_done()

    def stats(self) -> BackendStats:
        """What the backend tells of the run so far: graphs compiled (and after warm-up), compile
        time, persistent-cache hits, ops run off the compiler, the training state a rank holds,
        the device's peak memory."""
        return self.runner.stats()

    # --- checkpoints: the command line's format, tensors only ------------------------------------
    def checkpoint_parts(self) -> CheckpointParts:
        """What save and load write and read: the backend's tensors, the loop state (the API's:
        the step count alone) and the random states."""
        return CheckpointParts(BackendTensors(self.runner), self.state, RandomStates(self.runner))

    def save(
        self,
        path: str | Path,
        extra: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Weights, optimizer state (by parameter name), EMA, the loop state and random states,
        in the command line's format: it loads on any backend and layout, and `launch_single_task
        --resume` takes it. Call it on every rank; it returns once the checkpoint is whole on
        disk. One file written by rank 0, atomically; where `sharded_checkpoint`, a folder
        (torch.distributed.checkpoint) each rank writes its shards to, so no rank ever holds the
        whole state. `extra`: your script's own small state (epoch, best accuracy, a scheduler's
        state_dict(): numbers, strings, lists, dicts, tensors), which `load` returns. `meta`:
        values kept beside them, read back by accel.checkpoint.read_meta."""
        path = Path(path)
        meta = {**(meta or {}), "world_size": self.replicas}
        rates = self.rates.saved() if isinstance(self.rates, LearningRates) else None
        if rates is not None:  # the user's optimizer's, which `load` puts back
            meta["optimizer_lr"] = rates
        if extra is not None:
            meta["extra"] = extra
        sharded = self.sharded_checkpoint
        save_checkpoint(path, self.checkpoint_parts(), meta, self.is_main, self.rank, sharded)
        self.runner.any_rank(False)  # every rank waits for the writer: a load may follow at once
        return path

    def load(self, path: str | Path, rng: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint written by `save` or by the command line (any backend, any layout),
        without unpickling anything but tensors; returns the `extra` it was saved with ({}
        where none). `rng`: restore the random generators too (default: where the saved run
        had as many replicas, so their streams carry on). The optimizer given to `prepare`
        takes back the learning rates its groups had when saved (a scheduler restored from
        `extra` goes on from them); a scheduler given as `schedule` is stepped to the saved
        step."""
        path = Path(path)
        meta = read_meta(path)
        if rng is None:
            rng = meta.get("world_size") == self.replicas
        load_checkpoint(path, self.checkpoint_parts(), meta, self.rank, rng=rng)
        self.changes += 1
        if isinstance(self.rates, LearningRates):
            self.rates.restore(meta.get("optimizer_lr"), self.state.step)
        return dict(meta.get("extra", {}))


class TrainedOnRead:
    """Where the backend trains arrays of its own (jax), the model a script gave `prepare` reads
    as the trained one: its state_dict() and its forward first copy the trained weights in
    (Engine.sync_model), once after each step or load. Torch's public module hooks, on the
    model itself (not its submodules); the engine is held weakly, so the model does not keep it
    alive."""

    def __init__(self, engine: Engine, model: nn.Module):
        self.engine = weakref.ref(engine)
        model.register_state_dict_pre_hook(self.before_state_dict)
        model.register_forward_pre_hook(self.before_forward)

    def before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.sync()

    def before_forward(self, module: nn.Module, args: tuple) -> None:
        # The backend traces the model on tensors of its own (torchax's, on the "jax" device),
        # with the weights it hands the trace: nothing to copy in then.
        if not any(isinstance(a, torch.Tensor) and a.device.type == "jax" for a in args):
            self.sync()

    def sync(self) -> None:
        engine = self.engine()
        if engine is not None and not engine.reading and engine.synced != engine.changes:
            engine.sync_model()


class LoopPart(Protocol):
    """The loop state a checkpoint carries: the steps done, and whatever else the loop keeps."""

    step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepCount:
    """The public API's loop state: the optimizer steps taken."""

    step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def check_workers(batches: Iterable) -> None:
    """A DataLoader's workers can start (its fork server started on this thread)."""
    problem = fork_server.workers_problem(batches)
    if problem:
        raise AccelError(problem)


def check_sharded(batches: Iterable, ranks: int) -> None:
    """Under several processes a DataLoader must hand each rank its own part."""
    if ranks < 2 or not isinstance(batches, DataLoader):
        return
    # A DataLoader's batch_sampler is a BatchSampler (torch types it as any iterable).
    batch_sampler: Any = batches.batch_sampler
    sampler = batch_sampler.sampler if batch_sampler else batches.sampler
    if not isinstance(sampler, DistributedSampler):
        raise AccelError(
            f"{ranks} processes read the same DataLoader: give it "
            "sampler=DistributedSampler(dataset) so each rank trains on its own part"
        )


class EvalModel:
    """`engine.model`: the model a script evaluates, as a module it can call. `eval()` and
    `train()` are accepted and change nothing (the model trains only through engine.step), and
    `state_dict()` is the trained weights (engine.state_dict)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self, *inputs: Any) -> Any:
        first = inputs[0] if inputs else None
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        if device.type not in ("cpu", "cuda", "xla"):
            device = torch.device("cpu")  # jax's views: their values come back to the host
        with user_errors("forward"):
            out = self.engine.runner.forward(inputs)
        return on_device(out, device)

    def eval(self) -> EvalModel:
        return self

    def train(self, mode: bool = True) -> EvalModel:
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.state_dict()


def on_device(out: Any, device: torch.device) -> Any:
    """A model's output (a tensor, or tuples, lists and dicts of them) on `device`."""
    if isinstance(out, torch.Tensor):
        return out.to(device)
    if isinstance(out, tuple | list):
        return type(out)(on_device(o, device) for o in out)
    if isinstance(out, dict):
        return {k: on_device(v, device) for k, v in out.items()}
    return out


def check_batch(batch: tuple) -> None:
    """A step's batch is a tuple of tensors (or arrays) sharing their first, batch, axis."""
    if not batch:
        raise AccelError(
            "engine.step() got no batch: give its tensors, engine.step(images, labels)"
        )
    for value in batch:
        if isinstance(value, dict):
            raise AccelError(
                "a batch is tensors, not a dict: engine.step(batch['image'], batch['label']) "
                "(loss_fn gets them as its batch tuple)"
            )
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) == 0:
            kind = type(value).__name__ if shape is None else "a 0-dim tensor"
            raise AccelError(f"a batch's tensors split along their first axis, got {kind}")


def shape_text(shapes: tuple) -> str:
    return " ".join(str(list(shape)) for shape in shapes)


def say(line: str) -> None:
    """A notice of one line on stderr."""
    print(f"accel: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def user_errors(where: str) -> Iterator[None]:
    """What the backend raises while tracing, compiling or running the user's own code becomes
    one AccelError naming the user's file and line (and the op, where the error names one);
    errors inside accel's or the libraries' own code keep their traceback."""
    try:
        yield
    except (ConfigError, BackendUnavailable, RecompileError):
        raise  # already one line (or the launcher's own exit)
    except Exception as err:
        frame = user_frame(traceback.extract_tb(err.__traceback__))
        if frame is None:
            raise
        detail = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        raise AccelError(
            f"{type(err).__name__} in the {where} at {frame.filename}:{frame.lineno} "
            f"({(frame.line or '').strip()}): {detail[:300]}"
        ) from None


class SkipWatch:
    """Steps whose update was skipped (a non-finite loss or gradient): none applied of the first
    LIMIT is an error; LIMIT in a row later is said once."""

    LIMIT = 10

    def __init__(self) -> None:
        self.seen = self.in_row = 0
        self.applied = self.said = False

    def watch(self, results: Sequence[StepResult], main: bool) -> None:
        for result in results:
            self.seen += 1
            self.applied |= result.applied
            self.in_row = 0 if result.applied else self.in_row + 1
        if not self.applied and self.seen >= self.LIMIT:
            raise AccelError(
                f"none of the first {self.seen} steps applied its update: the loss or the "
                "gradients were not finite in every one (check the loss and the learning rate)"
            )
        if self.in_row >= self.LIMIT and not self.said and main:
            self.said = True
            say(f"the last {self.in_row} steps skipped their update (non-finite loss or gradients)")


__all__ = ["AccelError", "Engine", "StepResult", "choose_backend", "prepare"]
