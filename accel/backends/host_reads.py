"""A loss that reads a value back to the host (`.item()`, `float(t)`, a Python `if` on a tensor)
cannot be one compiled step: on xla it would cut the step's graph and wait for the device, on
jax it cannot be traced at all. The public API refuses it in one line that names the user's line.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from accel.config import ConfigError

# torch.Tensor methods that hand a value to Python (each waits for the device).
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
# Frames of these folders are the libraries', not the user's.
LIBRARIES = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, contextlib))
OURS = str(Path(__file__).resolve().parents[1])


class HostRead(ConfigError):
    """The loss reads a device value on the host: one line naming where, exit 2."""


def _user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code (not torch's, jax's or accel's)."""
    for frame in reversed(frames):
        path = str(Path(frame.filename).resolve())
        if path.startswith((*LIBRARIES, OURS)) or "site-packages" in path:
            continue
        return frame
    return None


def describe(frames: list[traceback.FrameSummary]) -> str:
    frame = _user_frame(frames)
    where = f"{frame.filename}:{frame.lineno}: {frame.line}" if frame else "in the loss function"
    return (
        f"cannot read a tensor's value on the host inside the step ({where}): "
        "return tensors from the loss and read them after the step (engine.fetch)"
    )


def host_read_line(err: BaseException) -> str:
    """What a host read that failed while tracing (its traceback) says."""
    return describe(traceback.extract_tb(err.__traceback__))


@contextlib.contextmanager
def refuse_host_reads(device_type: str, backend: str) -> Iterator[None]:
    """While the block runs, a host read of a `device_type` tensor raises HostRead naming the
    caller's line. Patched on torch.Tensor for the block only: torch_xla would otherwise run
    the graph so far and wait for its value, silently."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def guard(original):
        def read(self, *args, **kwargs):
            if self.device.type == device_type:
                raise HostRead(f"the {backend} backend {describe(traceback.extract_stack())}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, guard(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
