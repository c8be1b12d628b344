"""What runs where for the jax backend: torchax brought in, the processes joined into one JAX
runtime, this process's devices as a mesh, batches put on them, and the collectives and waits
across them."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accel.backends.base import Batch
from accel.backends.jax.torchax_compat import not_an_accelerator, removed_ops
from accel.backends.quiet import quiet_imports
from accel.config import AccelError, BackendConfig
from accel.distributed import HOST_MEETING, DistContext
from accel.parallel.mesh import Axis, ParallelDims

# torchax is imported when a jax engine is about to be built (require()), not with this module.
# Its import renames torch's PrivateUse1 device to "jax", which makes it torch's accelerator for
# the rest of the process (at::getAccelerator prefers a registered PrivateUse1 device; it cannot
# be unregistered), and from then on no CUDA backward runs in that process (pytorch/pytorch#161129:
# "PyTorch is not linked with support for jax devices"). So importing accel, listing the backends
# or checking a configuration leaves torch as it was; eager.require() refuses CUDA in one line
# once torchax has come in.
torchax: Any = None
interop: Any = None
ops_registry: Any = None
OperatorNotFound: type[Exception] = LookupError  # torchax's own class once it is loaded


def load_torchax() -> BaseException | None:
    """Import torchax (once) and bind its names here; the error, where its import failed."""
    global torchax, interop, ops_registry, OperatorNotFound
    if torchax is not None:
        return None
    try:
        with quiet_imports(), removed_ops():
            import torchax as module
            from torchax import interop as interop_module
            from torchax.ops import ops_registry as registry
            from torchax.tensor import OperatorNotFound as not_found
    except Exception as err:  # reported by require() as one line
        return err
    not_an_accelerator(module.device_module)
    torchax, interop, ops_registry, OperatorNotFound = module, interop_module, registry, not_found
    return None


def coordination() -> tuple[str, int, int] | None:
    """(coordinator, processes, this process) from the variables where the hosts meet
    (accel.distributed.meet_as_hosts: the command line sets them from its nodes and rendezvous
    address); None for one process."""
    found = {name: os.environ.get(name) for name in HOST_MEETING}
    if not any(found.values()):
        return None
    if not all(found.values()):
        missing = ", ".join(n for n, v in found.items() if not v)
        raise AccelError(
            f"multi-process jax needs all of {', '.join(HOST_MEETING)}: {missing} unset"
        )
    given = cast(dict[str, str], found)  # all set: checked above
    return (
        given["JAX_COORDINATOR_ADDRESS"],
        int(given["JAX_NUM_PROCESSES"]),
        int(given["JAX_PROCESS_ID"]),
    )


def join(cfg: BackendConfig) -> DistContext:
    """One process drives its local devices; several processes (hosts) join through
    jax.distributed into one mesh, and each feeds its own shard of the data."""
    joined = coordination()
    if joined and not jax.distributed.is_initialized():
        address, processes, process = joined
        # Collectives between CPU processes go through gloo (JAX has none of its own there).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                address, processes, process, initialization_timeout=cfg.mesh.rdzv_timeout
            )
        except Exception as err:  # JAX raises XlaRuntimeError / RuntimeError subclasses here
            raise AccelError(
                f"jax process {process} of {processes} could not join the coordinator at "
                f"{address} within {cfg.mesh.rdzv_timeout} s ({str(err).splitlines()[0]})"
            ) from None
        if jax.process_count() != processes:
            raise AccelError(f"{processes} jax processes asked for, {jax.process_count()} joined")
    return DistContext(jax.process_index(), 0, jax.process_count())


def from_torch(tensor: torch.Tensor) -> np.ndarray | jax.Array:
    """A batch tensor for device_put: decoded on a CUDA GPU, it crosses by DLPack, without a
    round trip through the host."""
    return jax.dlpack.from_dlpack(tensor) if tensor.is_cuda else tensor.numpy()


class DevicePrefetcher:
    """Puts host batches on the devices, sharded along the batch, `depth` batches ahead in a
    background thread: the MpDeviceLoader of this backend (JAX itself ships no data loader)."""

    _END = object()

    def __init__(self, batches: Iterable[Batch], put: Callable[[Batch], Any], depth: int):
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.thread = threading.Thread(target=self._fill, args=(batches, put), daemon=True)
        self.thread.start()

    def _fill(self, batches: Iterable[Batch], put: Callable[[Batch], Any]) -> None:
        try:
            for batch in batches:
                self.queue.put(put(batch))
        except BaseException as err:  # handed to the consumer, raised there
            self.queue.put(err)
        self.queue.put(self._END)

    def __iter__(self) -> Iterator[Any]:
        while (item := self.queue.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            yield item


class Runtime:
    """This process's devices as one mesh (its axes named by accel.parallel.mesh.Axis): 1-D,
    the data axis, for data parallelism; 2-D, data x tensor, with tensor parallelism. The data
    replicas the process feeds, its batches put on the devices split along the batch, and the
    collectives and waits across them."""

    def __init__(self, cfg: BackendConfig, ctx: DistContext):
        self.data_parallel = (ctx.rank, ctx.world_size)
        self.prefetch = cfg.compiler.device_prefetch
        devices = jax.devices() if jax.process_count() > 1 else jax.local_devices()
        if cfg.mesh.devices > jax.local_device_count():
            raise AccelError(
                f"devices={cfg.mesh.devices} exceeds the {jax.local_device_count()} local JAX "
                "devices (on CPU, XLA_FLAGS's xla_force_host_platform_device_count=N sets them)"
            )
        used = np.array(devices[: cfg.mesh.devices * jax.process_count()])
        self.dims = ParallelDims.of(cfg.mesh, used.size)
        if self.dims.tp > 1:
            # the tensor axis innermost: a tensor-parallel group's devices are neighbours.
            grid = used.reshape(self.dims.dp, self.dims.tp)
            self.mesh = Mesh(grid, (self.dims.data_axis, Axis.TENSOR))
        else:
            self.mesh = Mesh(used, (self.dims.data_axis,))
        # Data replicas this process feeds: a tensor-parallel group reads one batch.
        self.local_replicas = cfg.mesh.devices // self.dims.tp
        self.replicated = NamedSharding(self.mesh, P())
        self.data_axis = self.dims.data_axis  # the batch's axis (with shard=, the weights' too)
        self.batch_sharding = NamedSharding(self.mesh, P(self.data_axis))
        self.micro_sharding = NamedSharding(self.mesh, P(None, self.data_axis))  # [micro, batch]
        self.shard = self.dims.shard

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[tuple]:
        """The batches on the devices, as torch tensors a script reads as it would any
        (torchax's view of the arrays: `images.size(0)`, `labels.shape`)."""
        prefetched = DevicePrefetcher(batches, self.put, self.prefetch)
        return (tuple(interop.torch_view(a) for a in arrays) for arrays in prefetched)

    @staticmethod
    def on_host(batch: tuple) -> bool:
        """Whether every tensor of `batch` is a host tensor (a CPU torch tensor)."""
        return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in batch)

    def stacked(self, micro_batches: list[tuple]) -> tuple:
        """Micro-batches as one array a tensor, [micro-steps, batch, ...], split over the data
        devices along the batch: host ones stacked on the host and sent once, each device
        receiving its rows of every micro-step; batches on the devices stacked there. Micro-
        batches of different sizes (a ragged last one) stay a tuple of batches."""
        shapes = {tuple(tuple(t.shape) for t in b) for b in micro_batches}
        if len(shapes) > 1:  # a ragged group (an epoch's last micro-batch): each as it is
            return tuple(self.arrays(b) for b in micro_batches)
        if all(self.on_host(b) for b in micro_batches):
            parts = zip(*micro_batches, strict=True)
            return self.put(tuple(torch.stack(p) for p in parts), self.micro_sharding)
        arrays = [self.arrays(b) for b in micro_batches]
        return tuple(jnp.stack(parts) for parts in zip(*arrays, strict=True))

    def arrays(self, batch: tuple) -> tuple:
        """A batch as the devices' arrays: torchax's views unwrapped, host tensors put there."""
        if all(isinstance(t, torch.Tensor) and t.device.type == "jax" for t in batch):
            return tuple(interop.jax_view(t) for t in batch)
        if all(isinstance(t, jax.Array) for t in batch):
            return batch
        return self.put(tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch))

    def put(self, batch: Batch, sharding: NamedSharding | None = None) -> tuple:
        """Host tensors onto the devices, split by `sharding` (default: along their first
        axis over the data devices); each device receives its part."""
        sharding = sharding or self.batch_sharding
        arrays = tuple(from_torch(t) for t in batch)
        if jax.process_count() > 1:
            return tuple(jax.make_array_from_process_local_data(sharding, a) for a in arrays)
        return tuple(jax.device_put(a, sharding) for a in arrays)

    def any_rank(self, flag: bool) -> bool:
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))

    def gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's host tensor, in process order."""
        if jax.process_count() == 1:
            return [tensor.cpu()]
        from jax.experimental import multihost_utils

        rows = multihost_utils.process_allgather(tensor.cpu().numpy(), tiled=False)
        return [torch.from_numpy(np.array(row)) for row in rows]

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Process 0's bytes on every process: its length, then its bytes (JAX's
        broadcast_one_to_all takes arrays of one shape everywhere)."""
        if jax.process_count() == 1:
            return data
        from jax.experimental import multihost_utils

        length = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
        mine = np.zeros(length, dtype=np.uint8)
        if jax.process_index() == 0:
            mine[:] = np.frombuffer(data, dtype=np.uint8)
        return bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine)))

    def peak_memory_bytes(self) -> int | None:
        """The device allocator's high-water mark (None where the platform keeps none: CPU)."""
        stats = [
            d.memory_stats()
            for d in self.mesh.devices.flat
            if d.process_index == jax.process_index()
        ]
        peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
        return max(peaks) if peaks else None

    def details(self) -> dict[str, Any]:
        return {
            "device_kind": jax.devices()[0].device_kind,
            # Where the arrays live ('gpu', 'cpu', 'tpu'): JAX falls back to its CPU platform
            # quietly where its GPU plugin is missing.
            "platform": self.mesh.devices.flat[0].platform,
            "tp": self.dims.tp,
        }
