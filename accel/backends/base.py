"""The backend seam: the whole training step, not backward()/optimizer.step().

torchax needs a pure step function carrying weights and optimizer state, so the seam sits around
the full optimizer step (micro-batches, gradient averaging, clipping, update). Each backend lives in
one file of this package and is found by name; its framework imports stay inside that file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from models.factory import ImageClassifier

Batch = tuple[torch.Tensor, torch.Tensor]  # uint8 NCHW images, float soft targets


class StepResult(NamedTuple):
    loss: float  # mean over ranks
    applied: bool  # False: the loss or the gradients were not finite and the update was skipped


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (missing package, version mismatch): one line, exit 2."""


class RecompileError(RuntimeError):
    """The compiled graph keeps changing after warm-up (--max_recompiles): one line, exit 3."""


@runtime_checkable
class Backend(Protocol):
    name: str
    local_replicas: int  # devices one process drives (jax: its local devices; others: 1)
    pin_memory: bool  # whether the loader should hand over batches in pinned host memory

    def setup(self, model: ImageClassifier) -> None:
        """Place the model, build the optimizer and whatever the step needs."""

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Any]:
        """Move host batches to the device, prefetching where the backend can."""

    def train_step(self, micro_batches: list[Any], lr: float) -> Any:
        """One optimizer step over `micro_batches` (gradient accumulation), left undone where the
        loss or the gradients are not finite; returns a handle of the loss and of whether the
        update was applied, which stays on the device until `fetch_results`."""

    def fetch_results(self, handles: list[Any]) -> list[StepResult]:
        """Host values of step handles, averaged over ranks: one sync for the whole group."""

    def evaluate(self, batches: Iterable[dict]) -> dict[str, float]:
        """Mean loss and top-1 accuracy over masked, padded batches, reduced over ranks."""

    def state_dict(self) -> dict[str, Any]:
        """{'model': fp32 torch state dict, 'optimizer': torch optimizer state dict, ...}."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def rng_state(self) -> dict[str, Any]:
        """This replica's device random generator state (empty where there is none)."""

    def load_rng_state(self, state: dict[str, Any]) -> None: ...

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""

    def mark_warmup_done(self) -> None:
        """Start counting compiles from here on."""

    def stats(self) -> dict[str, Any]:
        """compiles_after_warmup, fallback_ops and whatever else the backend can tell."""
