"""What runs where on the xla backend: the device this process drives, the SPMD mesh over several
devices, the collectives across processes, the device's random generator, and the syncs that cut
and wait for graphs."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import numpy as np
import torch

from accel.amp import AmpPolicy
from accel.backends.base import replica_seed
from accel.backends.xla.runtime import check_autograd, torch_xla, xm, xr, xs
from accel.config import MeshConfig
from accel.distributed import DistContext
from accel.parallel.mesh import Axis, ParallelDims


class ParamGroups:
    """The optimizer view xm.reduce_gradients reads: the model's own parameters, whose gradients
    exist before they are copied to fp32 masters (O2)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.param_groups = [{"params": params}]


class XlaDevices:
    """The device, and with devices=N (N > 1) the SPMD mesh one process drives: its `dp` axis
    (`fsdp` with shard='full') that batches split along, and with tp=M its `tp` axis of M
    devices. Processes started by torchrun (TPU hosts) each drive one device, and reduce across
    each other with explicit collectives."""

    def __init__(self, mesh: MeshConfig, ctx: DistContext):
        self.ctx = ctx
        self.device = torch_xla.device()
        check_autograd(self.device)
        # A device mesh driven by this process: one host batch a step, split along its axis.
        self.spmd = xr.is_spmd() and not ctx.distributed
        self.count = mesh.devices if self.spmd else 1
        # One layout decision for every backend (ParallelDims.of: the effective shard mode
        # among it): the global batch splits over the mesh's data axis, `dp` devices.
        self.tp = mesh.tp if self.spmd else 1
        dims = ParallelDims.of(replace(mesh, tp=self.tp), self.count)
        self.replicas, self.shard = dims.dp, dims.shard
        # Plain strings: torch_xla's mesh takes an axis name only of type str.
        self.axis, self.tensor_axis = str(dims.data_axis), str(Axis.TENSOR)
        if self.spmd:
            axes = [(self.axis, dims.dp)] + [(self.tensor_axis, dims.tp)] * (dims.tp > 1)
            names, shape = zip(*axes, strict=True)
            self.mesh = xs.Mesh(np.arange(self.count), shape, names)

    def split_first(self, tensor: torch.Tensor) -> tuple[str | None, ...]:
        """A tensor's partition spec: its first axis over the mesh's data axis."""
        return (self.axis,) + (None,) * (tensor.dim() - 1)

    def autocast(self, amp: AmpPolicy) -> contextlib.AbstractContextManager:
        if not amp.autocast:
            return contextlib.nullcontext()
        if xr.device_type() == "TPU":
            from torch_xla.amp import autocast

            return autocast(self.device, dtype=amp.dtype)
        # torch_xla.amp.autocast does nothing off TPU in 2.9; torch.autocast('xla') works.
        return torch.autocast("xla", dtype=amp.dtype)

    # --- collectives ----------------------------------------------------------------------------
    def reduce_gradients(self, params: Sequence[torch.Tensor], how: str) -> None:
        """Processes: the explicit all-reduce. A mesh (one process, global tensors): nothing
        here, the SPMD partitioner reduces the gradients inside the step graph."""
        if not self.ctx.distributed:
            return
        if how == "optimizer_step":  # what xm.optimizer_step does
            # ParamGroups stands in for the optimizer: reduce_gradients reads only param_groups.
            xm.reduce_gradients(ParamGroups(params))  # type: ignore[arg-type]
            return
        grads = [p.grad for p in params if p.grad is not None]
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / self.ctx.world_size)

    def all_reduce(self, value: torch.Tensor, mean: bool = False) -> torch.Tensor:
        if not self.ctx.distributed:
            return value
        scale = 1.0 / self.ctx.world_size if mean else 1.0
        # A tensor in, a tensor out (a list only for a list in).
        return cast(torch.Tensor, xm.all_reduce(xm.REDUCE_SUM, value, scale=scale))

    def any_rank(self, flag: bool) -> bool:
        if not self.ctx.distributed:
            return flag
        local = torch.tensor([float(flag)], device=self.device)
        value = cast(torch.Tensor, xm.all_reduce(xm.REDUCE_MAX, local))
        return bool(value.cpu().item())

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's bytes on every process: summed with the others' zeros (xm's collectives
        reduce; they have no broadcast), after the longest length is agreed."""
        if not self.ctx.distributed:
            return data
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        size = int(cast(torch.Tensor, xm.all_reduce(xm.REDUCE_MAX, length)).cpu().item())
        mine = torch.zeros(size, dtype=torch.int32)
        if self.ctx.rank == 0:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).int()
        total = cast(torch.Tensor, xm.all_reduce(xm.REDUCE_SUM, mine.to(self.device)))
        return bytes(total.cpu().to(torch.uint8).tolist())

    def gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's tensor: each writes its own row of zeros and the rows are summed
        (xm's collectives between processes reduce)."""
        if not self.ctx.distributed:
            return [tensor.cpu()]
        rows = torch.zeros((self.ctx.world_size, *tensor.shape), dtype=tensor.dtype)
        rows[self.ctx.rank] = tensor.cpu()
        total = cast(torch.Tensor, xm.all_reduce(xm.REDUCE_SUM, rows.to(self.device)))
        return list(total.cpu().unbind(0))

    # --- the random generator -------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        """The step's draws (dropout, stochastic depth): XLA's generator, seeded as every
        backend seeds the stream of a data replica (each process here is one)."""
        xm.set_rng_state(replica_seed(seed, self.ctx.rank), str(self.device))

    def rng_state(self) -> dict[str, torch.Tensor]:
        seed = xm.get_rng_state(str(self.device))  # an unsigned 64-bit seed: kept as two halves
        return {"xla": torch.tensor([seed >> 32, seed & 0xFFFFFFFF], dtype=torch.int64)}

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        if "xla" in state:
            high, low = state["xla"].tolist()
            xm.set_rng_state((high << 32) | low, str(self.device))

    # --- syncs ----------------------------------------------------------------------------------
    def sync(self) -> None:
        """Cut the lazy graph here and run it."""
        torch_xla.sync()

    def synchronize(self) -> None:
        xm.wait_device_ops()
