"""Host batches onto the xla backend's device: uint8 batches staged by MpDeviceLoader (prefetched,
one graph's worth of batches an execution), on a mesh each tensor split along its first axis over
the mesh's data axis; the shapes seen are recorded for the run's summary."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch

from accel.backends.base import Batch
from accel.backends.xla.devices import XlaDevices
from accel.backends.xla.runtime import pl, xs
from accel.config import BackendConfig


def keyed_batches(batches: Iterable[Batch], shapes: set) -> Iterator[dict[str, torch.Tensor]]:
    """Host batches as MpDeviceLoader takes them (dicts: "0", "1", ... by position, every
    tensor of the tuple whatever its rank), recording their shapes."""
    for batch in batches:
        shapes.add(tuple(tuple(t.shape) for t in batch))
        yield {str(i): t for i, t in enumerate(batch)}


def unkeyed(batch: dict[str, torch.Tensor]) -> Batch:
    return tuple(batch[str(i)] for i in range(len(batch)))


class XlaBatches:
    """Batches onto the device, split over the mesh where there is one."""

    def __init__(self, cfg: BackendConfig, devices: XlaDevices):
        self.compiler, self.accum, self.devices = cfg.compiler, cfg.step.accum, devices
        self.input_shapes: set = set()  # the shapes of the host batches handed over

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Every tensor of each batch on the device; on a mesh, each split along its first
        axis over the mesh's axis (the tensors' ranks are read from the first batch)."""
        keyed = keyed_batches(batches, self.input_shapes)
        first = next(keyed, None)
        if first is None:
            return
        loader = pl.MpDeviceLoader(
            itertools.chain([first], keyed),
            self.devices.device,
            loader_prefetch_size=self.compiler.loader_prefetch,
            device_prefetch_size=self.compiler.device_prefetch,
            batches_per_execution=self.accum,
            input_sharding=self.sharding(first),
        )
        for batch in loader:
            yield unkeyed(batch)

    def sharding(self, batch: dict[str, torch.Tensor]) -> dict | None:
        devices = self.devices
        if not devices.spmd:
            return None
        return {k: xs.ShardingSpec(devices.mesh, devices.split_first(t)) for k, t in batch.items()}

    def on_device(self, batch: Batch) -> Batch:
        """A host batch on the device; on a mesh, each tensor split along its first axis over
        the mesh's axis (batches from device_batches arrive split already)."""
        if batch[0].device.type == "xla":
            return batch
        devices = self.devices
        batch = tuple(t.to(devices.device) for t in batch)
        if devices.spmd:
            for tensor in batch:
                if tensor.dim():
                    xs.mark_sharding(tensor, devices.mesh, devices.split_first(tensor))
        return batch
