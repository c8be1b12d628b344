"""Sharded data parallel for the torch backends: PyTorch's FSDP2 (`fully_shard`), one unit per
transformer block, then the root."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from accel.amp import AmpPolicy

# Where timm keeps a model's repeated units: ViT/DeiT/BEiT `blocks`, Swin `layers` (its stages),
# ConvNeXt/MaxViT `stages`.
BLOCK_CONTAINERS = ("blocks", "layers", "stages")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP wraps one by one: those the model gives as `fsdp_units()` (a model that
    wraps another gives that one's blocks), else the children of its first block container."""
    units = getattr(model, "fsdp_units", None)
    if callable(units):
        return list(units())
    for name in BLOCK_CONTAINERS:
        container = getattr(model, name, None)
        if isinstance(container, nn.Module) and len(list(container.children())):
            return list(container.children())
    return []


def mixed_precision(amp: AmpPolicy) -> MixedPrecisionPolicy:
    """O2: the sharded fp32 parameters are the master weights; each unit is gathered in the low
    precision dtype and its gradients reduced in fp32. O0/O1/O3 gather what is stored."""
    if amp.master_weights:
        return MixedPrecisionPolicy(param_dtype=amp.dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(module: nn.Module, mode: str, amp: AmpPolicy, mesh: DeviceMesh) -> None:
    """fully_shard each transformer block of the model (`transformer_blocks`), then the root
    (the embeddings, norm and head), over the data axis `mesh` (the layout's; blocks split by
    tensors first are sharded in two dimensions). `grad_op` keeps each unit's gathered weights
    from the forward to the backward (ZeRO-2's memory for one all-gather less a step); `full`
    frees them after the forward."""
    # An explicit mesh: FSDP's default asks torch for "the" accelerator, which fails in a
    # process where torch_xla has registered itself without one.
    blocks = transformer_blocks(module)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mixed_precision(amp),
        "reshard_after_forward": mode == "full",
    }
    if not blocks:
        warnings.warn(
            "sharding: the model has no blocks to wrap one by one; sharded as one unit",
            stacklevel=2,
        )
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (a sharded norm's reduction); a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
