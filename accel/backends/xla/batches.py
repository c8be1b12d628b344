"""Host batches onto the xla backend's device: uint8 batches staged by MpDeviceLoader (prefetched,
one graph's worth of batches an execution), on a mesh each tensor split along its first axis over
the mesh's data axis; the shapes seen are recorded for the run's summary."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from accel.backends.base import Batch
from accel.backends.xla.devices import XlaDevices
from accel.backends.xla.runtime import pl, xm, xs
from accel.config import CompilerConfig


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

    def __init__(self, compiler: CompilerConfig, accum: int, devices: XlaDevices):
        self.compiler, self.accum, self.devices = compiler, accum, devices
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
            yield self.split_sent_whole(unkeyed(batch))

    def sharding(self, batch: dict[str, torch.Tensor]) -> dict | None:
        """The loader's shardings, by key (MpDeviceLoader's input_sharding)."""
        if not self.devices.spmd:
            return None
        return {k: self.spec(t) for k, t in batch.items()}

    def spec(self, tensor: torch.Tensor) -> Any:
        """How a batch tensor is sent to the mesh: split along its first axis over the mesh's
        data axis (None: sent whole, without a mesh or for a 0-dim tensor). torch_xla 2.9's
        ShardingSpec cannot send a tensor of fewer axes than the mesh (a label vector on a
        data x model mesh): that one is sent whole and split once there (`on_device`)."""
        devices = self.devices
        if not devices.spmd or not tensor.dim() or tensor.dim() < len(devices.mesh.mesh_shape):
            return None
        return xs.ShardingSpec(devices.mesh, devices.split_first(tensor))

    def on_device(self, batch: Batch) -> Batch:
        """A host batch on the device, each tensor sent as the loader sends it: on a mesh,
        each device receives its part along the first axis (batches from device_batches
        arrive split already)."""
        if batch[0].device.type == "xla":
            return batch
        device = self.devices.device
        # send_cpu_data_to_device returns the list of tensors it sent (its annotation says
        # otherwise).
        sent = [xm.send_cpu_data_to_device(t.cpu(), device, self.spec(t))[0] for t in batch]  # type: ignore[index]
        return self.split_sent_whole(tuple(sent))

    def split_sent_whole(self, batch: Batch) -> Batch:
        """On a mesh, the tensors `spec` sent whole, split along their first axis now."""
        devices = self.devices
        if devices.spmd:
            for tensor in batch:
                if tensor.dim() and self.spec(tensor) is None:
                    xs.mark_sharding(tensor, devices.mesh, devices.split_first(tensor))
        return batch
