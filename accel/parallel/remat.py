"""Activation recomputation (remat=) by block: which modules are a model's blocks, and the
torch backends' recomputation of each (the jax backend recomputes the same blocks with
jax.checkpoint, accel/backends/jax/tracing.py).

- "none": every activation the backward needs is kept from the forward.
- "dots": a block keeps the outputs of its matrix multiplications (its linear layers') and
  recomputes the rest in the backward (norms, activations, attention's softmax): jax's
  `dots_with_no_batch_dims_saveable`, torch's selective checkpointing of mm/addmm.
- "full": a block keeps only its input and recomputes everything in the backward.

The blocks are the modules a model repeats: the children of the innermost ModuleList or
Sequential whose children are two or more modules of one class, each holding modules of its own
(timm's and torchvision's ViT and Swin blocks, a Hugging Face encoder's layers, a ResNet's).

    import timm
    from accel.parallel.remat import remat_blocks

    vit = timm.create_model("vit_tiny_patch16_224", depth=3)
    assert [name for name, _ in remat_blocks(vit)] == ["blocks.0", "blocks.1", "blocks.2"]
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from accel.config import REMAT_CHOICES, AccelError, RematChoice

# Ops whose outputs "dots" keeps: the matrix multiplications without a batch dimension, as jax's
# dots_with_no_batch_dims_saveable keeps them (a linear layer's; attention's batched ones are
# recomputed).
SAVED_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def remat_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks, by name, in order (see the module's docstring); refused in one line
    for a model that repeats none."""
    repeated = []
    for name, module in model.named_modules():
        children = list(module.children())
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(children) < 2:
            continue
        if len({type(c) for c in children}) == 1 and all(any(c.children()) for c in children):
            repeated.append(name)
    innermost = [n for n in repeated if not any(o.startswith(f"{n}.") for o in repeated)]
    found = [
        (f"{n}.{child}" if n else child, module)
        for n in innermost
        for child, module in model.get_submodule(n).named_children()
    ]
    if not found:
        raise AccelError(
            f"remat: {type(model).__name__} repeats no block (a ModuleList or Sequential of "
            "two or more modules of one class) whose activations could be recomputed"
        )
    return found


def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's selective checkpointing policy of "dots": keep the matmuls' outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(model: nn.Module, choice: str) -> None:
    """Each block's forward run through torch.utils.checkpoint (non-reentrant; "dots" with a
    selective policy keeping the matmuls), so that its activations are recomputed in the
    backward. Nothing changes under no_grad (evaluation) or with "none"."""
    if choice == "none":
        return
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    # "dots": torch's selective checkpointing keeps the matmuls; "full": checkpoint's defaults
    # (torch.compile traces a checkpoint given no context_fn; given its default, it refuses).
    extra: dict[str, Any] = {}
    if choice == "dots":
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    for _, block in remat_blocks(model):
        forward = block.forward

        def recomputed(*args: Any, _forward=forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **extra, **kwargs)

        # The block's own forward, replaced on the instance (its class is left as it is).
        block.forward = recomputed  # type: ignore[method-assign]


__all__ = ["REMAT_CHOICES", "RematChoice", "checkpoint_blocks", "remat_blocks"]
