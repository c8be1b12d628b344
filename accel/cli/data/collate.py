"""Collate functions that keep batches uint8 and targets soft, with Mixup/CutMix on the host.

Mixup is timm's FastCollateMixup (uint8 in, uint8 out). Two things are added around it:
- whether mixup is on is decided from the epoch carried by the samples, not from an attribute set in
  the main process, so switching it off after epoch N takes effect inside persistent workers;
- its randomness is seeded from (seed, epoch, batch), so batches reproduce exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from timm.data.mixup import FastCollateMixup, cutmix_bbox_and_lam, mixup_target

from accel.cli.data.config import MixupConfig
from accel.cli.data.sampling import SampleKey, key_seed

# image, label, files skipped to get it, its key, its erasing rectangles (None: no erasing)
Sample = tuple[torch.Tensor, int, tuple[str, ...], SampleKey, np.ndarray | None]


@contextmanager
def seeded_numpy(seed: int):
    """timm's Mixup draws from numpy's global RNG: seed it for one call and restore it after."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


@dataclass(frozen=True)
class MixPlan:
    """One batch's mixup or cutmix, drawn before the images exist (decoding on the device):
    image i is mixed with image B-1-i, as FastCollateMixup's batch mode does."""

    lam: float
    box: tuple[int, int, int, int] | None = None  # cutmix (y0, y1, x0, x1); None mixes pixels

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """Mix a uint8 NCHW batch with the arithmetic of FastCollateMixup (round, then uint8)."""
        if self.lam == 1.0:
            return images
        flipped = images.flip(0)
        if self.box is not None:
            y0, y1, x0, x1 = self.box
            mixed = images.clone()
            mixed[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
            return mixed
        mixed = images.float() * self.lam + flipped.float() * (1 - self.lam)
        return torch.round(mixed).to(torch.uint8)


def _skipped(samples: list[Sample]) -> list[str]:
    return [path for s in samples for path in s[2]]


def erase_batch(samples: list[Sample]) -> dict:
    """{'erase': int32 [B, K, 6]} where the samples carry erasing rectangles, else {}."""
    if samples[0][4] is None:
        return {}
    return {"erase": torch.from_numpy(np.stack([cast(np.ndarray, s[4]) for s in samples]))}


class TrainCollate:
    def __init__(self, num_classes: int, label_smoothing: float, mixup: MixupConfig, seed: int):
        self.num_classes = num_classes
        self.smoothing = label_smoothing
        self.mixup_cfg = mixup
        self.seed = seed
        self.mixup = None
        if mixup.enabled:
            self.mixup = FastCollateMixup(
                mixup_alpha=mixup.mixup_alpha,
                cutmix_alpha=mixup.cutmix_alpha,
                prob=mixup.prob,
                switch_prob=mixup.switch_prob,
                mode=mixup.mode,
                label_smoothing=label_smoothing,
                num_classes=num_classes,
            )

    def mixup_active(self, epoch: int) -> bool:
        off = self.mixup_cfg.off_epoch
        return self.mixup is not None and (off <= 0 or epoch < off)

    def mix_plan(self, key: SampleKey, image_shape: tuple[int, ...]) -> MixPlan | None:
        """The mixup of the batch `key` belongs to, drawn from the same seeded numpy stream, in
        the same order, as __call__ draws it: the same lam and box for the same batch."""
        if not self.mixup_active(key.epoch):
            return None
        if self.mixup_cfg.mode != "batch":
            raise ValueError(f"mixup mode {self.mixup_cfg.mode!r}: only 'batch' is drawn ahead")
        mixup = cast(FastCollateMixup, self.mixup)  # set: mixup is active
        with seeded_numpy(key_seed(self.seed, key.epoch, key.batch)):
            # timm's own parameter draw (private, but the one FastCollateMixup calls).
            lam, use_cutmix = mixup._params_per_batch()
            box = None
            if use_cutmix:
                minmax, correct = mixup.cutmix_minmax, mixup.correct_lam
                box, lam = cutmix_bbox_and_lam(
                    image_shape, lam, ratio_minmax=minmax, correct_lam=correct
                )
        edges = tuple(int(v) for v in box) if box else None
        return MixPlan(float(lam), cast("tuple[int, int, int, int] | None", edges))

    def targets(self, labels: torch.Tensor, plan: MixPlan | None) -> torch.Tensor:
        lam = 1.0 if plan is None else plan.lam
        return mixup_target(labels, self.num_classes, lam, self.smoothing).float()

    def __call__(self, samples: list[Sample]) -> dict:
        key = samples[0][3]
        if self.mixup_active(key.epoch):
            mixup = cast(FastCollateMixup, self.mixup)  # set: mixup is active
            with seeded_numpy(key_seed(self.seed, key.epoch, key.batch)):
                images, targets = mixup([(s[0].numpy(), s[1]) for s in samples])
        else:
            images = torch.stack([s[0] for s in samples])
            labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
            targets = mixup_target(labels, self.num_classes, 1.0, self.smoothing)
        batch = {"images": images, "targets": targets.float(), "skipped": _skipped(samples)}
        return {**batch, **erase_batch(samples)}


def eval_collate(samples: list[Sample]) -> dict:
    return {
        "images": torch.stack([s[0] for s in samples]),
        "labels": torch.tensor([s[1] for s in samples], dtype=torch.int64),
        "mask": torch.tensor([s[3].valid for s in samples], dtype=torch.bool),
        "skipped": _skipped(samples),
    }
