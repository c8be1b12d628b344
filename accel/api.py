"""accel.prepare: a model, its optimizer and its loss put on a backend, as an Engine. The
backend comes from `backend=`, else ACCEL_BACKEND, else USE_ACCEL=1, else eager; its settings
from the keywords, a shorthand for one `config=` (accel/config.py), settled and checked once by
accel/settings.py."""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Mapping

import torch
from torch import nn

from accel.backends import resolve_backend
from accel.backends.base import BackendUnavailable, LossFn, ModelInit
from accel.batches import BatchTrees
from accel.checkpoint import flatten
from accel.config import (
    AccelError,
    AmpDtype,
    AmpLevel,
    AttentionChoice,
    BackendConfig,
    BackendName,
    EmaDecayFn,
    RematChoice,
    ShardMode,
)
from accel.distributed import first_difference, init_process_group
from accel.engine import Engine
from accel.loop import LoopPart
from accel.optim import LearningRates, OptimizerSpec, ScheduleFn
from accel.parallel.tensor_parallel import resolve_plan, weight_splits
from accel.script_changes import ScriptChanges
from accel.settings import settle, with_keywords
from accel.ties import tied_names
from accel.user_model import EvalModel, TrainedOnRead
from accel.user_optimizer import TrainedOptimizer, parameter_names
from accel.workers import fork_server

Schedule = ScheduleFn | torch.optim.lr_scheduler.LRScheduler | None


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
    clip_grad: float | None = None,
    accum: int | None = None,
    amp: AmpLevel | None = None,
    amp_dtype: AmpDtype | None = None,
    ema: float | EmaDecayFn | None = None,
    backend: BackendName | None = None,
    devices: int | None = None,
    shard: ShardMode | None = None,
    tp: int | None = None,
    tp_plan: Mapping[str, str] | None = None,
    pp: int | None = None,
    seed: int | None = None,
    attention: AttentionChoice | None = None,
    remat: RematChoice | None = None,
    quiet: bool = False,
    init: ModelInit | None = None,
    state: LoopPart | None = None,
    config: BackendConfig | None = None,
) -> Engine:
    """Put `model`, `optimizer` and `loss_fn` on the chosen backend; returns the Engine.

    model: any nn.Module (timm, torchvision, your own); or one built on the meta device
        (`with torch.device("meta"):`) with `init` building it with its starting values, so
        that a sharded layout never holds a whole copy on every rank. A model wrapped in
        DataParallel or DistributedDataParallel trains the module it wraps (accel splits the
        batch and reduces the gradients itself).
    optimizer: any torch.optim optimizer but LBFGS and SparseAdam over the model's parameters,
        with its param groups (their own lr and weight decay; timm's `lr_scale` for layer decay).
        accel rebuilds it over the tensors it updates (jax: translates it to optax or to torch's
        own arithmetic); yours is not stepped, but
        its state_dict() and load_state_dict() are the engine's (accel/user_optimizer.py).
    loss_fn: (model, batch) -> scalar tensor, or (loss, {name: scalar tensor}) whose extras
        (training accuracy, say) come back with the loss in `fetch`; `batch` is what `step`
        was given (the tuple of `step(x, y)`, or the dict, list or tuple of `step(batch)`).
        Call the model inside: every backend traces it. Read no value on the host (no
        `.item()`).
    schedule: the base learning rate as a function of the optimizer step (each group keeps its
        ratio to the first group's rate), or a torch LRScheduler bound to `optimizer` that accel
        steps. Without it each step takes `optimizer`'s groups' rates as they are then: step
        your own scheduler (per step or per epoch) as you always have.
    clip_grad: the gradients' global norm limit, after the mean over replicas (0: none).
    accum: micro-batches each `step` batch is split into (same result, less memory); a
        shorter group given to `step_micro_batches` weighs its share of a whole one, as the
        plain loop's that divides each micro-batch's loss by `accum`.
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
        "cudnn" (cuDNN flash attention wherever it takes the shape, on a CUDA GPU), "pallas"
        (one fused kernel each way for windows of at most 128 tokens with a bias, Swin's:
        Triton on a CUDA GPU, Pallas's interpreter elsewhere) or "auto" (by shape: cuDNN for
        long unbiased sequences such as ViT's, the fused kernel for Swin's biased windows on a
        GPU, XLA for the rest; accel/backends/jax/attention.py). The other backends run
        torch's own attention.
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
        compile cache and recompile limits among them). It is the base: each keyword above that
        is given sets its field over it (`config=cfg, ema=0.999` is cfg with that EMA). Left
        unset, a keyword takes the config's value, whose defaults are those written above.
    """
    config = with_keywords(
        config, backend=backend, clip_grad=clip_grad, accum=accum, amp=amp, amp_dtype=amp_dtype,
        ema=ema, devices=devices, shard=shard, tp=tp, tp_plan=tp_plan, pp=pp, seed=seed,
        attention=attention, remat=remat,
    )  # fmt: skip
    try:
        return _engine_for(model, optimizer, loss_fn, config, schedule, quiet, init, state)
    except (AccelError, BackendUnavailable) as err:
        # Already one line that names the cause (a bad ACCEL_BACKEND, an untrainable model...):
        # raised from here with none of the frames it came through inside accel, so that the
        # script's traceback shows its own line and prepare's, as the step's errors do.
        raise err.with_traceback(None) from None


