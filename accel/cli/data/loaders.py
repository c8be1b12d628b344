"""Train and evaluation loaders over synthetic data or ImageNet-layout folders."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import random
from collections.abc import Iterator, Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from accel.cli.data.augment import erase_boxes
from accel.cli.data.collate import TrainCollate, eval_collate
from accel.cli.data.config import DataConfig
from accel.cli.data.device_decode import (
    DeviceDecodedLoader,
    DeviceDecoder,
    EncodedCollate,
    EncodedCrop,
)
from accel.cli.data.folder import (
    DecodeCrop,
    ImageFolderDataset,
    class_names,
    eval_transform,
    train_transform,
)
from accel.cli.data.sampling import PaddedEvalBatchSampler, SampleKey, ShardedBatchSampler, key_seed
from accel.cli.data.synthetic import SyntheticImages
from accel.workers import worker_context as fork_server_context
from accel.workers.lifetime import worker_init


@contextlib.contextmanager
def keyed_randomness(seed: int) -> Iterator[None]:
    """torch's, Python's and numpy's generators seeded for one sample (timm's transforms draw
    from all three), and left as they were after: the main process may run this too."""
    python, legacy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(legacy)


class KeyedDataset(Dataset):
    """Looks samples up by SampleKey; augmentation randomness is seeded from the key, and
    (training with --reprob) the sample's random-erasing rectangles are drawn with it."""

    def __init__(self, dataset: Dataset, seed: int, erasing: DataConfig | None = None):
        self.dataset = dataset
        self.seed = seed
        self.erasing = erasing

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # the datasets given here have a length

    def __getitem__(self, key: SampleKey) -> tuple:
        seed = key_seed(self.seed, key.epoch, key.index, key.repeat)
        with keyed_randomness(seed):
            if isinstance(self.dataset, ImageFolderDataset):
                image, label, skipped = self.dataset.load(key.index)
            else:
                (image, label), skipped = self.dataset[key.index], ()
            erase = None
            if self.erasing is not None:
                erase = erase_boxes(self.erasing, *self.size(image), seed)
        return image, label, skipped, key, erase

    def size(self, image: Any) -> tuple[int, int]:
        """(height, width) of a sample: a tensor, or an encoded JPEG's crop."""
        if isinstance(image, torch.Tensor):
            return cast(tuple[int, int], tuple(image.shape[-2:]))
        return (cast(ImageFolderDataset, self.dataset).transform.size,) * 2


