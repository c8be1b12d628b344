"""The data settings: each one declared once, here, with what the command line needs to know of it
(help, flag, range); accel's launcher builds its parser from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def option(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its command-line description (see accel/cli.py for the keys)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class MixupConfig:
    mixup_alpha: float = option(0.0, "mixup alpha (0 = off)", flag="--mixup", min=0)
    cutmix_alpha: float = option(0.0, "cutmix alpha (0 = off)", flag="--cutmix", min=0)
    prob: float = option(1.0, "probability of mixing a batch", flag="--mixup_prob", min=0, max=1)
    switch_prob: float = option(
        0.5, "with both on: probability of cutmix", flag="--mixup_switch_prob", min=0, max=1
    )
    mode: str = option("batch", "one draw per batch", cli=False)
    off_epoch: int = option(
        0, "no mixup/cutmix from this epoch on (0 = never off)", flag="--mixup_off_epoch", min=0
    )

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


@dataclass(frozen=True)
class DataConfig:
    source: str = option(
        "synthetic", "'synthetic' or an ImageNet-layout folder", flag="--data", resume="same"
    )
    synthetic_length: int = option(1024, "images in the synthetic set", min=1, resume="same")
    workers: int = option(2, "data loader workers per process", min=0)
    label_smoothing: float = option(0.1, "label smoothing", min=0, below=1)
    mixup: MixupConfig = field(default_factory=MixupConfig)
    scale: tuple[float, float] = option(
        (0.08, 1.0), "random-resized-crop area range, a fraction of the image", above=0, max=1
    )
    ratio: tuple[float, float] = option((3 / 4, 4 / 3), "random-resized-crop aspect range", above=0)
    hflip: float = option(0.5, "horizontal flip probability", min=0, max=1)
    vflip: float = option(0.0, "vertical flip probability", min=0, max=1)
    color_jitter: float = option(
        0.0, "colour jitter strength: brightness, contrast, saturation (0 = off)", min=0
    )
    aa: str = option(
        "", "auto-augment policy as timm writes it: rand-m9-mstd0.5-inc1, augmix, original"
    )
    reprob: float = option(
        0.0, "random erasing probability (on the device, after normalisation)", min=0, max=1
    )
    remode: str = option("pixel", "random erasing fill", choices=("const", "rand", "pixel"))
    recount: int = option(1, "random erasing: at most this many rectangles a sample", min=1)
    aug_repeats: int = option(
        0,
        "repeated augmentation: each image this many times an epoch (0 = off)",
        min=0,
        resume="same",
    )
    train_interpolation: str = option(
        "bilinear", "crop resampling", choices=("bilinear", "bicubic", "random")
    )
    strict: bool = option(
        False, "stop at the first unreadable image instead of skipping it", flag="--strict-data"
    )
    data_device: str = option(
        "auto",
        "where training JPEGs are decoded and cropped: gpu (in the training process, on the "
        "device) or cpu (the loader workers); auto: gpu when training from a folder on a CUDA GPU",
        choices=("auto", "cpu", "gpu"),
    )
    # Settled from data_device before training: "workers" (CPU, in the loader workers), or the
    # training process's device: "cuda", or "cpu" (the same path on the CPU, for tests).
    decode_on: str = option("workers", "resolved decode place", cli=False)
    persistent_workers: bool = option(True, "keep workers between epochs", cli=False)
    jpeg_draft: bool = option(
        True, "decode JPEGs at reduced scale where the crop allows", cli=False
    )

    @property
    def is_synthetic(self) -> bool:
        return self.source == "synthetic"
