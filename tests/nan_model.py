"""A micro ViT whose logits turn NaN for any batch that holds an all-white image.

It gives the suite real non-finite steps, in the compiled graphs of every backend, at the steps
where the data puts a white image.
"""

from __future__ import annotations

import torch
from timm.models import register_model
from torch import nn

from models.micro import vit_micro

NAME = "vit_micro_nan_on_white"
# Normalised values above this in every channel and pixel: white only (255 normalises to >= 2.25).
WHITE = 2.0


class NanOnWhite(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.pretrained_cfg = model.pretrained_cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        white = (x.flatten(1).amin(1) > WHITE).any()
        return torch.where(white, torch.full_like(logits, float("nan")), logits)


@register_model
def vit_micro_nan_on_white(pretrained: bool = False, **kwargs) -> NanOnWhite:
    return NanOnWhite(vit_micro(**kwargs))
