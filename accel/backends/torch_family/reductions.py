"""The reductions of a torch step over a layout's ranks, from the mesh's axes: the loss and the
evaluation sums over the data axis, the gradients averaged over it where no DDP or FSDP hook
does, and the global gradient norm over what each rank holds alone (its DTensor shards, the
classifier's rows, its stages)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from accel.backends.torch_family.named_state import local_part


def all_reduce(value: torch.Tensor, group=None, mean: bool = False) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        if mean:
            value /= dist.get_world_size(group)
    return value


def average_gradients(params: Sequence[torch.Tensor], group: Any, size: int) -> None:
    """The gradients' mean over the `size` ranks of `group`, in place."""
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    for work in [dist.all_reduce(g, group=group, async_op=True) for g in grads]:
        work.wait()
    torch._foreach_div_(grads, size)


def grad_norm(
    params: list[torch.Tensor],
    device: torch.device,
    rows: Container[int] = frozenset(),
    rows_group: Any = None,
    stages_group: Any = None,
) -> torch.Tensor:
    """The global gradient norm: each DTensor's (a shard's, a split layer's) reduced over its
    mesh, the gradients of the parameters whose ids are `rows` (a split classifier's) summed
    over `rows_group`, the rest counted once (the same on every rank that holds it), and with a
    `stages_group` the stages' summed over the pipeline."""
    shared: list[torch.Tensor] = []
    split_rows: list[torch.Tensor] = []
    by_mesh: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            # Split along every mesh axis it is not replicated on (Shard, and FSDP's strided
            # shard of a tensor-parallel weight, which is no Shard in later torch).
            split = tuple(i for i, pl in enumerate(p.grad.placements) if not pl.is_replicate())
            by_mesh.setdefault((p.grad.device_mesh, split), []).append(p.grad)
        else:
            (split_rows if id(p) in rows else shared).append(p.grad)
    square = torch.zeros((), device=device)
    for (mesh, dims), grads in by_mesh.items():
        square = square + sharded_square(grads, mesh, dims)
    if shared:
        square = square + torch.nn.utils.get_total_norm(shared) ** 2
    if split_rows:
        rows_square = torch.nn.utils.get_total_norm(split_rows) ** 2
        square = square + all_reduce(rows_square, group=rows_group)
    if stages_group is not None:
        square = all_reduce(square, group=stages_group)
    return square.sqrt()


def sharded_square(grads: list[torch.Tensor], mesh: Any, dims: tuple[int, ...]) -> torch.Tensor:
    """The squared norm of DTensor gradients split along mesh axes `dims`: the local parts'
    summed over those axes (gradients are reduced, never partial sums). Read off the local
    parts rather than through DTensor's own norm, which gathers a tensor split twice along one
    axis (FSDP over tensor-parallel rows) whole."""
    square = torch.nn.utils.get_total_norm([local_part(g) for g in grads]) ** 2
    for dim in dims:
        square = all_reduce(square, group=mesh.get_group(dim))
    return square
