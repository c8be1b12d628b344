"""A loss that reads a value back to the host (`.item()`, `float(t)`, a Python `if` on a tensor)
cannot be one compiled step: on xla it would cut the step's graph and wait for the device, on
jax it cannot be traced at all. The public API refuses it in one line that names the user's line.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from pathlib import Path
from typing import cast

import torch
from torch.overrides import TorchFunctionMode

from accel.config import AccelError

# torch.Tensor methods that hand a value to Python (each waits for the device).
HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}
# Frames of these folders are the libraries', not the user's.
LIBRARIES = tuple(str(Path(cast(str, m.__file__)).resolve().parent) for m in (torch, contextlib))
OURS = str(Path(__file__).resolve().parents[1])


class HostRead(AccelError):
    """The loss reads a device value on the host: one line naming where, exit 2."""


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code (not torch's, jax's or accel's)."""
    for frame in reversed(frames):
        path = str(Path(frame.filename).resolve())
        if path.startswith((*LIBRARIES, OURS)) or "site-packages" in path:
            continue
        return frame
    return None


# A compiler's error that quotes the code it traced ("from user code:", torch.compile's): the
# frames it lists, and the error it got while running an op on its fake tensors.
QUOTED_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)\n\s*(?P<code>.*)'
)
QUOTED_ERROR = re.compile(r"got (?P<kind>\w+)\((?P<quote>['\"])(?P<message>.*?)(?P=quote)?\)?$")


def quoted_frames(message: str) -> list[traceback.FrameSummary]:
    """The frames of the traced code an error message quotes, outermost first."""
    return [
        traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=m["code"])
        for m in QUOTED_FRAME.finditer(message)
    ]


def quoted_error(line: str) -> tuple[str, str] | None:
    """(kind, message) of the error a compiler's message says an op got, where it says one."""
    found = QUOTED_ERROR.search(line)
    return (found["kind"], found["message"]) if found else None


def describe(frames: list[traceback.FrameSummary]) -> str:
    frame = user_frame(frames)
    where = f"{frame.filename}:{frame.lineno}: {frame.line}" if frame else "in the loss function"
    return (
        f"cannot read a tensor's value on the host inside the step ({where}): "
        "return tensors from the loss and read them after the step (engine.fetch)"
    )


def host_read_line(err: BaseException) -> str:
    """What a host read that failed while tracing (its traceback) says."""
    return describe(traceback.extract_tb(err.__traceback__))


class RefuseHostReads(TorchFunctionMode):
    """While active, a host read of a `device_type` tensor raises HostRead naming the caller's
    line: torch_xla would otherwise run the graph so far and wait for its value, silently."""

    def __init__(self, device_type: str, backend: str):
        super().__init__()
        self.device_type, self.backend = device_type, backend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        device = getattr(args[0], "device", None) if args else None
        if name in HOST_READS and device is not None and device.type == self.device_type:
            where = describe(traceback.extract_stack())
            raise HostRead(f"the {self.backend} backend {where}")
        return func(*args, **(kwargs or {}))
