"""The process meshes of the model-parallel modes: data parallel times one model-parallel
dimension (tp for a split classifier, pp for a pipeline), the model-parallel one innermost so its
ranks are neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class MeshLayout:
    name: str  # the model-parallel dimension: "tp" or "pp"
    size: int  # ranks of one model-parallel group
    dp: int  # model-parallel groups, splitting the data
    rank: int  # this rank's place in its model-parallel group
    dp_rank: int
    group: Any  # the model-parallel process group
    dp_group: Any  # the ranks holding the same part of the model
    ranks: list[int]  # global ranks of this model-parallel group, in order
    mesh: DeviceMesh  # the 1-D mesh of the model-parallel group

    @classmethod
    def build(cls, name: str, size: int, device_type: str) -> MeshLayout:
        dp = dist.get_world_size() // size
        mesh = init_device_mesh(device_type, (dp, size), mesh_dim_names=("dp", name))
        group = mesh.get_group(name)
        return cls(
            name,
            size,
            dp,
            mesh.get_local_rank(name),
            mesh.get_local_rank("dp"),
            group,
            mesh.get_group("dp"),
            dist.get_process_group_ranks(group),
            mesh[name],
        )


def describe_mesh(procs: int, tp_head: int, pp: int) -> str | None:
    """The launcher's line about a model-parallel mesh (None without one)."""
    kind, size = ("tp", tp_head) if tp_head > 1 else ("pp", pp) if pp > 1 else ("", 1)
    if not kind:
        return None
    return f"mesh dp {procs // size} x {kind} {size} ({procs} processes)"
