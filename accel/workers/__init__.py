"""The worker processes a script's DataLoaders start: a fork server that imports torch and the
script once (fork_server.py: `worker_context`, public), and workers that exit when their parent
dies (lifetime.py). `worker_context` loads on first use: the fork server's first preload is
lifetime.py alone, before torch (seconds to import), so this package imports nothing itself."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.workers.fork_server import worker_context

__all__ = ["worker_context"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("accel.workers.fork_server"), name)
    raise AttributeError(f"module 'accel.workers' has no attribute {name!r}")
