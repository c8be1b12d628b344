"""The dp x N process mesh shared by the model-parallel modes (tp for a split classifier, pp for a
pipeline): the model-parallel dimension innermost, so its ranks are neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@dataclass(frozen=True)
class MeshLayout:
    size: int  # ranks of one model-parallel group
    dp: int  # model-parallel groups, splitting the data
    rank: int  # this rank's place in its model-parallel group
    dp_rank: int
    group: Any  # the model-parallel process group
    dp_group: Any  # the ranks holding the same part of the model
    ranks: list[int]  # global ranks of this model-parallel group, in order

    @classmethod
    def build(cls, name: str, size: int, device_type: str) -> MeshLayout:
        dp = dist.get_world_size() // size
        mesh = init_device_mesh(device_type, (dp, size), mesh_dim_names=("dp", name))
        group = mesh.get_group(name)
        return cls(
            size,
            dp,
            mesh.get_local_rank(name),
            mesh.get_local_rank("dp"),
            group,
            mesh.get_group("dp"),
            dist.get_process_group_ranks(group),
        )
