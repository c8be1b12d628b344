"""Micro ViT and Swin variants: the real timm architectures, shrunk for CPU tests and demos."""

from __future__ import annotations

from timm.models import register_model
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer

MICRO_INPUT_SIZE = (3, 32, 32)


def _micro_cfg(**kwargs) -> dict:
    return {
        "input_size": MICRO_INPUT_SIZE,
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
        "num_classes": 10,
        **kwargs,
    }


def _model_kwargs(kwargs: dict) -> dict:
    """Drop what timm.create_model passes for pretrained loading: micro models have no weights."""
    dropped = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")
    kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
    kwargs.setdefault("num_classes", 10)
    kwargs.setdefault("img_size", 32)
    # timm's Swin defaults to stochastic depth 0.1; a two-block model has nothing to drop.
    kwargs.setdefault("drop_path_rate", 0.0)
    return kwargs


def _micro_vit(
    architecture: str, depth: int, kwargs: dict, width: int = 64, heads: int = 2
) -> VisionTransformer:
    model = VisionTransformer(
        patch_size=4,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        mlp_ratio=2.0,
        **_model_kwargs(kwargs),
    )
    model.pretrained_cfg = _micro_cfg(architecture=architecture)
    return model


@register_model
def vit_micro(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT with 4x4 patches on 32x32 images, width 64, depth 2 (about 75k parameters)."""
    return _micro_vit("vit_micro", 2, kwargs)


@register_model
def vit_micro_d4(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """vit_micro with 4 blocks: enough to cut into 4 pipeline stages."""
    return _micro_vit("vit_micro_d4", 4, kwargs)


@register_model
def vit_micro_wide(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """vit_micro at ViT-S's width (384): a classifier of many classes outweighs its body."""
    return _micro_vit("vit_micro_wide", 2, kwargs, width=384, heads=6)


@register_model
def swin_micro(pretrained: bool = False, **kwargs) -> SwinTransformer:
    """Swin with 2x2 patches, 4x4 windows on 32x32 images, two stages (about 75k parameters)."""
    kwargs = _model_kwargs(kwargs)
    kwargs.pop("class_token", None)  # Swin always pools; the option has no meaning here
    model = SwinTransformer(
        patch_size=2,
        window_size=4,
        embed_dim=32,
        depths=(1, 1),
        num_heads=(2, 4),
        mlp_ratio=2.0,
        **kwargs,
    )
    model.pretrained_cfg = _micro_cfg(architecture="swin_micro")
    return model
