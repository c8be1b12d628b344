"""ImageNet-layout folders (`train/<class>/*`, `val/<class>/*`) with real decoding.

Unreadable files are skipped: the sample is replaced by the next readable one so batch shapes stay
fixed, and the skipped path travels with the sample so the main process can warn once per file and
count them (workers cannot share a counter cheaply).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.datasets.folder import find_classes, make_dataset
from torchvision.transforms import v2

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".gif")
DECODE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError)


class DatasetError(ValueError):
    """The dataset folder is missing, empty or not in ImageNet layout."""


class BadImageError(RuntimeError):
    """An image could not be decoded and --strict-data is on."""


def train_transform(size: int) -> v2.Compose:
    return v2.Compose(
        [v2.PILToTensor(), v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    )


def eval_transform(size: int) -> v2.Compose:
    resize = round(size / 0.875)  # the usual ImageNet crop ratio
    return v2.Compose([v2.PILToTensor(), v2.Resize(resize, antialias=True), v2.CenterCrop(size)])


def split_dir(root: str | Path, split: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset folder not found: {root}")
    folder = root / split
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {root} has no '{split}/' subfolder (ImageNet layout)")
    return folder


def load_rgb(path: str) -> Image.Image:
    """Decode fully (so truncated files fail here) and convert L, LA, P, RGBA, CMYK to RGB."""
    with Image.open(path) as img:
        img.load()
        return img.convert("RGB")


class ImageFolderDataset(Dataset):
    def __init__(self, root: str | Path, split: str, transform, strict: bool = False):
        folder = split_dir(root, split)
        try:
            self.classes, class_to_idx = find_classes(str(folder))
            self.samples = make_dataset(str(folder), class_to_idx, IMAGE_EXTENSIONS)
        except FileNotFoundError as err:
            raise DatasetError(f"dataset folder {folder} is empty: {err}") from None
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
                image = load_rgb(path)
            except DECODE_ERRORS as err:
                if self.strict:
                    raise BadImageError(f"unreadable image {path}: {err}") from None
                skipped.append(path)
                continue
            return self.transform(image), label, tuple(skipped)
        raise DatasetError("no readable image in the dataset")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label, _ = self.load(index)
        return image, label
