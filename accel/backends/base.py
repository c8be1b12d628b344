"""The backend seam: the whole training step, not backward()/optimizer.step().

torchax needs a pure step function carrying weights and optimizer state, so the seam sits around
the full optimizer step (micro-batches, gradient averaging, clipping, update). Each backend lives in
a folder of this package (xla/, jax/, torch_family/ for eager and compile), found by name; its
framework imports stay inside that folder.

A backend module provides SUPPORTS (what it can run), require() (raise BackendUnavailable where it
cannot run here), context() (this process's place among the replicas) and build(cfg, ctx).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from accel.amp import amp_policy
from accel.backends.host_reads import user_frame
from accel.batches import ModelCall
from accel.config import AMP_LEVELS, AccelError, BackendConfig
from accel.distributed import DistContext
from accel.optim import OptimizerSpec

# Any tensors a user's loss function takes, each split along its first dimension (the command
# line's: uint8 NCHW images, float soft targets and, with random erasing, int32 rectangles).
Batch = tuple[torch.Tensor, ...]
# (model, batch) -> scalar loss: the model is called inside, so every backend can trace it.
LossFn = Callable[[Callable[..., torch.Tensor], Batch], torch.Tensor]
# Builds the whole model with its starting values (for a model given on the meta device).
ModelInit = Callable[[], torch.nn.Module]
# (model, batch) -> {name: tensor of sums}: evaluation sums, added over batches and ranks.
MetricFn = Callable[[Callable[..., torch.Tensor], Batch], dict[str, torch.Tensor]]


class _LossApplied(NamedTuple):
    loss: float  # mean over replicas
    applied: bool  # False: the loss or the gradients were not finite and the update was skipped


class StepResult(_LossApplied):
    """A step's host values: `loss` (the mean over replicas), `applied` (False where a
    non-finite loss or gradient skipped the update) and `extras`, what the loss function
    returned beside the loss ({name: float}, each the mean over micro-batches and replicas).
    Unpacks as (loss, applied); the numbers are numpy float64s, Python floats with `.item()`.

    >>> result = StepResult(0.5, True, {"acc1": 0.25})
    >>> loss, applied = result
    >>> result.extras["acc1"]
    0.25
    """

    extras: dict[str, float]

    def __new__(cls, loss: float, applied: bool, extras: dict[str, float] | None = None):
        result = super().__new__(cls, loss, bool(applied))
        result.extras = dict(extras or {})
        return result

    @classmethod
    def from_rows(cls, rows: Iterable[Any], keys: Sequence[str] = ()) -> list[StepResult]:
        """Step handles' host values, [loss, applied as 1.0 or 0.0, *extras by `keys`] each,
        as StepResults (each backend's fetch_results is the transfer to the host, and this)."""
        out = []
        for row in rows:
            # numpy's float64 is a Python float that also has .item(), as the tensor a loop
            # logged before had: `losses.append(loss.item())` reads either.
            loss, applied, *extras = (np.float64(v) for v in row)
            out.append(cls(loss, bool(applied > 0), dict(zip(keys, extras, strict=True))))
        return out


def classifier_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the model's final classifier, where the model names them: a model with
    a `classifier_parameters()` method (returning its classifier's parameters) has their share
    of the training state reported apart (BackendStats.state_bytes' 'classifier'); any other
    model, none."""
    named = getattr(model, "classifier_parameters", None)
    return list(named()) if callable(named) else []


def group_divisor(micro_steps: int, accum: int) -> int:
    """What each micro-batch's loss is divided by before its backward: `accum`, as the plain
    loop (and Accelerate) divide it, so that a short group at an epoch's end (k < accum
    micro-batches) weighs k/accum of a whole one; more than `accum` are averaged."""
    return max(micro_steps, accum)


def split_batch(batch: tuple, parts: int) -> list[tuple]:
    """A batch as `parts` micro-batches along its first axis (gradient accumulation)."""
    size = batch[0].shape[0] // parts
    return [tuple(t[i * size : (i + 1) * size] for t in batch) for i in range(parts)]


def split_loss(out: Any) -> tuple[Any, dict[str, Any]]:
    """A loss function's result as (loss, extras): a scalar, or (scalar, {name: scalar}) with
    the step's extras (training accuracy, say), torch tensors or JAX arrays alike. Anything else
    is refused in one line."""
    extras: Any = {}
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], dict):
        out, extras = out
    shape = tuple(getattr(out, "shape", (None,)))
    if shape != ():
        got = f"shape {list(shape)}" if shape != (None,) else type(out).__name__
        raise AccelError(
            f"loss_fn must return a scalar tensor (a vector's .mean()), or (loss, {{name: scalar "
            f"tensor}}); it returned {got}{_called_at()}"
        )
    for name, value in extras.items():
        if tuple(getattr(value, "shape", ())) != ():
            raise AccelError(
                f"loss_fn's extra '{name}' must be a scalar, got shape {list(value.shape)}"
                + _called_at()
            )
    return out, dict(sorted(extras.items()))


def _called_at() -> str:
    """The user's line that ran the step (the loss function has returned by now)."""
    frame = user_frame(traceback.extract_stack())
    return f" (the step at {frame.filename}:{frame.lineno}: {frame.line})" if frame else ""


def replica_seed(seed: int, replica: int) -> int:
    """The seed of data replica `replica`'s stream of step draws (dropout, stochastic depth),
    from prepare's `seed`: numpy's SeedSequence mixes the two, so neighbouring seeds and replicas
    give unrelated streams, none of them the one torch.manual_seed(seed) gives the user's own
    draws. A 32-bit number, which every backend's generator takes.

    >>> replica_seed(0, 0) != replica_seed(0, 1) != replica_seed(1, 0)
    True
    """
    return int(np.random.SeedSequence([seed % 2**64, replica]).generate_state(1)[0])


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (missing package, version mismatch): one line, exit 2."""


class RecompileError(RuntimeError):
    """The compiled graph keeps changing after warm-up (max_recompiles=): one line, exit 3."""


@dataclass(frozen=True)
class Supports:
    """What a backend can run; the launcher refuses the rest in one line, before any work."""

    amp_levels: tuple[str, ...] = AMP_LEVELS
    float16: bool = False  # amp_dtype='float16' (loss scaling)
    shard: tuple[str, ...] = ("none",)  # shard= modes
    tp: bool = False  # transformer blocks split by tensors
    tp_head: bool = False  # the classifier split by class
    pp: bool = False
    # Options that cannot run together here: (flag, flag, why), refused in one line naming both.
    exclusive: tuple[tuple[str, str, str], ...] = ()
    remat: bool = False
    # Batches already on the CUDA device (decoded there) taken by loader and step as they are.
    cuda_batches: bool = False
    # How devices=N runs: "processes" (torchrun, one a device) or "devices" (one
    # process drives N devices).
    replicas: str = "processes"
    cpu_replicas: bool = True  # more than one replica on a CPU machine
    # Keywords that split over one process's devices only: refused where several processes
    # train together (torchrun's ranks, jax's hosts).
    one_process: tuple[str, ...] = ()
    kernel_opt: str = "nothing"  # what kernel_opt=True adds
    # Backward hooks the step runs as eager runs them: "module" (register_full_backward_hook),
    # "tensor" (a parameter's register_hook); the model's others are refused by prepare.
    gradient_hooks: tuple[str, ...] = ()
    # The torch.optim optimizers the step runs (accel.optim refuses LBFGS and SparseAdam).
    optimizers: str = "all of torch.optim's, by torch's own update"


@dataclass
class BackendStats:
    """What a backend tells of its run (Engine.stats), by these names; `details` holds what only
    this backend has, by its own."""

    graphs_compiled: int = 0  # programs or frames compiled in the run
    compiles_after_warmup: int = 0
    # Seconds spent compiling (xla: its CompileTime; jax: the phases' sum); None where the
    # backend does not measure it (eager, compile).
    compile_time_s: float | None = None
    compile_phases_s: dict[str, float] = field(default_factory=dict)  # jax: where it went
    persistent_cache: bool = False  # compiled programs kept between runs
    persistent_cache_hits: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)  # ops run off the compiler
    devices: int = 1  # devices this process drives
    shard: str = "none"
    state_bytes: dict[str, int] = field(default_factory=dict)  # training state a rank holds
    peak_memory_bytes: int | None = None  # the device allocator's peak (None: not kept)
    details: dict[str, Any] = field(default_factory=dict)  # what only this backend has

    def to_summary(self) -> dict[str, Any]:
        """The fields as one flat record, `details` among them."""
        fields = asdict(self)
        details = fields.pop("details")  # flat: no nested copy beside its fields
        return {**fields, **details}


class RunnerBase:
    """What every backend does the same, written once: it keeps the config and the process's
    context it was built with, and builds the one AMP policy of the config's step (accel.amp)."""

    def __init__(self, cfg: BackendConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.amp = amp_policy(cfg.step.amp, cfg.step.amp_dtype)

    def freeze(self, names: frozenset[str]) -> None:
        """A step that is torch's autograd follows a weight frozen between steps as torch does
        (no gradient, so no update): nothing to do."""

    def release(self) -> None:
        """Nothing of the backend's left on the user's model (Engine.close): most put none."""


class SinceStart:
    """Process-wide counters read as what happened since the backend started: dynamo's frames,
    torch_xla's metrics and JAX's compile events are kept per process, and a second Engine in
    the process (a notebook's, a sweep's) counts its own.

    >>> counts = {"compiles": 3}
    >>> since = SinceStart(lambda: dict(counts))
    >>> counts["compiles"] = 5
    >>> since()["compiles"]
    2
    """

    def __init__(self, read: Callable[[], dict[str, float]]):
        self.read, self.start = read, read()

    def __call__(self) -> dict[str, float]:
        now = self.read()
        return {name: value - self.start.get(name, 0) for name, value in now.items()}


@runtime_checkable
class Runner(Protocol):
    name: str
    local_replicas: int  # data replicas one process feeds (xla, jax: its mesh's data axis)
    step_devices: int  # devices this process's step runs on (xla, jax: the mesh; others: 1)
    pin_memory: bool  # whether the loader should hand over batches in pinned host memory
    data_parallel: tuple[int, int]  # (rank, ranks) the data is split over
    sharded_checkpoint: bool  # every rank writes its own part (DCP), or one file from rank 0
    # Whether the model given to `adopt` is the module trained (moved to the device; jax trains
    # arrays of its own), and whether a batch of a new shape compiles the step again.
    trains_in_place: bool
    compiles_per_shape: bool
    threaded: bool  # its runtime runs threads: a DataLoader's workers must not be forked
    explain_compiles: str  # how to have the compiler say why each graph compiled

    def adopt(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerSpec,
        loss_fn: LossFn,
        init: ModelInit | None = None,
    ) -> None:
        """The one way a model enters a backend (accel.prepare): `optimizer` describes the
        user's torch optimizer, which the backend rebuilds (or translates) over the tensors it
        updates. `model` may be on the meta device, with `init` building it whole with its
        starting values: a split layout allocates only this rank's part and fills it from
        rank 0's build."""

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Any]:
        """Move host batches to the device, prefetching where the backend can."""

    def train_step(
        self, micro_batches: list[Any], lr: float | list[float], ema_decay: float = 0.0
    ) -> Any:
        """One optimizer step over `micro_batches` (gradient accumulation) at learning rate `lr`
        (one base rate, each group scaled by its lr_scale, or one rate per group), and the weights'
        EMA with `ema_decay` (ema=), left undone where the loss or the gradients are not
        finite; returns a handle of the loss and of whether the update was applied, which stays
        on the device until `fetch_results`."""

    def freeze(self, names: frozenset[str]) -> None:
        """From the next step, the held weights `names` (they no longer require a gradient)
        left as they are, as torch leaves a weight without a gradient."""
        ...

    def release(self) -> None:
        """Remove what the backend put on the user's model (its hooks): Engine.close."""
        ...

    def lowered_step(
        self, micro_batches: list[Any], lr: float | list[float], platforms: Sequence[str] = ()
    ) -> Any:
        """The whole step lowered for these batches' shapes and run nowhere, where the backend
        compiles one program (jax: a jax.stages.Lowered; for `platforms`, a
        jax.export.Exported); BackendUnavailable elsewhere."""

    def split(self, batch: tuple, parts: int) -> list[Any]:
        """A batch (from `device_batches`, or host tensors) as `parts` micro-batches."""

    def forward(self, call: ModelCall) -> Any:
        """The model in eval mode on `call`'s arguments, without gradients (engine.model):
        torch tensors on the backend's device (jax: on the host)."""

    def fetch_results(self, handles: list[Any]) -> list[StepResult]:
        """Host values of step handles, averaged over ranks: one sync for the whole group."""

    def evaluate_sums(
        self, batches: Iterable[Any], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        """Sums of `metric_fn(model, batch)` over host or device batches, summed over ranks;
        with `ema`, of the EMA weights. The one evaluation: the command line's is
        a classifier's metrics over masked, padded batches."""

    def checkpoint_state(self) -> dict[str, Any]:
        """{'model': {name: tensor}, 'optim': {name: {'step', 'exp_avg', 'exp_avg_sq'}}, and
        with an EMA (ema=) 'ema': {name: tensor}} by the full model's parameter names: whole CPU
        tensors for a one-file checkpoint, or this rank's part (DTensors, or the parameters it
        holds) for a sharded one. Loading fills the same structure in place of the values."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None: ...

    def live_state(self) -> dict[str, Any]:
        """checkpoint_state's structure as the backend holds it on its devices, nothing copied
        or gathered: its own tensors (DTensors, XLA tensors, jax arrays), with their layouts."""

    def rng_state(self) -> dict[str, torch.Tensor]:
        """This replica's random states the backend keeps: the stream of the step's draws
        (`seed=`, `replica_seed`) and the device's own generator where it has one."""

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (every rank gets the same answer)."""

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's `data` on every rank (a collective: every rank calls it)."""

    def gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's `tensor` (the same shape and dtype on each), in process order, on
        the host ([tensor] alone); a collective."""

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""

    def step_compiles(self) -> int:
        """Graphs of the training step compiled so far (evaluation's own not counted; 0 where
        nothing compiles). The Engine counts those after warm-up and stops past
        CompilerConfig.max_recompiles: one policy for every backend."""

    def stats(self) -> BackendStats:
        """Compiles, memory and whatever else the backend can tell of the run so far."""


class BackendModule(Protocol):
    """What accel/backends/<name>.py provides."""

    SUPPORTS: Supports

    def require(self) -> None: ...

    def context(self, cfg: BackendConfig) -> DistContext: ...

    def build(self, cfg: BackendConfig, ctx: DistContext) -> Runner: ...
