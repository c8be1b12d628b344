"""Micro ViT and Swin variants: the real timm architectures, shrunk for CPU tests and demos.

Built through timm's own builder with a registered default config, as timm's models are: they
load weights as any timm model does, `pretrained_cfg_overlay=dict(file=...)` included (they ship
none of their own).
"""

from __future__ import annotations

from timm.models import build_model_with_cfg, register_model
from timm.models import swin_transformer as swin
from timm.models import vision_transformer as vit

MICRO_INPUT_SIZE = (3, 32, 32)


def _cfg() -> dict:
    return {
        "url": "",
        "input_size": MICRO_INPUT_SIZE,
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
        "num_classes": 10,
        "classifier": "head",
        "first_conv": "patch_embed.proj",
    }


# Read by timm's register_model below: the pretrained config each model is built with.
default_cfgs = {
    name: _cfg() for name in ("vit_micro", "vit_micro_d4", "vit_micro_wide", "swin_micro")
}


def _micro_vit(variant: str, pretrained: bool, depth: int, kwargs: dict, width: int = 64):
    args = dict(patch_size=4, embed_dim=width, depth=depth, num_heads=max(2, width // 64))
    kwargs = {"img_size": 32, "num_classes": 10, "mlp_ratio": 2.0, **args, **kwargs}
    return build_model_with_cfg(
        vit.VisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=vit.checkpoint_filter_fn,
        **kwargs,
    )


@register_model
def vit_micro(pretrained: bool = False, **kwargs) -> vit.VisionTransformer:
    """ViT with 4x4 patches on 32x32 images, width 64, depth 2 (about 75k parameters)."""
    return _micro_vit("vit_micro", pretrained, 2, kwargs)


@register_model
def vit_micro_d4(pretrained: bool = False, **kwargs) -> vit.VisionTransformer:
    """vit_micro with 4 blocks: enough to cut into 4 pipeline stages."""
    return _micro_vit("vit_micro_d4", pretrained, 4, kwargs)


@register_model
def vit_micro_wide(pretrained: bool = False, **kwargs) -> vit.VisionTransformer:
    """vit_micro at ViT-S's width (384): a classifier of many classes outweighs its body."""
    return _micro_vit("vit_micro_wide", pretrained, 2, kwargs, width=384)


@register_model
def swin_micro(pretrained: bool = False, **kwargs) -> swin.SwinTransformer:
    """Swin with 2x2 patches, 4x4 windows on 32x32 images, two stages (about 75k parameters)."""
    kwargs.pop("class_token", None)  # Swin always pools; the option has no meaning here
    args = dict(patch_size=2, window_size=4, embed_dim=32, depths=(1, 1), num_heads=(2, 4))
    # timm's Swin defaults to stochastic depth 0.1; a two-block model has nothing to drop.
    kwargs = {
        "img_size": 32,
        "num_classes": 10,
        "mlp_ratio": 2.0,
        "drop_path_rate": 0.0,
        **args,
        **kwargs,
    }
    return build_model_with_cfg(
        swin.SwinTransformer,
        "swin_micro",
        pretrained,
        pretrained_filter_fn=swin.checkpoint_filter_fn,
        **kwargs,
    )
