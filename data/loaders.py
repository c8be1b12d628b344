"""Train and evaluation loaders over synthetic data or ImageNet-layout folders."""

from __future__ import annotations

import copy
import multiprocessing
import os
from multiprocessing import forkserver

import torch
from torch.utils.data import DataLoader, Dataset

from data.collate import TrainCollate, eval_collate
from data.config import DataConfig
from data.device_decode import DeviceDecodedLoader, DeviceDecoder, EncodedCollate, EncodedCrop
from data.folder import ImageFolderDataset, class_names, eval_transform, train_transform
from data.lifetime import PARENT, worker_init
from data.sampling import PaddedEvalBatchSampler, SampleKey, ShardedBatchSampler, key_seed
from data.synthetic import SyntheticImages


class KeyedDataset(Dataset):
    """Looks samples up by SampleKey; augmentation randomness is seeded from the key."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: SampleKey) -> tuple:
        # fork_rng keeps the caller's torch RNG untouched when this runs in the main process.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key_seed(self.seed, key.epoch, key.index))
            if isinstance(self.dataset, ImageFolderDataset):
                image, label, skipped = self.dataset.load(key.index)
            else:
                (image, label), skipped = self.dataset[key.index], ()
        return image, label, skipped, key


def build_dataset(
    cfg: DataConfig, split: str, image_size: int, seed: int, num_classes: int
) -> Dataset:
    if cfg.is_synthetic:
        length = cfg.synthetic_length if split == "train" else max(1, cfg.synthetic_length // 4)
        return SyntheticImages(
            length,
            num_classes,
            (3, image_size, image_size),
            seed=seed + (0 if split == "train" else 1),
        )
    make = train_transform if split == "train" else eval_transform
    transform = make(image_size, draft=cfg.jpeg_draft)
    return ImageFolderDataset(cfg.source, split, transform, strict=cfg.strict)


def folder_num_classes(cfg: DataConfig) -> int | None:
    """The class folders' count, without decoding anything (None for synthetic data)."""
    return None if cfg.is_synthetic else len(class_names(cfg.source))


def worker_context() -> multiprocessing.context.BaseContext:
    """Workers start from a fork server, a fresh single-threaded process that has imported torch
    and this package: forking the training process itself, once JAX or torch_xla have started
    their threads, can deadlock the child (JAX warns so at every fork). The fork server, and
    the workers it forks, exit when their parent dies (data/lifetime.py)."""
    context = multiprocessing.get_context("forkserver")
    # The lifetime preload first: torch takes seconds to import, and the trainer may die meanwhile.
    context.set_forkserver_preload(["data.forkserver_preload", "torch", "data.loaders"])
    os.environ[PARENT] = str(os.getpid())
    # Started here, by the thread that builds the loader (the trainer's main one): the kernel
    # signals a child when the *thread* that started it ends, and a loader may first be
    # iterated by a short-lived prefetching thread.
    forkserver.ensure_running()
    return context


def _loader(
    dataset: Dataset,
    batch_sampler,
    collate,
    seed: int,
    workers: int,
    persistent: bool,
    pin_memory: bool = False,
) -> DataLoader:
    return DataLoader(
        KeyedDataset(dataset, seed),
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
        generator=torch.Generator().manual_seed(seed),
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
    sampler = ShardedBatchSampler(len(dataset), batch_size, *shard, seed)
    collate = TrainCollate(num_classes, cfg.label_smoothing, cfg.mixup, seed)
    if cfg.decode_on == "workers" or cfg.is_synthetic:
        return _loader(
            dataset, sampler, collate, seed, cfg.workers, cfg.persistent_workers, pin_memory
        )
    return _device_decoded(dataset, sampler, collate, cfg, image_size, seed)


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
    loader = _loader(dataset, sampler, encoded, seed, cfg.workers, cfg.persistent_workers)
    device = torch.device(cfg.decode_on)
    decoder = DeviceDecoder(device, image_size, collate, KeyedDataset(cpu_path, seed))
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
    return _loader(dataset, sampler, eval_collate, seed, cfg.workers, persistent=False)