def _engine_for(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    config: BackendConfig,
    schedule: Schedule,
    quiet: bool,
    init: ModelInit | None,
    state: LoopPart | None,
) -> Engine:
    """prepare's work over its settled keywords."""
    if fork_server.importing_main:  # a loader's fork server imports the script, and runs no step
        raise AccelError("prepare runs as the script is imported: call it under its main guard")
    given, model = model, unwrapped(model)
    try:  # checked once, here as on the command line; the backend runs here and every setting
        settled = settle(config)
    except BackendUnavailable as err:
        raise AccelError(str(err)) from None
    config, module = settled.config, settled.module
    if not any(p.requires_grad for p in model.parameters()):
        raise AccelError(
            f"{type(model).__name__} has no trainable parameter (requires_grad is False on every "
            "one): there is nothing to train"
        )
    check_float32(model)
    check_hooks(model, settled.supports.gradient_hooks, config.backend)
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
    # Workers forked from a process that runs threads may deadlock on a lock one of them held
    # (malloc's, a runtime's), and Python warns of it: JAX's runtime runs threads, and so does
    # the process group of a process that joined its peers (gloo's, NCCL's). There the
    # script's DataLoaders start theirs from a fork server (Python 3.14's default on Linux),
    # unless the script chose a start method itself. The server imports torch and the script
    # once, not each worker of each pass. engine.close() puts it back.
    forks_unsafely = runner.threaded or ctx.distributed
    fork_server_use = fork_server.use_fork_server() if forks_unsafely else None
    names = parameter_names(optimizer, model)  # before xla moves the parameters
    trees = BatchTrees()  # batches as dicts, lists or tuples: the backend sees their tensors
    runner.adopt(model, spec, trees.loss(loss_fn), init)
    if not quiet and ctx.is_main:
        print(f"accel: {config.backend} backend ({settled.why})", file=sys.stderr, flush=True)
    # The user's scheduler steps their optimizer's rates; accel's optimizer steps, theirs never
    # does, so torch's warning that the scheduler stepped first would be wrong every time. torch
    # marks an optimizer that has stepped with `_opt_called` (set by the step its schedulers
    # wrap, no public API): set on this optimizer alone, rather than a process-wide filter.
    optimizer._opt_called = True  # type: ignore[attr-defined]
    rates = LearningRates(spec, schedule, optimizer)
    engine = Engine(
        backend=runner,
        ctx=ctx,
        rates=rates,
        accum=config.step.accum,
        ema=config.step.ema,
        state=state,
        max_recompiles=config.compiler.max_recompiles,
        model_given=model,
        on_close=fork_server_use.undo if fork_server_use else None,
        trees=trees,
        script=ScriptChanges(model, optimizer, {n for g in spec.groups for n in g.names}),
    )
    if not runner.trains_in_place and not any(p.is_meta for p in model.parameters()):
        TrainedOnRead(engine, model)  # jax: the script's model reads as the trained one
    TrainedOptimizer(engine, optimizer, names)  # and its optimizer, on every backend
    ENGINES[model] = ENGINES[given] = weakref.ref(engine)  # accel.engine_of(model)
    return engine


