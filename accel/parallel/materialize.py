"""Build only what a rank keeps: the model is made on the meta device, split (stages, classifier
rows, FSDP shards), and only this rank's part is allocated; its values then come from the one
whole model rank 0 initialises, a tensor at a time, so they equal the unsplit model's.

Rank 0 holds one whole copy of the model on the host while it is broadcast; every other rank
holds its part plus one tensor in flight. timm initialises a model as a whole (one random stream
over all its layers), so a part cannot be initialised alone to the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Region = tuple[slice, ...]


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """This rank's storage of `tensor` and the part of the whole tensor it holds."""
    if not isinstance(tensor, DTensor):
        return tensor, ()
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    region = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return tensor.to_local(), region


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and every buffer (non-persistent ones too: they are not in a state dict)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def allocate(modules: list[nn.Module], device: torch.device) -> None:
    """Give modules built on the meta device storage on `device`, zeroed: what no rank-0 value
    fills (the padding rows of a split classifier) must not hold whatever memory held."""
    for module in modules:
        module.to_empty(device=device)
        with torch.no_grad():
            for _, tensor in named_tensors(module):
                local_region(tensor)[0].zero_()


def fill_from_rank0(
    parts: dict[str, torch.Tensor],
    whole: nn.Module,
    build: Callable[[], nn.Module],
    device: torch.device,
) -> None:
    """Give the allocated tensors of `parts` (plain, or DTensor views of this rank's part) the
    values of the model `build()` makes on rank 0. `whole` is the model on the meta device:
    every rank walks its tensors in the same order."""
    source = dict(named_tensors(build())) if dist.get_rank() == 0 else {}
    with torch.no_grad():
        for name, meta in named_tensors(whole):
            buffer = source.pop(name, None)
            if buffer is None:
                buffer = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            buffer = buffer.to(device=device, dtype=meta.dtype)
            dist.broadcast(buffer, src=0)
            if name in parts:
                storage, region = local_region(parts[name])
                storage.copy_(buffer[region])
