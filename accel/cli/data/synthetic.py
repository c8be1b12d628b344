"""Deterministic synthetic images: each index always gives the same uint8 image and label."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """uint8 CHW images whose mean colour depends on the class, so a model can learn them.

    `seed` draws the class colours; `noise_seed` (default: `seed`) draws each image's noise and
    the label order. A validation set takes the training set's `seed` and its own `noise_seed`:
    the same class colours, so what training learns holds there, with images it never saw.
    """

    def __init__(
        self,
        length: int = 1024,
        num_classes: int = 10,
        image_size: tuple[int, int, int] = (3, 32, 32),
        seed: int = 0,
        noise_seed: int | None = None,
    ):
        if length < 1 or num_classes < 1:
            raise ValueError("synthetic dataset needs length >= 1 and num_classes >= 1")
        self.length = length
        self.num_classes = num_classes
        self.image_size = tuple(image_size)
        self.seed = seed
        self.noise_seed = seed if noise_seed is None else noise_seed
        gen = torch.Generator().manual_seed(seed)
        self.class_colour = torch.randint(0, 256, (num_classes, image_size[0], 1, 1), generator=gen)

    def __len__(self) -> int:
        return self.length

    def label(self, index: int) -> int:
        return (index * 7919 + self.noise_seed) % self.num_classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.noise_seed * 1_000_003 + index)
        label = self.label(index)
        noise = torch.randint(-64, 65, self.image_size, generator=gen)
        image = (self.class_colour[label] + noise).clamp(0, 255).to(torch.uint8)
        return image, label
