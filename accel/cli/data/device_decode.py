"""JPEG decoding on the training device, for GPUs that CPU workers cannot keep fed.

Workers read each file's header and bytes and draw its crop and flip from the sample's key, as
the CPU path draws them. The main process then decodes the whole batch at once on the device
(nvImageCodec on a CUDA GPU, or torchvision's nvJPEG path: jpeg_decoders.py), crops, resizes,
flips and mixes there.
What the CPU path promises still holds: the same soft targets for the same batch, randomness keyed
per sample, unreadable files skipped and counted (or --strict-data), odd colour modes converted.
Files nvJPEG does not take (not JPEG, CMYK, ...) or would take wrongly (cut short: it fills in the
rest) are decoded by the workers on the CPU, and a file the device decoder refuses is decoded
again on the CPU path, which skips it if it is unreadable.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms.v2 import functional as tvf

from accel.cli.data.augment import device_secondary
from accel.cli.data.collate import Sample, TrainCollate, erase_batch
from accel.cli.data.config import DataConfig
from accel.cli.data.folder import DecodeCrop
from accel.cli.data.jpeg_decoders import make_decoder
from accel.cli.data.sampling import SampleKey, key_seed

# Colour modes nvJPEG decodes to RGB; other JPEGs (CMYK, YCCK) are decoded by the workers.
DEVICE_MODES = ("RGB", "L")


@dataclass
class EncodedJpeg:
    """A JPEG file's bytes and the crop to take from it once decoded."""

    # The whole file. A numpy array, not a tensor: workers pass it pickled by value; a tensor
    # per file would each take a shared-memory file descriptor on its way to the main process.
    data: np.ndarray
    box: tuple[int, int, int, int]  # left, top, width, height in full-size pixels
    bicubic: bool  # the crop's resampling (else bilinear)
    flips: tuple[bool, bool]  # mirror, upside down


class EncodedCrop:
    """Worker-side transform: path in, EncodedJpeg out, or a decoded crop from `cpu` for files the
    device decoder cannot take. Draws the box and the flip in the order `cpu` draws them, so a
    file decoded on either path gets the same crop."""

    def __init__(self, cpu: DecodeCrop):
        self.cpu = cpu
        self.size = cpu.size

    def __call__(self, path: str) -> EncodedJpeg | torch.Tensor:
        with Image.open(path) as img:  # reads the header only; not an image: raises here
            on_device = img.format == "JPEG" and img.mode in DEVICE_MODES
            size = img.size
        data = np.fromfile(path, dtype=np.uint8) if on_device else None
        if data is None or not ends_whole(data):
            return self.cpu(path)
        box = self.cpu.box(*size)
        bicubic = self.cpu.resample() == Image.Resampling.BICUBIC
        flips = self.cpu.flips()
        return EncodedJpeg(data, box, bicubic, flips)


def ends_whole(data: np.ndarray) -> bool:
    """Whether a JPEG file's bytes end with its end-of-image marker (FF D9). nvJPEG decodes a
    truncated file without an error, filling in what is missing, where the CPU path refuses it:
    a file that does not end there (cut short, or with bytes after the image) is decoded by its
    worker on the CPU path, which skips it or trains on it as it always does."""
    return data.size >= 4 and int(data[-2]) == 0xFF and int(data[-1]) == 0xD9


class EncodedCollate:
    """Batches of EncodedJpeg (or CPU crops) with labels, keys and the batch's mixup plan; the
    targets are made after decoding, since a file that fails there is replaced by another."""

    def __init__(self, collate: TrainCollate, image_size: int):
        self.collate = collate
        self.image_size = image_size

    def __call__(self, samples: list[Sample]) -> dict:
        shape = (len(samples), 3, self.image_size, self.image_size)
        return {
            "encoded": [s[0] for s in samples],
            "labels": torch.tensor([s[1] for s in samples], dtype=torch.int64),
            "keys": [s[3] for s in samples],
            "mix": self.collate.mix_plan(samples[0][3], shape),
            "skipped": [path for s in samples for path in s[2]],
            **erase_batch(samples),
        }


class DeviceDecoder:
    """Turns EncodedCollate batches into the loader's ordinary batches (uint8 images, soft
    targets), decoded on `device`. `fallback[key]` is the CPU path's sample for a key: a keyed
    dataset decoding on the CPU, which skips unreadable files or stops on them."""

    def __init__(
        self, device: torch.device, size: int, collate: TrainCollate, fallback, cfg: DataConfig
    ):
        self.device = device
        self.size = size
        self.collate = collate
        self.fallback = fallback
        self.decoder = make_decoder(device)
        self.stage = device_secondary(cfg)  # colour jitter or auto-augment, on the device

    def __call__(self, batch: dict) -> dict:
        items, labels = batch["encoded"], batch["labels"].clone()
        skipped = list(batch["skipped"])
        jpegs = [i for i, item in enumerate(items) if isinstance(item, EncodedJpeg)]
        datas = [torch.from_numpy(items[i].data) for i in jpegs]
        decoded = dict(zip(jpegs, self.decode(datas), strict=True))
        crops = []
        for i, item in enumerate(items):
            if (image := decoded.get(i)) is not None:
                crops.append(self.crop(image, item, batch["keys"][i]))
                continue
            if i in decoded:  # the device decoder refused it: the CPU path decides
                item, labels[i], more, _, _ = self.fallback[batch["keys"][i]]
                skipped.extend(more)
            crops.append(item.to(self.device))
        images = torch.stack(crops)
        plan = batch["mix"]
        if plan is not None:
            images = plan.apply(images)
        targets = self.collate.targets(labels, plan)
        extra = {"erase": batch["erase"]} if "erase" in batch else {}
        return {"images": images, "targets": targets, "skipped": skipped, **extra}

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Decoded RGB images, None for each file the decoder refused."""
        return self.decoder(datas)

    def crop(self, image: torch.Tensor, item: EncodedJpeg, key: SampleKey) -> torch.Tensor:
        """The crop, its flips, then the device's augmentation stage, drawn from the sample's
        own seed (as its worker drew the box)."""
        left, top, width, height = item.box
        mode = tvf.InterpolationMode.BICUBIC if item.bicubic else tvf.InterpolationMode.BILINEAR
        crop = tvf.resized_crop(
            image, top, left, height, width, [self.size, self.size], mode, antialias=True
        )
        mirror, upside_down = item.flips
        crop = crop.flip(-1) if mirror else crop
        crop = crop.flip(-2) if upside_down else crop
        if self.stage is None:
            return crop
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key_seed(self.fallback.seed, key.epoch, key.index, key.repeat) + 1)
            return self.stage(crop)


class DeviceDecodedLoader:
    """A training loader whose batches are decoded on the device as they are taken."""

    def __init__(self, loader: DataLoader, decoder: DeviceDecoder):
        self.loader = loader
        self.decoder = decoder
        self.batch_sampler = loader.batch_sampler

    def __iter__(self) -> Iterator[dict]:
        return map(self.decoder, self.loader)
