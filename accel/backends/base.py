"""The backend seam: the whole training step, not backward()/optimizer.step().

torchax needs a pure step function carrying weights and optimizer state, so the seam sits around
the full optimizer step (micro-batches, gradient averaging, clipping, update). Each backend lives in
a folder of this package (xla/, jax/, torch_family/ for eager and compile), found by name; its
framework imports stay inside that folder.

What a backend package provides and what its runner does are written in runner.py (BackendModule,
Runner); here, what they share: the step's results, the batch and loss types, the support table,
the statistics and what every runner does the same (RunnerBase).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from accel.amp import amp_policy
from accel.backends.host_reads import user_frame
from accel.config import AMP_LEVELS, AccelError, BackendConfig
from accel.distributed import DistContext

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


def final_layer_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the layer the model gives as its classifier (`get_classifier()`, as
    timm's models and the command line's do): their share of the training state is reported
    apart (BackendStats.state_bytes' 'classifier'); a model without the method, none."""
    given = getattr(model, "get_classifier", None)
    layer = given() if callable(given) else None
    return list(layer.parameters()) if isinstance(layer, torch.nn.Module) else []


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
