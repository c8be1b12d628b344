"""Stopping on purpose: SIGTERM / SIGINT finish the current step, save a checkpoint and exit
cleanly; a non-finite loss under --nan_policy stop saves one and exits non-zero."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType


class TrainingStopped(Exception):
    """Raised by the loop after the checkpoint of a signalled stop is on disk."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(
            f"stopped by {signal_name} at step {step}; checkpoint saved, "
            "continue with --resume auto"
        )
        self.signal_name = signal_name
        self.step = step


class NonFiniteLoss(Exception):
    """Raised by the loop under --nan_policy stop, after its checkpoint is on disk."""

    def __init__(self, step: int, saved_step: int):
        super().__init__(
            f"non-finite loss or gradients at step {step} (--nan_policy stop); its update was "
            f"not applied; checkpoint of step {saved_step} saved, continue with --resume auto "
            "(--nan_policy skip steps over such batches)"
        )
        self.step = step


class StopRequest:
    def __init__(self):
        self.signal_name = ""

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name


@contextmanager
def stop_on_signals():
    """Turn SIGTERM and SIGINT into a stop request for the duration of the block (main thread
    only: Python delivers signals there, and other threads cannot install handlers)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
