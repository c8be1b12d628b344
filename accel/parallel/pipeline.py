"""A ViT cut into pipeline stages (`pp=2`) on torch.distributed.pipelining.

The model gives its parts (`Pipelined`): the ViT it runs and the module before it. The ViT's
blocks are split into contiguous stages: that module and the patch embedding go with the first,
the final norm and the head with the last. The ranks of a `pp` group each run their stage (two
with the interleaved schedule) and the schedule streams micro-batches through them. Each stage
keeps the full model's parameter names, so checkpoints name its tensors as the unsplit model
does.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from accel.parallel.mesh import MeshAxis

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
EMBEDDINGS = ("patch_embed", "cls_token", "reg_token", "pos_embed", "norm_pre")
HEAD = ("norm", "fc_norm", "attn_pool", "head")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def check_stages(model: nn.Module, pp: int, schedule: str) -> None:
    """The model gives what a pipeline of `pp` ranks cuts, a block for each of its stages;
    ValueError naming what is missing."""
    vit: Any = pipeline_parts(model)[1]
    stages = pp * stages_per_rank(schedule)
    if stages > len(vit.blocks):
        raise ValueError(
            f"pp={pp} ({schedule}) needs {stages} stages, the model has {len(vit.blocks)} blocks"
        )


def check_micro_batch(rows: int, chunks: int) -> None:
    """A micro-step's batch of `rows` splits into `chunks` (pp_microbatches=) equal
    micro-batches, each the schedule's share of it; ValueError otherwise."""
    if rows % chunks:
        raise ValueError(
            f"a batch of {rows} does not split into pp_microbatches={chunks} equal micro-batches"
        )


