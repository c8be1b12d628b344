"""torchax 0.0.13 on torch >= 2.13: the shim that lets it import (part of the jax backend).

torch 2.13 removed named tensors and their ATen overloads (`aten.prod.dim_Dimname` and about
twenty more), and later releases removed more ops (`aten.cholesky` by 2.15). torchax 0.0.13, the
newest release, names them when it is imported and when its environment starts (a cast-policy
table, its lowerings, a list of decompositions), and each lookup raises. An op this torch does not
have can never be called, so while torchax imports and starts, looking one up yields a stand-in
that names it and matches no call; everywhere else lookups behave as always.

Upstream fixed the named-tensor part in google/torchax#102 (merged 2026-08); remove this module
once a torchax release after 0.0.13 imports on the newest torch without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from accel.versions import OPS_REMOVED


class RemovedOp:
    """Stands for an op or overload this torch no longer has: hashable, never called."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, overload: str) -> RemovedOp:
        if overload.startswith("__"):
            raise AttributeError(overload)
        return RemovedOp(f"{self.name}.{overload}")

    def __repr__(self) -> str:
        return f"<removed op {self.name}>"


def _tolerant(lookup, qualified):
    def get(self, key: str):
        try:
            return lookup(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            return RemovedOp(f"{qualified(self)}.{key}")

    return get


@contextlib.contextmanager
def removed_ops() -> Iterator[None]:
    """Within the block, a missing ATen op or overload is a RemovedOp, not an AttributeError."""
    if not OPS_REMOVED:
        yield
        return
    namespace, packet = torch._ops._OpNamespace, torch._ops.OpOverloadPacket
    saved = namespace.__getattr__, packet.__getattr__
    # The classes' own lookups, patched on purpose for the block and restored after it.
    namespace.__getattr__ = _tolerant(saved[0], lambda ns: ns.name)  # type: ignore[method-assign]
    packet.__getattr__ = _tolerant(saved[1], lambda p: p._qualified_op_name)  # type: ignore[method-assign]
    try:
        yield
    finally:
        namespace.__getattr__, packet.__getattr__ = saved  # type: ignore[method-assign]


def not_an_accelerator(device_module) -> None:
    """torchax registers "jax" as torch's PrivateUse1 device, with a device module that says it
    is available. torch then takes "jax" for the process's accelerator (torch >= 2.1x), and every
    optimizer step asks it for a stream, which fails ("PyTorch is not linked with support for jax
    devices"), so no eager step could follow an import of torchax. torchax's tensors never use
    that device (they wrap JAX arrays), so its module says it is not available."""
    device_module.is_available = lambda: False
