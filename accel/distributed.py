"""Process-group context from the environment a launcher sets: torch.distributed.run (torchrun),
or Slurm's srun (one task a rank); for a backend whose processes are hosts (jax), where they
meet (`meet_as_hosts`, `hosts_joining`)."""

from __future__ import annotations

import atexit
import gc
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# Where torchrun's variables are missing, Slurm's name the same things.
SLURM = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS"}


def _rank_env(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None and os.environ.get("SLURM_NTASKS", "1") != "1":
        value = os.environ.get(SLURM[name])
    return value


# Where the hosts of one job meet when each is one process driving its own devices (jax): the
# coordinator's address, the hosts and this one's place, as jax.distributed reads them.
HOST_MEETING = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def meet_as_hosts(address: str, hosts: int, host: int) -> bool:
    """Where this process, host `host` of `hosts`, meets the others of its job (the coordinator
    at `address`, "host:port") when its backend runs one process a host (jax): what a launcher
    that starts the hosts itself says to the library, unless the user has named a meeting
    point already (then nothing changes: False).

    >>> import os
    >>> meet_as_hosts("10.0.0.1:29500", 2, 1), hosts_joining()
    (True, (2, 1))
    >>> for name in HOST_MEETING:
    ...     del os.environ[name]
    """
    if os.environ.get(HOST_MEETING[0]):
        return False
    for name, value in zip(HOST_MEETING, (address, str(hosts), str(host)), strict=True):
        os.environ[name] = value
    return True


def hosts_joining() -> tuple[int, int]:
    """(hosts, this host's place) of a job whose processes meet as hosts (`meet_as_hosts`, or
    the variables set by the user); (1, 0) alone."""
    return int(os.environ.get(HOST_MEETING[1]) or 1), int(os.environ.get(HOST_MEETING[2]) or 0)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job another launcher started (torchrun, srun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or _rank_env("LOCAL_RANK") is not None


def processes_joining() -> int:
    """The processes this job's launcher started to train together, from its variables:
    torchrun's or srun's world size, or the JAX_NUM_PROCESSES jax's hosts join by (1: alone)."""
    return max(int(_rank_env("WORLD_SIZE") or 1), hosts_joining()[0])


def process_index() -> int:
    """This process's place among those its launcher started, from their variables: torchrun's
    or srun's rank, else the JAX_PROCESS_ID jax's hosts join by (0: alone)."""
    return int(_rank_env("RANK") or hosts_joining()[1])


def env_context() -> DistContext:
    return DistContext(
        int(_rank_env("RANK") or 0),
        int(_rank_env("LOCAL_RANK") or 0),
        int(_rank_env("WORLD_SIZE") or 1),
    )


def init_process_group(ctx: DistContext, timeout_s: float = 300) -> None:
    """NCCL on CUDA, gloo on CPU; a no-op for a single process. The rank and world size are
    passed (srun sets no RANK); MASTER_ADDR and MASTER_PORT come from the environment.

    The group made here is destroyed at exit if the script has not done so itself: a user's
    script that ends without `destroy_process_group` would otherwise leave gloo's threads to the
    interpreter's teardown, which can abort the process (see `destroy_process_group`)."""
    if not ctx.distributed or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    atexit.register(destroy_process_group)  # a no-op once the group is gone


def destroy_process_group() -> None:
    """Free the process groups now, with their gloo threads joined.

    Left to the interpreter's teardown, gloo's threads can outlive Python and abort the process
    ("terminate called without an active exception"). A finished trainer lives on in reference
    cycles, and its modules (DDP's reducer, FSDP's mesh) hold the groups."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
    _release_cached_meshes()


def _release_cached_meshes() -> None:
    """DTensor's sharding caches keep every device mesh alive to the end, and in newer torch
    (2.15) a mesh holds its process groups in `_pg_registry`; torch offers no call to drop
    either."""
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:  # isinstance would run torch's custom-class checks on all
            getattr(obj, "_pg_registry", {}).clear()


def collective_device() -> torch.device:
    """Where a collective's tensors must live: the GPU under NCCL, the host under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(value: int) -> list[int]:
    """One integer from every rank, in rank order ([value] without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=collective_device())
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [int(p.item()) for p in parts]


def first_difference(mine: dict[str, Any]) -> str | None:
    """Compares a flat dict across the ranks with rank 0's: 'key (rank 0: X, rank R: Y)' for
    the first rank and key that differ, the same line on every rank (each raises, none waits on
    the others in a collective), None where all agree (a few bytes of JSON through two
    all_gathers)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    raw = json.dumps(mine, sort_keys=True, default=str).encode()
    lengths = all_gather_ints(len(raw))
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    device = collective_device()
    parts = [torch.empty_like(padded, device=device) for _ in lengths]
    dist.all_gather(parts, padded.to(device))
    ranks = [json.loads(bytes(p[:n].cpu().tolist())) for p, n in zip(parts, lengths, strict=True)]
    first = ranks[0]
    for rank, theirs in enumerate(ranks[1:], start=1):
        for key in sorted(first.keys() | theirs.keys()):
            if first.get(key) != theirs.get(key):
                return f"{key} (rank 0: {first.get(key)}, rank {rank}: {theirs.get(key)})"
    return None


def broadcast_bytes(data: bytes) -> bytes:
    """Rank 0's `data` on every rank (`data` itself without a process group): its length, then
    its bytes, through two broadcasts. torch.distributed's broadcast_object_list would do it
    by pickling, and a rank never unpickles what another process sent."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return data
    device = collective_device()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, src=0)
    return bytes(payload.cpu().tolist())
