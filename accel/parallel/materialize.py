"""Build only what a rank keeps: the model is made on the meta device, split (stages, classifier
rows, FSDP shards), and only this rank's part is allocated; its values then come from the one
whole model rank 0 initialises, each rank receiving its own part of each tensor, so they equal
the unsplit model's.

Rank 0 holds one whole copy of the model on the host while it sends the parts; every other rank
holds its part only. timm initialises a model as a whole (one random stream over all its
layers), so a part cannot be initialised alone to the same values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from accel.config import AccelError

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


MAX_DIMS = 8  # a region travels as [held, start, stop, ...] padded to this many axes


def _encode(region: Region | None, ndim: int) -> torch.Tensor:
    """A rank's region of one tensor as a fixed-size int tensor (held = 0: none of it)."""
    code = torch.zeros(1 + 2 * MAX_DIMS, dtype=torch.int64)
    if region is not None:
        code[0] = 1
        for axis, part in enumerate(region or (slice(None),) * ndim):
            code[1 + 2 * axis], code[2 + 2 * axis] = part.start or 0, part.stop or -1
    return code


def _decode(code: list[int], shape: torch.Size) -> Region | None:
    if not code[0]:
        return None
    return tuple(
        slice(code[1 + 2 * a], size if code[2 + 2 * a] < 0 else code[2 + 2 * a])
        for a, size in enumerate(shape)
    )


def _regions(parts: dict[str, torch.Tensor], name: str, meta: torch.Tensor, device) -> list:
    """Every rank's region of tensor `name`, in rank order (one small all_gather)."""
    region = local_region(parts[name])[1] if name in parts else None
    mine = _encode(region, meta.dim()).to(device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [_decode(code.tolist(), meta.shape) for code in every]


def pieces_from_rank0(
    parts: dict[str, torch.Tensor],
    whole: nn.Module,
    build: Callable[[], nn.Module],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """This rank's region of each tensor of `parts` (on the meta device: plain, or DTensor views
    of this rank's part), with the values of the model `build()` makes on rank 0: rank 0 sends
    each rank its own region of each tensor, point to point, so no other rank ever holds more
    than its part. Before this rank's part is allocated, so that rank 0 holds at most one whole
    model at a time: each whole tensor is let go once its regions are sent and its own copied.
    `whole` is the model on the meta device: every rank walks its tensors in the same order."""
    rank = dist.get_rank()
    source = dict(named_tensors(build())) if rank == 0 else {}
    pieces: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, meta in named_tensors(whole):
            regions, full = _regions(parts, name, meta, device), source.pop(name, None)
            for peer, region in enumerate(regions):
                if region is None or (rank not in (0, peer)):
                    continue
                if rank == 0:  # rank 0 built the whole model: `full` is its tensor
                    piece = cast(torch.Tensor, full)[region].to(device=device, dtype=meta.dtype)
                    if peer == 0:
                        pieces[name] = piece.clone()
                    else:
                        dist.send(piece.contiguous(), dst=peer)
                else:
                    shape = [s.stop - s.start for s in region] or list(meta.shape)
                    pieces[name] = torch.empty(shape, dtype=meta.dtype, device=device)
                    dist.recv(pieces[name], src=0)
            del full
    return pieces


def place(parts: dict[str, torch.Tensor], pieces: dict[str, torch.Tensor]) -> None:
    """Copy each piece into the allocated storage of its tensor (then let it go)."""
    with torch.no_grad():
        for name in list(pieces):
            local_region(parts[name])[0].copy_(
                pieces.pop(name).view_as(local_region(parts[name])[0])
            )


def is_meta(model: nn.Module) -> bool:
    """Whether `model` was built on the meta device (shapes only, nothing allocated)."""
    return any(t.is_meta for _, t in named_tensors(model))


def builder(init: Callable[[], nn.Module] | None) -> Callable[[], nn.Module]:
    """`init`, which a model on the meta device needs to get its starting values."""
    if init is None:
        raise AccelError(
            "the model is on the meta device: give prepare(..., init=FN), FN building it with "
            "its starting values"
        )
    return init


def whole(model: nn.Module, init: Callable[[], nn.Module] | None) -> nn.Module:
    """`model` itself, or where it is on the meta device the whole model `init` builds."""
    return builder(init)() if is_meta(model) else model


def materialize(
    model: nn.Module,
    init: Callable[[], nn.Module] | None,
    split: Callable[[nn.Module], list[nn.Module]],
    view: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> list[nn.Module]:
    """The modules this rank keeps of `model`: `split` (the parallelisms, in order) applied to
    its meta twin (a model given whole is copied to the meta device), this rank's part
    allocated on `device` in `dtype` and filled from rank 0's whole build (`init`'s, or the
    model given). `view`: this rank's tensors by the whole model's names and regions."""
    if is_meta(model):
        build = builder(init)
    else:
        given = model
        build = lambda: given  # noqa: E731
        model = copy.deepcopy(model).to("meta")
    model = model.to(dtype)
    reference = copy.deepcopy(model)  # the whole model's names and shapes
    modules = split(model)

    def parts() -> dict[str, torch.Tensor]:
        return view({n: t for m in modules for n, t in named_tensors(m)})

    # Rank 0's values first, then this rank's storage: rank 0 never holds a whole model and
    # its own part at once.
    pieces = pieces_from_rank0(parts(), reference, build, device)
    allocate(modules, device)
    place(parts(), pieces)
    return modules
