"""Tensor parallelism of transformer blocks: which linear layers split, and how (a plan), and the
plan applied to a torch model with DTensor (`torch.distributed.tensor.parallel`).

A plan maps module names (fnmatch patterns, as `parallelize_module` takes them) to a style:

- `colwise`: the weight's rows (output features) split; the output stays split (Megatron's fc1).
- `rowwise`: the weight's columns (input features) split; the input comes split, the output is
  summed over the tensor-parallel ranks (Megatron's fc2 and attention projection).
- `colwise_gather`: as colwise, its output gathered whole; for a layer whose output the next
  operation needs whole (a fused qkv before the heads are reshaped out of it).
- `rowwise_whole`: as rowwise, taking its input whole (after a `colwise_gather`).
- `replicate`: left whole on every rank (the default for what a plan does not name).

Found by module type for timm's ViT and Swin (`Attention`, `WindowAttention`: qkv colwise_gather,
proj rowwise_whole; `Mlp`: fc1 colwise, fc2 rowwise) and torchvision's ViT and Swin (`MLP`: its
first linear colwise, its last rowwise). The attention of torchvision's models stays whole: it
hands its weights to a function instead of calling its linear layers. A fused qkv packs q, k and v
one after the other, so a head's rows are not one contiguous block of it; its output is gathered
and the heads' attention runs whole on each rank (its weights, gradients and optimizer state are
still split), where Megatron's split would need the rows of each head regrouped and the
checkpoint would no longer hold the unsplit model's tensors.

On xla and jax the plan is a sharding of each weight (`weight_splits`): the partitioner makes
the collectives, so the styles' gather/whole variants shard the same way.

    from torch import nn
    from accel.parallel.tensor_parallel import resolve_plan

    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    plan = resolve_plan(mlp, {"0": "colwise", "2": "rowwise"}, tp=2)
    assert plan == {"0": "colwise", "2": "rowwise"}
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Literal, get_args

from torch import nn

from accel.config import AccelError

TpStyle = Literal["colwise", "rowwise", "colwise_gather", "rowwise_whole", "replicate"]
TP_STYLES: tuple[str, ...] = get_args(TpStyle)
Plan = dict[str, TpStyle]


def _timm_types() -> tuple[tuple[type[nn.Module], ...], tuple[type[nn.Module], ...]]:
    """timm's attention and MLP classes (a dependency of accel; imported where plans are made)."""
    from timm.layers import Attention, Mlp
    from timm.models.swin_transformer import WindowAttention

    return (Attention, WindowAttention), (Mlp,)


def _torchvision_mlp() -> tuple[type[nn.Module], ...]:
    try:
        from torchvision.ops.misc import MLP
    except ImportError:  # torchvision is optional for the library
        return ()
    return (MLP,)


def found_plan(model: nn.Module) -> Plan:
    """The Megatron plan of the blocks of timm's and torchvision's ViT and Swin, by module type
    (empty for a model with none of them)."""
    attentions, mlps = _timm_types()
    plan: Plan = {}
    torchvision_mlp = _torchvision_mlp()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, attentions):
            plan[prefix + "qkv"] = "colwise_gather"
            plan[prefix + "proj"] = "rowwise_whole"
        elif isinstance(module, mlps):
            plan[prefix + "fc1"] = "colwise"
            plan[prefix + "fc2"] = "rowwise"
        elif isinstance(module, torchvision_mlp):
            linears = [n for n, m in module.named_children() if isinstance(m, nn.Linear)]
            if len(linears) == 2:  # hidden layer, output layer: one split pair
                plan[prefix + linears[0]] = "colwise"
                plan[prefix + linears[1]] = "rowwise"
    return plan


def resolve_plan(model: nn.Module, given: Mapping[str, str] | None, tp: int) -> Plan:
    """Every linear layer to split, by its module name: the given plan's patterns matched
    against the model's module names, or without one the plan found by module type. Refused in
    one line: an unknown style, a pattern that names no module or a module that is no linear
    layer, a split size the layer's features do not divide into, a model with nothing to split."""
    modules = dict(model.named_modules())
    plan: Plan = {}
    for pattern, style in (given if given is not None else found_plan(model)).items():
        if style not in TP_STYLES:
            raise AccelError(
                f"tp_plan['{pattern}']: '{style}' is not one of {', '.join(TP_STYLES)}"
            )
        names = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise AccelError(f"tp_plan: '{pattern}' names no module of {type(model).__name__}")
        for name in names:
            if style != "replicate":
                plan[name] = style  # type: ignore[assignment]  # checked against TP_STYLES
    for name, style in plan.items():
        layer = modules[name]
        if not isinstance(layer, nn.Linear):
            raise AccelError(
                f"tp_plan: '{name}' is a {type(layer).__name__}; tensor parallelism splits "
                "nn.Linear layers"
            )
        features = layer.out_features if style.startswith("colwise") else layer.in_features
        side = "output" if style.startswith("colwise") else "input"
        if features % tp:
            raise AccelError(
                f"tp {tp}: '{name}' has {features} {side} features, not divisible by {tp}"
            )
    if not plan:
        raise AccelError(
            f"tp: {type(model).__name__} has no block accel knows how to split (timm's or "
            "torchvision's ViT and Swin); give tp_plan={module name: 'colwise' | 'rowwise'}"
        )
    return plan


def weight_splits(model: nn.Module, plan: Plan) -> dict[str, int]:
    """The axis each parameter splits along over the tensor-parallel devices, by parameter name
    (xla's and jax's shardings): a colwise layer's weight and bias along their output axis (0),
    a rowwise layer's weight along its input axis (1), its bias whole."""
    splits: dict[str, int] = {}
    for name, style in plan.items():
        layer = model.get_submodule(name)
        prefix = f"{name}." if name else ""
        if style.startswith("colwise"):
            splits[prefix + "weight"] = 0
            if layer.bias is not None:
                splits[prefix + "bias"] = 0
        else:
            splits[prefix + "weight"] = 1
    return splits


def apply_tp(model: nn.Module, plan: Plan, mesh) -> None:
    """Split the plan's layers of `model` (on the meta device, before its part is allocated) over
    the 1-D tensor-parallel DeviceMesh `mesh`, with torch's own parallel styles."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_whole": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
