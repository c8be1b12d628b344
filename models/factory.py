"""Model factory over timm: any timm model name plus the registered micro variants.

The returned module takes uint8 NCHW images and normalises them itself, so that backends only ever
move uint8 to the device and normalisation is part of the compiled graph.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import timm
import torch
from torch import nn

from models import micro  # noqa: F401  (registers vit_micro and swin_micro with timm)


class UnknownModelError(ValueError):
    """The model name is not known to timm."""


@dataclass
class ModelConfig:
    name: str = "vit_micro"
    num_classes: int = 10
    pool: str = "token"  # "token" (class token) or "avg" (average pooling, no class token)
    drop_path_rate: float | None = None  # stochastic depth; None keeps the model's default
    img_size: int | None = None  # input side; None keeps the model's own (ViT, Swin: any size)


class ImageClassifier(nn.Module):
    """Wraps a timm model: uint8 [0, 255] NCHW in, logits out."""

    def __init__(self, model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.model = model
        scale = torch.tensor(std).view(1, -1, 1, 1) * 255.0
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255.0, persistent=False)
        self.register_buffer("inv_scale", 1.0 / scale, persistent=False)

    @property
    def input_size(self) -> tuple[int, int, int]:
        return tuple(self.model.pretrained_cfg["input_size"])

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        return (images.to(self.mean.dtype) - self.mean) * self.inv_scale

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(self.normalise(images))


def known_models() -> list[str]:
    return timm.list_models()


def check_model_name(name: str) -> None:
    """Raise UnknownModelError with close matches when timm does not know `name`."""
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, known_models(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UnknownModelError(f"unknown model '{name}'{hint}")


def _pool_kwargs(name: str, pool: str) -> dict:
    if pool == "token":
        return {}
    if pool != "avg":
        raise ValueError(f"unknown pool '{pool}' (use token or avg)")
    if "vit" in name or "deit" in name:
        return {"global_pool": "avg", "class_token": False}
    return {"global_pool": "avg"}


def create_model(cfg: ModelConfig) -> ImageClassifier:
    """Build a randomly initialised timm model (no weight downloads) behind uint8 normalisation."""
    check_model_name(cfg.name)
    kwargs = {"num_classes": cfg.num_classes, **_pool_kwargs(cfg.name, cfg.pool)}
    if cfg.drop_path_rate is not None:
        kwargs["drop_path_rate"] = cfg.drop_path_rate
    # Swin's window attention (its relative-position bias and shift mask included) through
    # scaled_dot_product_attention, as ViT's already is: timm keeps it on plain ops by default
    # ("experimental"), which leaves every backend's fused attention kernels unused.
    timm.layers.set_fused_attn(True, experimental=True)
    if cfg.img_size is not None:
        kwargs["img_size"] = cfg.img_size
    model = timm.create_model(cfg.name, pretrained=False, **kwargs)
    if cfg.img_size is not None:  # the size the data pipeline reads off the model
        model.pretrained_cfg = {
            **model.pretrained_cfg,
            "input_size": (3, cfg.img_size, cfg.img_size),
        }
    pcfg = model.pretrained_cfg
    return ImageClassifier(model, tuple(pcfg["mean"]), tuple(pcfg["std"]))
