"""What a script asks of its processes, as 🤗 Accelerate's `Accelerator` answers it: which is the
main one (before `prepare` too), waiting for every process, the main process first, a tensor
gathered from every replica for metrics (the padding of a DistributedSampler's last batch
dropped), and the first batches of a resumed epoch skipped without loading them.

    >>> import accel, torch
    >>> from torch.utils.data import DataLoader
    >>> accel.is_main_process()  # one process: the main one
    True
    >>> loader = DataLoader(torch.arange(10.0), batch_size=4)
    >>> [b.tolist() for b in accel.skip_first_batches(loader, 2)]
    [[8.0, 9.0]]
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler

from accel.backends.runner import Runner
from accel.batches import map_leaves
from accel.config import AccelError
from accel.distributed import process_index


def is_main_process() -> bool:
    """Whether this is the process that writes and prints (rank 0 of the job its launcher
    started: torchrun's, srun's or jax's variables), before `prepare` as after it
    (Accelerate's `accelerator.is_main_process`)."""
    return process_index() == 0


def is_local_main_process() -> bool:
    """Whether this is the first process on its machine (`LOCAL_RANK` 0, or alone)
    (Accelerate's `accelerator.is_local_main_process`)."""
    return int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0) == 0


def skip_first_batches(loader: DataLoader, batches: int) -> DataLoader:
    """`loader` without its first `batches` batches, which are never loaded (Accelerate's
    `skip_first_batches`): the same dataset, workers and collate function over the batch
    sampler's indices from there. A sampler drawing its order from a seed (DistributedSampler's
    `set_epoch`, a seeded generator) skips into the order the epoch would have."""
    if batches < 0:
        raise AccelError(f"skip_first_batches: batches must be >= 0, got {batches}")
    if loader.batch_sampler is None:  # batch_size=None: each sample is a batch
        raise AccelError("skip_first_batches needs a DataLoader that makes batches (batch_size)")
    rest = list(itertools.islice(iter(loader.batch_sampler), batches, None))
    return DataLoader(
        loader.dataset,
        batch_sampler=rest,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
    )


class HasProcesses(Protocol):
    runner: Runner

    @property
    def is_main(self) -> bool: ...

    @property
    def data_ranks(self) -> int: ...


class ProcessCalls:
    """The Engine's calls on its processes, Accelerate's by their names."""

    def print(self: HasProcesses, *args: Any, **kwargs: Any) -> None:
        """print(), on the main process only (Accelerate's `accelerator.print`)."""
        if self.is_main:
            print(*args, **kwargs)

    def wait_for_everyone(self: HasProcesses) -> None:
        """Returns once every process has called it (Accelerate's `wait_for_everyone`)."""
        self.runner.any_rank(False)

    @contextlib.contextmanager
    def main_process_first(self: HasProcesses) -> Iterator[None]:
        """The block runs on the main process, then on the others (a dataset prepared and
        cached once, then read): Accelerate's `main_process_first`."""
        if not self.is_main:
            self.runner.any_rank(False)
        try:
            yield
        finally:
            if self.is_main:
                self.runner.any_rank(False)

    def gather_for_metrics(self: HasProcesses, values: Any, loader: Any = None) -> Any:
        """`values` (a tensor of a batch's rows, or a tuple, list or dict of them: predictions
        and labels) from every data replica, in the order of the dataset as `loader`'s
        DistributedSampler dealt it, on each tensor's device. With `loader`, the rows its
        sampler repeated to even out the replicas are dropped (Accelerate's
        `gather_for_metrics`): call it once for each batch of the epoch, in order. One
        process: `values` themselves. A collective: every process calls it."""
        epoch = _PaddingDrop.of(self, loader)
        rows = None

        def gathered(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal rows
            parts = self.runner.gather_host(tensor.detach())
            if len(parts) > self.data_ranks:
                raise AccelError(
                    "gather_for_metrics gathers over data replicas: with tensor or pipeline "
                    "parallel ranks, sum your metrics with engine.evaluate instead"
                )
            rows = len(parts) * len(tensor)
            # Row i of replica r is the sampler's position i*replicas + r: interleaved, the
            # rows come in the sampler's order.
            whole = torch.stack(parts, dim=1).flatten(0, 1).to(tensor.device)
            return whole[: epoch.kept(rows)]

        out = _each_tensor(values, gathered)
        epoch.advance(rows or 0)
        return out


def _each_tensor(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    def tensor_only(leaf: Any) -> torch.Tensor:
        if not isinstance(leaf, torch.Tensor):
            raise AccelError(
                f"gather_for_metrics takes tensors (in tuples, lists, dicts), got {leaf!r}"
            )
        return fn(leaf)

    return map_leaves(value, tensor_only, lambda v: not isinstance(v, dict | list | tuple))


class _PaddingDrop:
    """Where an epoch of `loader` is: the rows gathered so far, and how many the dataset holds
    (a DistributedSampler pads it to a multiple of the replicas)."""

    def __init__(self, total: int, dealt: int) -> None:
        self.total, self.dealt, self.seen = total, dealt, 0

    @staticmethod
    def of(owner: object, loader: Any) -> _PaddingDrop:
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, DistributedSampler):
            return _PaddingDrop(-1, 0)  # no padding to drop
        # The engine's epochs by loader, kept on it from the first call.
        epochs = vars(owner).setdefault("gathered_epochs", {})
        # total_size: what the sampler deals in all, padded (or cut, drop_last) to the replicas
        dataset = min(len(sampler.dataset), sampler.total_size)  # type: ignore[arg-type]
        return epochs.setdefault(id(loader), _PaddingDrop(dataset, sampler.total_size))

    def kept(self, rows: int) -> int:
        """Of this batch's `rows` (every replica's), how many the dataset holds."""
        return rows if self.total < 0 else max(0, min(rows, self.total - self.seen))

    def advance(self, rows: int) -> None:
        if self.total < 0:
            return
        self.seen += rows
        if self.seen >= self.dealt:  # the epoch's last batch: the next call starts a new one
            self.seen = 0
