"""Third-party notices raised while a backend's framework is imported or started, that say
nothing about the run (flax: TensorFlow's file API is absent; torchax: one op registered twice;
torch_xla: PJRT_DEVICE defaults to CPU), dropped where they are raised."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

NOTICES = (
    "Tensorflow library not found",
    "Duplicate op registration for aten.__and__",
    "Defaulting to PJRT_DEVICE=CPU",
)


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(notice in record.getMessage() for notice in NOTICES)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Drop NOTICES, and keep a module-level logging.warning() inside the block from
    configuring the root logger for the whole process (a NullHandler stands in meanwhile)."""
    root, drop, stand_in = logging.getLogger(), _DropNotices(), logging.NullHandler()
    root.addHandler(stand_in)
    handlers = [*root.handlers, *logging.getLogger("absl").handlers]
    for handler in handlers:
        handler.addFilter(drop)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)
        root.removeHandler(stand_in)
