"""ImageNet-layout folders (`train/<class>/*`, `val/<class>/*`) with real decoding.

Unreadable files are skipped: the sample is replaced by the next readable one so batch shapes stay
fixed, and the skipped path travels with the sample so the main process can warn once per file and
count them (workers cannot share a counter cheaply).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from timm.data import RandomResizedCropAndInterpolation
from torch.utils.data import Dataset
from torchvision.datasets.folder import find_classes, make_dataset

from accel.cli.data.augment import interpolation, secondary
from accel.cli.data.config import DataConfig

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".gif")
DECODE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError)


class DatasetError(ValueError):
    """The dataset folder is missing, empty or not in ImageNet layout."""


class BadImageError(RuntimeError):
    """An image could not be decoded and --strict-data is on."""


class DecodeCrop:
    """Path in, uint8 CHW crop out: decode, crop, resize, flip and (training) timm's colour or
    auto-augment stage, on PIL in uint8.

    Written here rather than composed from timm's transforms because the crop has to be chosen
    before decoding: a JPEG is then decoded at 1/2, 1/4 or 1/8 scale (PIL's draft mode,
    libjpeg's DCT scaling) when the crop, brought to `size`, keeps at least `size` pixels a side.
    That pays for photos more than twice the crop's size; smaller ones decode at full size.
    `draft=False` always decodes at full size (the benchmark's reference). The random draws are
    timm's, in timm's order: box, resampling, flips, then its secondary transforms.
    """

    def __init__(self, size: int, draft: bool = True):
        self.size = size
        self.draft = draft

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, width, height) of the crop in full-size pixels."""
        raise NotImplementedError

    def resample(self) -> Image.Resampling:
        return Image.Resampling.BILINEAR

    def flips(self) -> tuple[bool, bool]:
        """(mirror, upside down); drawn after the box."""
        return False, False

    def finish(self, image: Image.Image) -> Image.Image:
        """What comes after crop and flips (timm's colour jitter or auto-augment)."""
        return image

    def __call__(self, path: str) -> torch.Tensor:
        with Image.open(path) as img:
            left, top, w, h = self.box(*img.size)
            resample, (mirror, upside_down) = self.resample(), self.flips()
            full_width = img.size[0]
            if self.draft and img.format == "JPEG":
                # Smallest scale that keeps the crop at least `size` pixels on each side.
                img.draft(
                    "RGB", (-(-img.size[0] * self.size // w), -(-img.size[1] * self.size // h))
                )
            img.load()  # decodes everything: truncated files fail here
            scale = img.size[0] / full_width
            crop = (left * scale, top * scale, (left + w) * scale, (top + h) * scale)
            image = img.convert("RGB").resize(
                (self.size, self.size), resample, box=crop, reducing_gap=None
            )
        if mirror:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if upside_down:
            image = image.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        image = self.finish(image)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


class RandomResizedCropDecode(DecodeCrop):
    """timm's training crop (RandomResizedCropAndInterpolation's box and resampling draws),
    flips, and its secondary stage, for training."""

    def __init__(self, size: int, cfg: DataConfig, draft: bool = True):
        super().__init__(size, draft)
        self.cfg = cfg
        self.stage = secondary(cfg, size)

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        canvas = torch.empty((1, height, width), dtype=torch.uint8)  # only its size is read
        top, left, h, w = RandomResizedCropAndInterpolation.get_params(
            canvas, self.cfg.scale, self.cfg.ratio
        )
        return left, top, w, h

    def resample(self) -> Image.Resampling:
        return interpolation(self.cfg)

    def flips(self) -> tuple[bool, bool]:
        # torchvision's RandomHorizontalFlip / RandomVerticalFlip draws, which timm uses.
        return torch.rand(1).item() < self.cfg.hflip, torch.rand(1).item() < self.cfg.vflip

    def finish(self, image: Image.Image) -> Image.Image:
        return self.stage(image) if self.stage else image


class CenterCropDecode(DecodeCrop):
    """Resize the short side to size / 0.875 and take the central square (the usual ImageNet
    evaluation), as one crop of the original."""

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        side = round(min(width, height) * 0.875)
        return (width - side) // 2, (height - side) // 2, side, side


def train_transform(size: int, cfg: DataConfig, draft: bool = True) -> RandomResizedCropDecode:
    return RandomResizedCropDecode(size, cfg, draft)


def eval_transform(size: int, draft: bool = True) -> CenterCropDecode:
    return CenterCropDecode(size, draft)


def split_dir(root: str | Path, split: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset folder not found: {root}")
    folder = root / split
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {root} has no '{split}/' subfolder (ImageNet layout)")
    return folder


def class_names(root: str | Path) -> list[str]:
    """The classes are the folders of train/: both splits number them alike, whatever folders
    val/ holds."""
    try:
        return find_classes(str(split_dir(root, "train")))[0]
    except FileNotFoundError as err:
        raise DatasetError(f"dataset folder {split_dir(root, 'train')} is empty: {err}") from None


def count_images(root: str | Path) -> int:
    """Images in the training split (files with an image extension; none decoded)."""
    classes = class_names(root)
    index = {name: i for i, name in enumerate(classes)}
    folder = split_dir(root, "train")
    return len(make_dataset(str(folder), index, IMAGE_EXTENSIONS, allow_empty=True))


class ImageFolderDataset(Dataset):
    def __init__(self, root: str | Path, split: str, transform, strict: bool = False):
        folder = split_dir(root, split)
        self.classes = class_names(root)
        class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = make_dataset(str(folder), class_to_idx, IMAGE_EXTENSIONS, allow_empty=True)
        if not self.samples:
            raise DatasetError(f"dataset folder {folder} is empty: no images in its class folders")
        found = {label for _, label in self.samples}
        empty = [name for i, name in enumerate(self.classes) if i not in found]
        if empty:  # a class kept with no images here (its index stays), said once
            warnings.warn(
                f"{folder}: {len(empty)} class folder(s) with no images, kept as classes: "
                f"{', '.join(empty)}",
                stacklevel=2,
            )
        self.num_classes = len(self.classes)
        self.transform = transform
        self.strict = strict

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[torch.Tensor, int, tuple[str, ...]]:
        """Return (uint8 CHW image, label, paths skipped to get it)."""
        skipped: list[str] = []
        for offset in range(len(self.samples)):
            path, label = self.samples[(index + offset) % len(self.samples)]
            try:
                image = self.transform(path)  # decodes: L, LA, P, RGBA, CMYK become RGB
            except DECODE_ERRORS as err:
                if self.strict:
                    raise BadImageError(f"unreadable image {path}: {err}") from None
                skipped.append(path)
                continue
            return image, label, tuple(skipped)
        raise DatasetError("no readable image in the dataset")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label, _ = self.load(index)
        return image, label
