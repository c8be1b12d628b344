"""A micro ViT whose logits turn NaN for any batch that holds an all-white image.

It gives the suite real non-finite steps, in the compiled graphs of every backend, at the steps
where the data puts a white image.
"""

from __future__ import annotations

import torch
from timm.models import register_model
from torch import nn

from accel.cli.models.micro import vit_micro, vit_micro_d4

NAME = "vit_micro_nan_on_white"
# Normalised values above this in every channel and pixel: white only (255 normalises to >= 2.25).
WHITE = 2.0


def nan_if_white(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out`, all NaN when the normalised batch `x` holds an all-white image."""
    white = (x.flatten(1).amin(1) > WHITE).any()
    return torch.where(white, torch.full_like(out, float("nan")), out)


class NanOnWhite(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.pretrained_cfg = model.pretrained_cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nan_if_white(x, self.model(x))


@register_model
def vit_micro_nan_on_white(pretrained: bool = False, **kwargs) -> NanOnWhite:
    return NanOnWhite(vit_micro(**kwargs))


class NanOnWhitePatches(nn.Module):
    """A patch embedding whose output turns NaN for a batch holding an all-white image: the
    same trigger for a model cut into pipeline stages, where only the first sees the images."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed
        self.num_patches = embed.num_patches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nan_if_white(x, self.embed(x))


PIPELINE_NAME = "vit_micro_d4_nan_on_white"


@register_model
def vit_micro_d4_nan_on_white(pretrained: bool = False, **kwargs) -> nn.Module:
    model = vit_micro_d4(**kwargs)
    model.patch_embed = NanOnWhitePatches(model.patch_embed)
    return model
