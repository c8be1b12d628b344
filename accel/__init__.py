"""accel: one training step for any PyTorch model, run on the backend chosen (eager, torch.compile,
torch_xla or JAX's XLA through torchax) and split over devices as asked (FSDP, tensor and pipeline
parallel).

In your own script: `engine = accel.prepare(model, optimizer, loss_fn)` (accel/api.py makes
the Engine of accel/engine.py); the command line (accel/cli/) is one more client of it. The
names below load on first use, so that importing a part of accel (or the command line's fast
help) does not import every backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.api import engine_of, prepare
    from accel.backends import resolve_backend
    from accel.backends.base import BackendUnavailable, RecompileError
    from accel.checks import check_batch, check_layout
    from accel.engine import AccelError, Engine, StepResult
    from accel.processes import is_local_main_process, is_main_process, skip_first_batches
    from accel.settings import Settled, settle, with_keywords

__all__ = [
    "AccelError",
    "BackendUnavailable",
    "Engine",
    "RecompileError",
    "Settled",
    "StepResult",
    "check_batch",
    "check_layout",
    "engine_of",
    "is_local_main_process",
    "is_main_process",
    "prepare",
    "resolve_backend",
    "settle",
    "skip_first_batches",
    "with_keywords",
]
HOMES = {
    "engine_of": "accel.api",
    "prepare": "accel.api",
    "resolve_backend": "accel.backends",
    "BackendUnavailable": "accel.backends.base",
    "RecompileError": "accel.backends.base",
    "check_batch": "accel.checks",
    "check_layout": "accel.checks",
    "Settled": "accel.settings",
    "settle": "accel.settings",
    "with_keywords": "accel.settings",
    "is_main_process": "accel.processes",
    "is_local_main_process": "accel.processes",
    "skip_first_batches": "accel.processes",
}  # the rest: accel.engine


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(HOMES.get(name, "accel.engine")), name)
    raise AttributeError(f"module 'accel' has no attribute {name!r}")
