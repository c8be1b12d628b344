"""The contract of the backend seam: what a backend package provides (BackendModule: SUPPORTS,
require(), context(), build()) and what the runner it builds does (Runner: the whole optimizer
step, evaluation, the state, the collectives). The Engine and its parts call a runner through
these methods only (tests/integration/test_api.py checks every backend has them all).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from accel.backends.base import (
    BackendStats,
    Batch,
    LossFn,
    MetricFn,
    ModelInit,
    StepResult,
    Supports,
)
from accel.batches import ModelCall
from accel.config import BackendConfig
from accel.distributed import DistContext
from accel.optim import OptimizerSpec


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
