"""torch_xla backend: the torch model traced into lazy tensors and compiled by XLA (PJRT).

One graph per optimizer step (cut by torch_xla.sync), uint8 batches through MpDeviceLoader, XLA
autocast for AMP, and compile accounting from torch_xla's metrics.

`devices=N` trains on an N-device SPMD mesh from this one process (torch_xla's SPMD mode, as it
scales on TPU pods): MpDeviceLoader hands over each global batch split along the mesh's `dp`
axis, the weights are replicated, and the step's gradient all-reduce is the one XLA's SPMD
partitioner inserts into the step graph (the loss is the global batch's mean, so the partitioner
turns the gradient into per-device sums and an all-reduce over `dp`). `shard='full'` is
torch_xla's FSDPv2 on the same mesh (axis `fsdp`): weights and optimizer state split on their
first axis. `tp=M` makes the mesh 2-D, `dp` x `tp` (M devices along `tp`): each linear
layer of the plan (accel.parallel.tensor_parallel) has its weight, its optimizer moments and its
EMA split along `tp` (Megatron's columns and rows), batches split along `dp` only, and the
partitioner makes the collectives of both axes. On PJRT CPU the mesh's devices are
CPU_NUM_DEVICES.

Processes started one a chip by torchrun on a TPU host (torch_xla's multi-process replicas) take
the explicit path: gradients all-reduced with xm.all_reduce, scale 1/world size, before clipping
and the update. PJRT CPU's multi-process collectives do not reliably meet, so that path is not
tested here.

The parts: runtime.py (the torch_xla import, the process context, the checks before and as the
runtime starts), devices.py (the device, the mesh, collectives, RNG, syncs), layout.py (placement,
shardings, named state), batches.py (host batches onto the device), optimizer.py, step.py (the
compiled step, evaluation), compiles.py (compile accounting) and runner.py (XlaRunner, their
composition).
"""

from __future__ import annotations

from accel.backends.base import Supports
from accel.backends.xla.compiles import compile_count, fallback_ops
from accel.backends.xla.runner import XlaRunner
from accel.backends.xla.runtime import INSTALL, check_versions, context, require
from accel.config import BackendConfig
from accel.distributed import DistContext

SUPPORTS = Supports(
    shard=("none", "full"),
    gradient_hooks=("module",),
    tp=True,
    exclusive=(
        ("tp", "shard", "FSDPv2 splits every weight on its first axis over the whole mesh"),
    ),
    replicas="devices",
    one_process=("tp",),
    kernel_opt="torch_xla's syncfree AdamW (O0-O2: its kernel needs fp32 weights)",
)


def build(cfg: BackendConfig, ctx: DistContext) -> XlaRunner:
    return XlaRunner(cfg, ctx)


__all__ = [
    "INSTALL",
    "SUPPORTS",
    "XlaRunner",
    "build",
    "check_versions",
    "compile_count",
    "context",
    "fallback_ops",
    "require",
]
