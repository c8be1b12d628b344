"""Sharded, resumable batch sampling.

Every sample is requested with a key (index, epoch, batch, valid). Augmentation and mixup draw
their randomness from the key, not from worker state, so a batch is the same whatever the number
of workers, after a resume, or with persistent workers that never see `set_epoch`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, cast

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler


def key_seed(*parts: int) -> int:
    """A 32-bit seed mixed from several integers (stable across processes, unlike hash())."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


class SampleKey(NamedTuple):
    index: int  # type: ignore[assignment]  # the field shadows tuple.index
    epoch: int
    batch: int
    valid: bool = True
    repeat: int = 0  # which of the image's repeats an epoch (--aug_repeats): its own draws


class ShardedBatchSampler:
    """Fixed-size training batches of this rank's shard, reshuffled per epoch, tail dropped."""

    def __init__(
        self,
        length: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        repeats: int = 0,
    ):
        if length < batch_size * world_size:
            raise ValueError(
                f"dataset of {length} samples is smaller than one global batch "
                f"({batch_size} x {world_size} ranks)"
            )
        # DistributedSampler only needs len(); it gives the per-epoch permutation and the shard.
        self.sampler: DistributedSampler[int] = DistributedSampler(
            cast(Dataset[int], range(length)),
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.batch_size = batch_size
        self.epoch = 0
        self.start_batch = 0
        self.repeats, self.length, self.seed = repeats, length, seed
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's order; `start_batch` skips batches already trained (resume)."""
        self.epoch = epoch
        self.start_batch = start_batch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def _order(self) -> list[tuple[int, int]]:
        """This rank's (index, repeat) pairs of the epoch. Repeated augmentation (timm's
        RepeatAugSampler): each image `repeats` times in a row of the shuffled order, the rows
        dealt round the ranks so a rank sees an image once and its peers its other repeats; an
        epoch still holds as many samples as the data set."""
        if self.repeats < 2:
            return [(i, 0) for i in self.sampler]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=generator).tolist()
        pairs = [(i, r) for i in order for r in range(self.repeats)]
        return pairs[self.rank :: self.world_size][: self.length // self.world_size]

    def __iter__(self) -> Iterator[list[SampleKey]]:
        pairs = self._order()
        for b in range(self.start_batch, len(self)):
            chunk = pairs[b * self.batch_size : (b + 1) * self.batch_size]
            yield [SampleKey(i, self.epoch, b, repeat=r) for i, r in chunk]


class PaddedEvalBatchSampler:
    """Every sample exactly once over all ranks, last batch padded (valid=False) to full size."""

    def __init__(self, length: int, batch_size: int, rank: int = 0, world_size: int = 1):
        self.indices = list(range(rank, length, world_size))
        self.batch_size = batch_size
        # Every rank runs the same number of batches, so collectives line up.
        per_rank = -(-length // world_size)
        self.num_batches = max(1, -(-per_rank // batch_size))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[SampleKey]]:
        filler = self.indices[0] if self.indices else 0
        for b in range(self.num_batches):
            chunk = self.indices[b * self.batch_size : (b + 1) * self.batch_size]
            keys = [SampleKey(i, 0, b) for i in chunk]
            keys += [SampleKey(filler, 0, b, valid=False)] * (self.batch_size - len(keys))
            yield keys
