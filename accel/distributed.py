"""Process-group context from the environment torch.distributed.run sets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

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


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def env_context() -> DistContext:
    return DistContext(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def init_process_group(ctx: DistContext, timeout_s: float = 300) -> None:
    """NCCL on CUDA, gloo on CPU; a no-op for a single process."""
    if not ctx.distributed or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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