# Each model given to prepare -> its Engine, both held weakly: the registry keeps neither alive.
ENGINES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Engine]] = weakref.WeakKeyDictionary()


def engine_of(model: nn.Module | EvalModel) -> Engine:
    """The Engine `prepare` made for `model` (the module given to it, or `engine.model`), so
    that a function of your script that receives the model needs no new argument to step it:

    >>> import torch, accel
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = accel.prepare(model, optimizer, lambda m, b: m(b[0]).pow(2).mean(),
    ...                        backend="eager", quiet=True)
    >>> def train_one(model, batch):  # the script's own function, its arguments unchanged
    ...     return accel.engine_of(model).step(batch)
    >>> accel.engine_of(model) is engine is accel.engine_of(engine.model)
    True
    """
    if isinstance(model, EvalModel) and isinstance(model.engine, Engine):
        return model.engine
    found = ENGINES.get(model) if isinstance(model, nn.Module) else None
    engine = found() if found is not None else None
    if engine is None:
        raise AccelError(
            f"this {type(model).__name__} was not given to accel.prepare (or its engine is "
            "gone): give engine_of the model you prepared"
        )
    return engine


def unwrapped(model: nn.Module) -> nn.Module:
    """The module inside torch's data-parallel wrappers (DataParallel, DistributedDataParallel),
    which a script moved onto accel may still apply: accel splits the batch and reduces the
    gradients itself, so it trains the module wrapped (whose parameters the wrapper's are)."""
    while isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def check_same_on_every_rank(cfg: BackendConfig) -> None:
    """Every rank builds the same backend: a setting that differs between ranks (a seed or a
    mesh read from the rank or the host) is refused in one line on every rank before anything is
    built, where the build would hang in a collective or each rank would train differently. The
    compile cache is the host's own, and may differ."""
    settings = flatten(dataclasses.asdict(cfg))
    mine = {
        k.split(".", 1)[-1]: described(v) for k, v in settings.items() if k != "compiler.cache_dir"
    }
    difference = first_difference(mine)
    if difference:
        raise AccelError(f"the ranks called prepare with different options: {difference}")


def described(value: object) -> object:
    """A setting as the ranks compare it: a function (an EMA decay's) by its qualified name,
    a callable object by its repr, the same on every rank where their addresses are not."""
    if not callable(value):
        return value
    name = getattr(value, "__qualname__", None)
    return f"{value.__module__}.{name}" if name else repr(value)


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


def check_hooks(model: nn.Module, runs: tuple[str, ...], backend: str) -> None:
    """Backward hooks the backend's step would not run (jax differentiates its trace itself;
    xla's step runs no tensor hook) are refused in one line naming the module or parameter,
    rather than trained without. torch lists a module's and a tensor's backward hooks only in
    their own dicts (no public API reads them)."""
    cure = (
        f"the {backend} backend's step would not run it: remove it, or train with eager or compile"
    )
    if "module" not in runs:
        for name, module in model.named_modules():
            if module._backward_hooks or module._backward_pre_hooks:
                where = name or type(model).__name__
                raise AccelError(
                    f"{where} has a backward hook (register_full_backward_hook): {cure}"
                )
    if "tensor" not in runs:
        for name, parameter in model.named_parameters():
            if parameter._backward_hooks:
                raise AccelError(f"{name} has a gradient hook (register_hook): {cure}")


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


__all__ = ["choose_backend", "engine_of", "prepare"]
