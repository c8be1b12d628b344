"""torch.compile (inductor) backend: the eager backend with a compiled model."""

from __future__ import annotations

from typing import Any

import torch

from accel.backends.eager import EagerBackend
from accel.config import RunConfig
from accel.distributed import DistContext
from models.factory import ImageClassifier

KERNEL_OPTS = "as eager, plus inductor's max-autotune mode"


def require() -> None:
    """torch.compile ships with torch."""


def build(cfg: RunConfig, ctx: DistContext) -> CompileBackend:
    return CompileBackend(cfg, ctx)


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class CompileBackend(EagerBackend):
    """The training forward and the loss compile as one graph, as in a user's own compiled
    step: the soft-target cross-entropy fuses with the classifier instead of running eagerly."""

    name = "compile"

    def setup(self, model: ImageClassifier) -> None:
        self._frames_at_warmup = 0
        super().setup(model)
        mode = "max-autotune-no-cudagraphs" if self.cfg.kernel_opt else None
        self.forward_loss = torch.compile(self.forward_loss, mode=mode)

    def mark_warmup_done(self) -> None:
        self._frames_at_warmup = _frames_compiled()

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "graphs_compiled": _frames_compiled(),
            "compiles_after_warmup": _frames_compiled() - self._frames_at_warmup,
        }
