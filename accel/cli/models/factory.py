"""Model factory over timm: any timm model name plus the registered micro variants.

The returned module takes uint8 NCHW images and normalises them itself, so that backends only ever
move uint8 to the device and normalisation is part of the compiled graph.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
from torch import nn

from accel.cli.models import micro  # noqa: F401  (registers vit_micro and swin_micro with timm)
from accel.cli.models.erasing import random_erase
from accel.cli.models.pretrained import load_pretrained


class ModelError(ValueError):
    """A model setting that cannot work: one line, exit 2."""


class UnknownModelError(ModelError):
    """The model name is not known to timm."""


def option(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its command-line description (accel/cli.py reads the keys)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ModelConfig:
    name: str = option(
        "vit_micro", "any timm model name, or vit_micro/swin_micro", flag="--model", resume="same"
    )
    num_classes: int | None = option(
        None,
        "classes (default: the class folders of --data, or 10 for synthetic data)",
        min=2,
        resume="same",
    )
    pool: str = option("token", "classifier pooling", choices=("token", "avg"), resume="same")
    drop_path_rate: float | None = option(
        None, "stochastic depth rate (default: the model's own)", flag="--drop_path", min=0, below=1
    )
    img_size: int | None = option(
        None, "input side in pixels (default: the model's own)", min=1, resume="same"
    )
    pretrained: bool = option(False, "start from timm's weights for --model, from its local cache")
    pretrained_path: str = option(
        "", "start from these weights: a timm state dict (.safetensors, .pth) or our .pt checkpoint"
    )


class Normalise(nn.Module):
    """uint8 [0, 255] NCHW images -> the float inputs a timm model takes (its mean and std)."""

    mean: torch.Tensor  # buffers, registered in __init__ (not saved: they follow from the model)
    inv_scale: torch.Tensor

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        scale = torch.tensor(std).view(1, -1, 1, 1) * 255.0
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255.0, persistent=False)
        self.register_buffer("inv_scale", 1.0 / scale, persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (images.to(self.mean.dtype) - self.mean) * self.inv_scale


class ImageClassifier(nn.Module):
    """Wraps a timm model: uint8 [0, 255] NCHW in, logits out.

    It gives the library's hooks for the layouts that split a model: `get_classifier()` (the
    split classifier, `tp_head=`, whose share of the state is also reported apart),
    `pipeline_parts()` (the pipeline's cut, `pp=`) and `fsdp_units()` (the units `shard=` wraps
    one by one)."""

    # The timm model: its own attributes (pretrained_cfg, blocks, get_classifier, ...) are not
    # nn.Module's, whose typing would give each as a tensor or a submodule.
    model: Any

    def __init__(self, model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.model = model
        self.input_norm = Normalise(mean, std)

    @property
    def input_size(self) -> tuple[int, int, int]:
        """(channels, height, width) the model takes."""
        return tuple(self.model.pretrained_cfg["input_size"])

    def get_classifier(self) -> nn.Module | None:
        """The final classifier (timm's get_classifier(): ViT's head, Swin's head.fc)."""
        get = getattr(self.model, "get_classifier", None)
        return get() if get else None

    def pipeline_parts(self) -> tuple[nn.Module, nn.Module]:
        """What a pipeline cuts (accel.parallel.pipeline.Pipelined): the normalisation, then the
        timm model."""
        return self.input_norm, self.model

    def fsdp_units(self) -> list[nn.Module]:
        """The units sharding wraps one by one: the children of the timm model's first block
        container (ViT's blocks, Swin's layers, ConvNeXt's stages)."""
        for name in ("blocks", "layers", "stages"):
            container = getattr(self.model, name, None)
            if isinstance(container, nn.Module) and len(list(container.children())):
                return list(container.children())
        return []

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward (timm's own switch)."""
        self.model.set_grad_checkpointing(enable)

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        return self.input_norm(images)

    def forward(self, images: torch.Tensor, erase: torch.Tensor | None = None) -> torch.Tensor:
        """`erase`: random-erasing rectangles, filled after normalisation (models/erasing.py)."""
        x = self.normalise(images)
        if erase is not None:
            x = random_erase(x, erase)
        return self.model(x)


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


def create_model(cfg: ModelConfig, seed: int | None = None) -> ImageClassifier:
    """A timm model behind uint8 normalisation. With `seed`, the run's starting weights: drawn
    from a torch generator seeded with it (the global one is left as it was), so every place
    that builds the model gets the same values, then --pretrained's or --pretrained_path's
    where given (models/pretrained.py; nothing is downloaded)."""
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = create_model(cfg)
        load_pretrained(wrapped.model, cfg.name, cfg.pretrained, cfg.pretrained_path)
        return wrapped
    check_model_name(cfg.name)
    kwargs = _pool_kwargs(cfg.name, cfg.pool)
    if cfg.num_classes is not None:
        kwargs["num_classes"] = cfg.num_classes
    if cfg.drop_path_rate is not None:
        kwargs["drop_path_rate"] = cfg.drop_path_rate
    if cfg.img_size is not None:
        kwargs["img_size"] = cfg.img_size
    # Any: its pretrained_cfg (and the like) are timm's attributes, not nn.Module's.
    model: Any = timm.create_model(cfg.name, pretrained=False, **kwargs)
    fused_attention(model)
    if cfg.img_size is not None:  # the size the data pipeline reads off the model
        model.pretrained_cfg = {
            **model.pretrained_cfg,
            "input_size": (3, cfg.img_size, cfg.img_size),
        }
    pcfg = model.pretrained_cfg
    return ImageClassifier(model, tuple(pcfg["mean"]), tuple(pcfg["std"]))


def fused_attention(model: nn.Module) -> None:
    """Swin's window attention (its relative-position bias and shift mask included) through
    scaled_dot_product_attention, as ViT's already is: timm keeps it on plain ops by default
    ("experimental"), which leaves every backend's fused attention kernels unused. Set on this
    model's attention modules (timm's `fused_attn` flag), not on timm's process-wide setting: a
    model the script builds itself keeps timm's default."""
    for module in model.modules():
        if isinstance(getattr(module, "fused_attn", None), bool):
            setattr(module, "fused_attn", True)  # noqa: B010  (timm's attribute, not nn.Module's)


def meta_model(cfg: ModelConfig) -> ImageClassifier:
    """The model on the meta device: its names, shapes and structure, nothing allocated."""
    with torch.device("meta"):
        return create_model(cfg)


def input_size(cfg: ModelConfig) -> tuple[int, int, int]:
    """(channels, height, width) the model takes."""
    return meta_model(cfg).input_size


def _patch_side(model: nn.Module) -> int | None:
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "patch_size", None)
    return None if size is None else int(size[0] if isinstance(size, tuple | list) else size)


def check_input_size(cfg: ModelConfig) -> None:
    """Raise ModelError for an image side the model would silently crop: not a multiple of its
    patch, or (Swin) of the patch times the merges between its stages."""
    with torch.device("meta"):
        model = create_model(cfg).model
    side, patch = cfg.img_size, _patch_side(model)
    if side is None or patch is None:
        return
    stages = len(getattr(model, "layers", ())) or 1
    multiple = patch * 2 ** (stages - 1) if hasattr(model, "layers") else patch
    if side % multiple:
        what = f"patch {patch}" + (f" and {stages - 1} merges" if multiple != patch else "")
        raise ModelError(
            f"--img_size {side} does not fit {cfg.name} ({what}): use a multiple of {multiple}"
        )
