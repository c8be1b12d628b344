"""Training augmentation as timm spells it (--scale, --ratio, --hflip, --vflip, --color_jitter,
--aa, --reprob/--remode/--recount, --train_interpolation).

The CPU path uses timm's own transforms: the crop box from timm's RandomResizedCrop (drawn before
decoding, so a JPEG can decode at reduced scale: folder.py), then timm's colour jitter or
AutoAugment/RandAugment/AugMix on the crop. Random erasing runs on the device after
normalisation, as in timm's prefetcher: its rectangles are drawn here, per sample, and travel
with the batch (models/erasing.py fills them).

The device-decode path (data/device_decode.py) applies torchvision's v2 ops to each decoded
sample on the device instead of timm's PIL ones: colour jitter as torchvision's ColorJitter,
'rand-mN-...' as torchvision's RandAugment(num_ops=n, magnitude=N) (timm's magnitude noise 'mstd'
and increasing-severity 'inc' have no counterpart there), 'augmix' as AugMix, 'original' as
AutoAugment's ImageNet policy. The distributions are close, not equal.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageOps
from timm.data import auto_augment
from timm.data.transforms_factory import transforms_imagenet_train

from accel.cli.data.config import DataConfig
from accel.cli.models.erasing import BOX, MODES

INTERPOLATIONS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
# timm's policy names, then '-'-separated settings it reads (m9, mstd0.5, inc1, n2, w3, ...):
# timm itself passes over a setting it does not know without a word.
POLICY = r"(rand|augmix|original|originalr|v0|v0r|3a)(-(mstd|mmax|inc|m|n|p|w|d|a|b)[\d.]+|-t\w+)*"


class AugmentError(ValueError):
    """An augmentation setting timm does not know: one line, exit 2."""


def check_augment(cfg: DataConfig) -> None:
    """Refuse an --aa string, erasing mode or interpolation timm would not take."""
    if cfg.aa and not re.fullmatch(POLICY, cfg.aa):
        raise AugmentError(
            f"--aa '{cfg.aa}' is not one of timm's (rand-m9-mstd0.5-inc1, augmix, original)"
        )
    try:
        secondary(cfg, 32)
    except (ValueError, AssertionError, KeyError) as err:
        raise AugmentError(f"--aa '{cfg.aa}': {err}") from None


def _posterize(img: Image.Image, bits: int, **_) -> Image.Image:
    """timm's posterize, for Pillow >= 12 too: timm asks for 0 bits at full magnitude (which
    older Pillow turned black) and Pillow now refuses that."""
    if bits >= 8:
        return img
    if bits <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits)


def with_safe_posterize(stage: Callable) -> Callable:
    """`stage` (timm transforms) with each auto-augment op's posterize replaced by _posterize."""
    for transform in getattr(stage, "transforms", [stage]):
        ops = getattr(transform, "ops", None) or [
            op for sub in getattr(transform, "policy", []) for op in sub
        ]
        for op in ops:
            if op.aug_fn is auto_augment.posterize:
                op.aug_fn = _posterize
    return stage


def secondary(cfg: DataConfig, size: int) -> Callable[[Image.Image], Image.Image] | None:
    """timm's colour jitter or auto-augment stage (its 'secondary' transforms), or None."""
    jitter = cfg.color_jitter or None
    if not (jitter or cfg.aa):
        return None
    resampling = "bilinear" if cfg.train_interpolation == "random" else cfg.train_interpolation
    _, stage, _ = transforms_imagenet_train(
        size,
        hflip=0.0,
        # timm takes None (no colour jitter), though its annotation leaves None out.
        color_jitter=jitter,  # type: ignore[arg-type]
        auto_augment=cfg.aa or None,
        interpolation=resampling,  # what auto-augment's geometric ops resample with
        use_prefetcher=True,
        separate=True,
    )
    return with_safe_posterize(stage) if stage.transforms else None


def interpolation(cfg: DataConfig) -> Image.Resampling:
    """The resampling of this sample's crop ('random': either, as timm draws it)."""
    if cfg.train_interpolation == "random":
        return random.choice(list(INTERPOLATIONS.values()))
    return INTERPOLATIONS[cfg.train_interpolation]


def erase_boxes(cfg: DataConfig, height: int, width: int, seed: int) -> np.ndarray:
    """This sample's erasing rectangles as int32 [recount, BOX] (empty where none is drawn):
    timm RandomErasing's own draws (probability, count, area, aspect, position), in its order,
    from the sample's seeded `random`. Written out rather than called: timm's class fills the
    pixels itself, on the host."""
    boxes = np.zeros((cfg.recount, BOX), dtype=np.int32)
    boxes[:, 4], boxes[:, 5] = seed & 0x7FFFFFFF, MODES.index(cfg.remode)
    if random.random() > cfg.reprob:
        return boxes
    area, log_aspect = height * width, (math.log(0.3), math.log(1 / 0.3))
    count = 1 if cfg.recount == 1 else random.randint(1, cfg.recount)  # timm's max_count
    for k in range(count):
        for _ in range(10):
            target = random.uniform(0.02, 1 / 3) * area / count
            aspect = math.exp(random.uniform(*log_aspect))
            h, w = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if w < width and h < height:
                top, left = random.randint(0, height - h), random.randint(0, width - w)
                boxes[k, :4] = (top, top + h, left, left + w)
                break
    return boxes


def device_secondary(cfg: DataConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchvision v2 counterparts of `secondary` for uint8 CHW tensors on the device."""
    from torchvision.transforms import v2

    if cfg.aa.startswith("rand"):
        magnitude = re.search(r"-m(\d+)", cfg.aa)
        ops = re.search(r"-n(\d+)", cfg.aa)
        return v2.RandAugment(
            num_ops=int(ops.group(1)) if ops else 2,
            magnitude=int(magnitude.group(1)) if magnitude else 9,
        )
    if cfg.aa.startswith("augmix"):
        return v2.AugMix()
    if cfg.aa:
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    if cfg.color_jitter:
        j = cfg.color_jitter
        return v2.ColorJitter(brightness=j, contrast=j, saturation=j)
    return None