def build_dataset(
    cfg: DataConfig, split: str, image_size: int, seed: int, num_classes: int
) -> SyntheticImages | ImageFolderDataset:
    if cfg.is_synthetic:
        length = cfg.synthetic_length if split == "train" else max(1, cfg.synthetic_length // 4)
        return SyntheticImages(
            length,
            num_classes,
            (3, image_size, image_size),
            seed=seed,  # the class colours: the same in both splits
            noise_seed=seed + (0 if split == "train" else 1),  # the images: different
        )
    transform: DecodeCrop
    if split == "train":
        transform = train_transform(image_size, cfg, draft=cfg.jpeg_draft)
    else:
        transform = eval_transform(image_size, draft=cfg.jpeg_draft)
    return ImageFolderDataset(cfg.source, split, transform, strict=cfg.strict)


def folder_num_classes(cfg: DataConfig) -> int | None:
    """The class folders' count, without decoding anything (None for synthetic data)."""
    return None if cfg.is_synthetic else len(class_names(cfg.source))


def worker_context() -> multiprocessing.context.BaseContext:
    """Workers start from a fork server (accel.workers.worker_context), a fresh single-threaded
    process that has imported torch and this package: forking the training process itself, once
    JAX or torch_xla have started their threads, can deadlock the child (JAX warns so at every
    fork). The fork server, and the workers it forks, exit when their parent dies. Started
    here, by the thread that builds the loader (the trainer's main one): a loader may first be
    iterated by a short-lived prefetching thread."""
    return fork_server_context("accel.cli.data.loaders")


def _loader(
    keyed: KeyedDataset,
    batch_sampler,
    collate,
    workers: int,
    persistent: bool,
    pin_memory: bool = False,
) -> DataLoader:
    return DataLoader(
        keyed,
        batch_sampler=batch_sampler,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=persistent and workers > 0,
        multiprocessing_context=worker_context() if workers > 0 else None,
        worker_init_fn=worker_init if workers > 0 else None,
        pin_memory=pin_memory,
        # Each new iterator draws a base seed from this generator: with the global one, starting
        # an epoch (or a resumed run) would shift the model's random stream. Data randomness is
        # keyed per sample and never uses it.
        generator=torch.Generator().manual_seed(keyed.seed),
    )


def build_train_loader(
    cfg: DataConfig,
    image_size: int,
    batch_size: int,
    shard: tuple[int, int],
    seed: int,
    num_classes: int,
    pin_memory: bool = False,
) -> DataLoader | DeviceDecodedLoader:
    """Loader of fixed-size uint8 batches with soft targets, for data-parallel rank
    `shard = (rank, ranks)`; call `loader.batch_sampler.set_epoch(epoch, start_batch)` before
    each epoch. `pin_memory`: batches in page-locked memory, for asynchronous copies to a CUDA
    device. With `cfg.decode_on` a device, the batches come out decoded on that device."""
    dataset = build_dataset(cfg, "train", image_size, seed, num_classes)
    if cfg.mixup.enabled and batch_size % 2:
        raise ValueError(f"mixup/cutmix need an even per-device batch size, got {batch_size}")
    if cfg.aug_repeats > 1 and len(dataset) < shard[1]:
        raise ValueError(
            f"--aug_repeats: {len(dataset)} images cannot be spread over {shard[1]} ranks"
        )
    sampler = ShardedBatchSampler(len(dataset), batch_size, *shard, seed, repeats=cfg.aug_repeats)
    collate = TrainCollate(num_classes, cfg.label_smoothing, cfg.mixup, seed)
    erasing = cfg if cfg.reprob > 0 else None
    if cfg.decode_on == "workers" or cfg.is_synthetic:
        keyed = KeyedDataset(dataset, seed, erasing)
        return _loader(keyed, sampler, collate, cfg.workers, cfg.persistent_workers, pin_memory)
    folder = cast(ImageFolderDataset, dataset)  # synthetic data took the branch above
    return _device_decoded(folder, sampler, collate, cfg, image_size, seed)


def _device_decoded(
    dataset: ImageFolderDataset,
    sampler: ShardedBatchSampler,
    collate: TrainCollate,
    cfg: DataConfig,
    image_size: int,
    seed: int,
) -> DeviceDecodedLoader:
    cpu_path = copy.copy(dataset)  # the same files and classes, decoded on the CPU
    dataset.transform = EncodedCrop(cpu_path.transform)
    encoded = EncodedCollate(collate, image_size)
    keyed = KeyedDataset(dataset, seed, cfg if cfg.reprob > 0 else None)
    loader = _loader(keyed, sampler, encoded, cfg.workers, cfg.persistent_workers)
    fallback = KeyedDataset(cpu_path, seed)
    decoder = DeviceDecoder(torch.device(cfg.decode_on), image_size, collate, fallback, cfg)
    return DeviceDecodedLoader(loader, decoder)


def build_eval_loader(
    cfg: DataConfig,
    image_size: int,
    batch_size: int,
    shard: tuple[int, int],
    seed: int,
    num_classes: int,
) -> DataLoader:
    """Fixed-size evaluation batches with a `mask` marking the padding of the last one."""
    dataset = build_dataset(cfg, "val", image_size, seed, num_classes)
    sampler = PaddedEvalBatchSampler(len(dataset), batch_size, *shard)
    return _loader(KeyedDataset(dataset, seed), sampler, eval_collate, cfg.workers, False)
