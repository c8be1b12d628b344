"""The parallel layout as one description: `ParallelDims`, data groups x tensor-parallel ranks x
pipeline stages, and the process mesh over it (pp outermost, tp innermost so that a tensor-parallel
group's ranks are neighbours). Each parallelism is a function of the model and this mesh
(accel/parallel's `apply_tp`, `apply_tp_head`, `apply_fsdp`, `cut_vit`); the reductions of a step
(the loss mean, the gradient reduce, the gradient norm) follow from its axes.

    from accel.config import MeshConfig
    from accel.parallel.mesh import ParallelDims

    dims = ParallelDims.of(MeshConfig(tp=2, pp=2), world=8)
    assert (dims.dp, dims.tp, dims.pp) == (2, 2, 2)
    assert dims.describe("processes") == "mesh dp 2 x tp 2 x pp 2 (8 processes)"
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

from accel.config import AccelError, MeshConfig, ShardMode
from accel.parallel import effective_shard


class Axis(StrEnum):
    """The mesh's axes, named once: torch's DeviceMesh, xla's SPMD mesh, jax's Mesh and
    `ParallelDims.describe` all use these names."""

    DATA = "dp"  # data replicas, each a whole model
    DATA_SHARD = "fsdp"  # data replicas that also split the weights (shard=; FSDPv2 reads it)
    TENSOR = "tp"  # tensor-parallel ranks
    PIPELINE = "pp"  # pipeline stages


@dataclass(frozen=True)
class ParallelDims:
    """dp data groups (whole replicas, or with `shard` FSDP's shards of one another), each of
    tp ranks splitting every block by tensors (and the classifier by class where `tp_head`),
    each of those a pipeline of pp stages."""

    dp: int = 1
    shard: ShardMode = "none"
    tp: int = 1
    pp: int = 1
    tp_head: bool = False

    @classmethod
    def of(cls, mesh: MeshConfig, world: int) -> ParallelDims:
        """The layout of `world` ranks (processes or devices) the config asks for; refused in one
        line where the sizes do not fit together (tp against tp_head: accel.settle)."""
        tp = max(mesh.tp, mesh.tp_head)
        if world % (tp * mesh.pp):
            named = (("tp" if mesh.tp > 1 else "tp_head", tp), ("pp", mesh.pp))
            sizes = [f"{keyword}={size}" for keyword, size in named if size > 1]
            product = f" (= {tp * mesh.pp})" if len(sizes) > 1 else ""
            raise AccelError(f"{world} ranks are not divisible by {' x '.join(sizes)}{product}")
        dp = world // (tp * mesh.pp)
        shard = cast(ShardMode, effective_shard(mesh.shard, dp))  # one of the modes given
        return cls(dp, shard, tp, mesh.pp, mesh.tp_head > 1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def data_axis(self) -> Axis:
        """The data axis's name: `fsdp` where the replicas split the weights, else `dp`."""
        return Axis.DATA_SHARD if self.shard != "none" else Axis.DATA

    @property
    def splits_model(self) -> bool:
        """Whether a rank holds only part of the model (and a checkpoint is written in parts)."""
        return self.tp > 1 or self.pp > 1 or self.shard != "none"

    def describe(self, ranks: str) -> str:
        """One line for the launcher: the mesh's axes and how many ranks it spans."""
        axes = [(self.data_axis, self.dp)]
        axes += [
            (a, size) for a, size in ((Axis.TENSOR, self.tp), (Axis.PIPELINE, self.pp)) if size > 1
        ]
        return "mesh " + " x ".join(f"{n} {s}" for n, s in axes) + f" ({self.world} {ranks})"

    def build(self, device_type: str) -> Any:
        """The torch DeviceMesh of these dims over the process group: axes pp, the data axis
        (dp or fsdp), tp."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp, self.tp)
        names = (Axis.PIPELINE, self.data_axis, Axis.TENSOR)
        return init_device_mesh(device_type, shape, mesh_dim_names=tuple(str(n) for n in names))


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the process mesh as this rank sees it."""

    name: str
    size: int  # ranks along it
    rank: int  # this rank's place along it
    group: Any  # the process group of the ranks along it with this rank
    ranks: list[int]  # their global ranks, in order
    mesh: Any  # the 1-D DeviceMesh of that group

    @classmethod
    def of(cls, mesh: Any, name: str) -> MeshAxis:
        import torch.distributed as dist

        group = mesh.get_group(name)
        ranks = dist.get_process_group_ranks(group)
        return cls(name, len(ranks), mesh.get_local_rank(name), group, ranks, mesh[name])
