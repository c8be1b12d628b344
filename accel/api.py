"""accel.prepare: a model, its optimizer and its loss put on a backend, as an Engine. The
backend comes from `backend=`, else ACCEL_BACKEND, else USE_ACCEL=1, else eager; its settings
from the keywords, a shorthand for one `config=` (accel/config.py), settled and checked once by
accel/settings.py."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping

import torch
from torch import nn

from accel.backends.base import BackendUnavailable, LossFn, ModelInit
from accel.backends.runner import Runner
from accel.batches import BatchTrees
from accel.checks import check_model, check_same_on_every_rank
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
from accel.distributed import DistContext, init_process_group
from accel.engine import Engine
from accel.loop import LoopPart
from accel.optim import LearningRates, OptimizerSpec, ScheduleFn
from accel.script_changes import ScriptChanges
from accel.settings import KEYWORD_FIELDS, Settled, settle, with_keywords
from accel.user_model import EvalModel, TrainedOnRead
from accel.user_optimizer import TrainedOptimizer, parameter_names
from accel.workers import fork_server

Schedule = ScheduleFn | torch.optim.lr_scheduler.LRScheduler | None


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
    # The keywords above that set a field of the config, as given: written once, in the signature.
    settings = {name: value for name, value in locals().items() if name in KEYWORD_FIELDS}
    config = with_keywords(config, **settings)
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
    """prepare's steps over its keywords' config: settle, check, join, build, the engine."""
    if fork_server.importing_main:  # a loader's fork server imports the script, and runs no step
        raise AccelError("prepare runs as the script is imported: call it under its main guard")
    given, model = model, unwrapped(model)
    settled = settled_here(config)
    spec = check_model(model, optimizer, settled)
    ctx = join(settled)
    names = parameter_names(optimizer, model)  # before xla moves the parameters
    trees = BatchTrees()  # batches as dicts, lists or tuples: the backend sees their tensors
    undo = Undo()  # what engine.close() puts back, the last change first
    runner = build(settled, ctx, model, spec, trees.loss(loss_fn), init, undo)
    if not quiet and ctx.is_main:
        print(
            f"accel: {settled.config.backend} backend ({settled.why})", file=sys.stderr, flush=True
        )
    engine = Engine(
        runner=runner,
        ctx=ctx,
        rates=LearningRates(spec, schedule, optimizer),
        accum=settled.config.step.accum,
        ema=settled.config.step.ema,
        state=state,
        max_recompiles=settled.config.compiler.max_recompiles,
        model_given=model,
        on_close=undo,
        trees=trees,
        script=ScriptChanges(model, optimizer, {n for g in spec.groups for n in g.names}),
    )
    attach_to_user_objects(engine, model, optimizer, names, undo)
    ENGINES[model] = ENGINES[given] = weakref.ref(engine)  # accel.engine_of(model)
    return engine


def settled_here(config: BackendConfig) -> Settled:
    """The config checked once, here as on the command line, with the backend that runs it;
    a backend that cannot run here is one line, as any other refusal."""
    try:
        return settle(config)
    except BackendUnavailable as err:
        raise AccelError(str(err)) from None


def join(settled: Settled) -> DistContext:
    """The one place a process joins its peers: the process group (eager, compile), xla's
    runtime, jax.distributed; the command line and the user's script read it from the
    Engine. Ranks that were given different settings are refused before anything is built."""
    ctx = settled.module.context(settled.config)
    if settled.supports.replicas == "processes":  # jax's processes meet through jax.distributed
        init_process_group(ctx)
        check_same_on_every_rank(settled.config)
    return ctx


def build(
    settled: Settled,
    ctx: DistContext,
    model: nn.Module,
    spec: OptimizerSpec,
    loss_fn: LossFn,
    init: ModelInit | None,
    undo: Undo,
) -> Runner:
    """The backend built over the process's context, holding the model and its optimizer.

    Workers forked from a process that runs threads may deadlock on a lock one of them held
    (malloc's, a runtime's), and Python warns of it: JAX's runtime runs threads, and so does
    the process group of a process that joined its peers (gloo's, NCCL's). There the script's
    DataLoaders start theirs from a fork server (Python 3.14's default on Linux), unless the
    script chose a start method itself. The server imports torch and the script once, not each
    worker of each pass; `undo` (engine.close()) puts it back."""
    runner = settled.module.build(settled.config, ctx)
    if runner.threaded or ctx.distributed:
        fork_server_use = fork_server.use_fork_server()
        if fork_server_use:
            undo.add(fork_server_use.undo)
    runner.adopt(model, spec, loss_fn, init)
    undo.add(runner.release)
    return runner


def attach_to_user_objects(
    engine: Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    undo: Undo,
) -> None:
    """The script's own model and optimizer read as the trained ones, until engine.close().

    The user's scheduler steps their optimizer's rates; accel's optimizer steps, theirs never
    does, so torch's warning that the scheduler stepped first would be wrong every time. torch
    marks an optimizer that has stepped with `_opt_called` (set by the step its schedulers
    wrap, no public API): set on this optimizer alone, rather than a process-wide filter."""
    optimizer._opt_called = True  # type: ignore[attr-defined]
    if not engine.runner.trains_in_place and not any(p.is_meta for p in model.parameters()):
        undo.add(TrainedOnRead(engine.weights, model).remove)  # jax: reads as the trained one
    undo.add(TrainedOptimizer(engine.weights, optimizer, names).remove)  # on every backend


class Undo:
    """What Engine.close puts back of prepare's changes, in the reverse of their order (the
    optimizer's state read from the backend before the backend lets the model go), once."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        self.steps.append(step)

    def __call__(self) -> None:
        """Every step, each once, even where one fails (the start method is put back after a
        failed copy of the optimizer's state); the first failure raised after the last step."""
        failed: BaseException | None = None
        while self.steps:
            try:
                self.steps.pop()()
            except Exception as err:  # the rest still run; this one is raised at the end
                failed = failed or err
        if failed is not None:
            raise failed


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


__all__ = ["engine_of", "prepare"]