def stage_blocks(depth: int, stages: int) -> list[range]:
    """Contiguous block ranges, as even as possible (earlier stages take the remainder)."""
    if stages > depth:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages} blocks, the model has {depth}"
        )
    size, extra = divmod(depth, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def is_vit(model: nn.Module) -> bool:
    """Whether the timm model can be cut by blocks (a plain ViT: no Swin-style stages)."""
    return (
        hasattr(model, "blocks") and hasattr(model, "patch_embed") and not hasattr(model, "layers")
    )


@runtime_checkable
class Pipelined(Protocol):
    """What a model gives to be cut into pipeline stages (`pp=2`): its forward must be
    `vit(stem(x))` for the two modules `pipeline_parts()` returns, both direct submodules of
    the model (so that each stage keeps the model's names):

    - `stem`: what the model does to its inputs before the ViT, without parameters (the inputs'
      normalisation, say; None for nothing), run by the first stage;
    - `vit`: a ViT with timm's VisionTransformer's parts (`patch_embed`, `_pos_embed`,
      `patch_drop`, `norm_pre`, `blocks`, `norm`, `forward_head`; `is_vit` tells), cut between
      its blocks.
    """

    def pipeline_parts(self) -> tuple[nn.Module | None, nn.Module]: ...


def pipeline_parts(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """The model's (stem, vit), checked; ValueError naming what the model must give."""
    if not isinstance(model, Pipelined):
        raise ValueError(
            f"pp= cuts a model that gives pipeline_parts() (the module before its ViT and the "
            f"ViT: accel.parallel.pipeline.Pipelined); {type(model).__name__} gives none: split "
            "it by tp= (with tp_plan) or shard="
        )
    stem, vit = model.pipeline_parts()
    if not is_vit(vit):
        raise ValueError(
            f"pp= cuts ViT-style models by blocks; {type(vit).__name__} is not one (it needs "
            "blocks and patch_embed, and no Swin-style layers)"
        )
    return stem, vit


def child_name(model: nn.Module, part: nn.Module) -> str:
    """The attribute under which `part` is a direct submodule of `model`."""
    name = next((n for n, m in model.named_children() if m is part), None)
    if name is None:
        raise ValueError(
            f"pipeline_parts() of {type(model).__name__} must give direct submodules of the model"
        )
    return name


class ViTStage(nn.Module):
    """One stage's parts of a `Pipelined` model (made on the meta device), under the whole
    model's names."""

    def __init__(self, full: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        stem, whole_vit = pipeline_parts(full)
        vit: Any = copy.deepcopy(whole_vit)  # on the meta device: nothing allocated
        vit.blocks = nn.Sequential(OrderedDict((str(i), vit.blocks[i]) for i in blocks))
        self.first, self.last = first, last
        for name in (() if first else EMBEDDINGS) + (() if last else HEAD):
            if getattr(vit, name, None) is not None:
                setattr(vit, name, None)
        self.vit_name = child_name(full, whole_vit)
        self.add_module(self.vit_name, vit)
        self.stem_name = None  # what runs before the ViT belongs to the first stage
        if first and stem is not None:
            self.stem_name = child_name(full, stem)
            self.add_module(self.stem_name, copy.deepcopy(stem))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit: Any = getattr(self, self.vit_name)
        if self.first:
            if self.stem_name is not None:
                x = getattr(self, self.stem_name)(x)
            x = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
        x = vit.blocks(x)
        if self.last:
            x = vit.forward_head(vit.norm(x))
        return x


@dataclass
class StagePlan:
    """The stages one rank runs, cut from a model (on the meta device until allocated)."""

    stages: list[ViTStage]
    ids: list[int]  # their positions in the pipeline
    count: int  # stages in the whole pipeline
    activation: tuple[int, int]  # (tokens, width) passed between stages


def cut_vit(model: nn.Module, mesh: MeshAxis, schedule: str) -> StagePlan:
    """This rank's stages of a `Pipelined` model: the pipeline's stage k runs on pp rank
    k % size (round robin, as the interleaved schedule expects)."""
    vit: Any = pipeline_parts(model)[1]
    count = mesh.size * stages_per_rank(schedule)
    ranges = stage_blocks(len(vit.blocks), count)
    ids = [mesh.rank + k * mesh.size for k in range(stages_per_rank(schedule))]
    stages = [ViTStage(model, ranges[s], first=s == 0, last=s == count - 1) for s in ids]
    activation = (vit.patch_embed.num_patches + vit.num_prefix_tokens, vit.embed_dim)
    return StagePlan(stages, ids, count, activation)


class GlooSafeStage(PipelineStage):
    """A PipelineStage that runs over gloo (see _skip_warmup_on_gloo)."""


def _skip_warmup_on_gloo(self) -> list[dist.P2POp]:
    """torch 2.9's first exchange between neighbour stages receives a float32 into the buffer
    its peer fills with an int64; gloo refuses the size mismatch. That exchange only warms up
    NCCL's communicators (the first real send does the same), so gloo skips it."""
    if dist.get_backend(self.group) == "gloo":
        return []
    return PipelineStage._get_init_p2p_neighbors_ops(self)


# Later torch releases dropped that warm-up exchange (and the method): nothing to override there.
if hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):  # hence set here, not in the class
    GlooSafeStage._get_init_p2p_neighbors_ops = _skip_warmup_on_gloo  # type: ignore[method-assign]


def schedule_stages(
    plan: StagePlan,
    mesh: MeshAxis,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The torch.distributed.pipelining schedule over this rank's (allocated) stages. The loss
    is not rescaled by the schedule: `loss_fn` makes its own mean."""
    pipes = [
        GlooSafeStage(stage, s, plan.count, device, group=mesh.group)
        for stage, s in zip(plan.stages, plan.ids, strict=True)
    ]
    kind = SCHEDULES[schedule]
    stage = pipes if kind is ScheduleInterleaved1F1B else pipes[0]
    return kind(stage, microbatches, loss_fn=loss_fn, scale_grads=False)


def forward_only(
    plan: StagePlan, mesh: MeshAxis, images: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """Evaluation through the stages in turn, activations sent point to point: the last stage's
    output on the rank that holds it, None elsewhere."""
    x, ranks, shape = None, mesh.ranks, (images.shape[0], *plan.activation)
    for s in range(plan.count):
        if s not in plan.ids:
            continue
        if s == 0:
            x = images
        else:
            x = torch.empty(shape, device=images.device)
            dist.recv(x, src=ranks[(s - 1) % mesh.size])
            x = x.to(dtype)
        x = plan.stages[plan.ids.index(s)](x)
        if s < plan.count - 1:
            dist.send(x.float().contiguous(), dst=ranks[(s + 1) % mesh.size])
    return x if plan.count - 1 in plan.ids else None
