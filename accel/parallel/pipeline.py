"""Pipeline-parallel ViT (--pp N) on torch.distributed.pipelining.

A timm ViT is cut by blocks into stages (the patch embedding with the first, the final norm and
head with the last); the ranks of a `pp` group each run their stage (two with the interleaved
schedule) and the schedule streams micro-batches through them. Ranks form a dp x pp mesh (pp
innermost); the gradients of each stage are averaged over its dp group. Stages keep the full
model's parameter names, so their states merge into the ordinary checkpoint format.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from accel.backends.eager import EagerBackend, eval_sums, soft_target_loss, to_cpu
from accel.config import RunConfig
from accel.distributed import DistContext
from accel.optim import weight_decay_groups
from accel.parallel.layout import MeshLayout
from models.factory import ImageClassifier

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
PREFIX = "classifier."  # a stage's parameter names are the full model's behind this


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


class ViTStage(nn.Module):
    """A copy of the ImageClassifier holding only one stage's parts."""

    def __init__(self, full: ImageClassifier, blocks: range, first: bool, last: bool):
        super().__init__()
        self.classifier = copy.deepcopy(full)
        self.first, self.last = first, last
        vit = self.classifier.model
        vit.blocks = nn.Sequential(OrderedDict((str(i), vit.blocks[i]) for i in blocks))
        if not first:  # the embeddings belong to the first stage
            for name in ("patch_embed", "cls_token", "reg_token", "pos_embed", "norm_pre"):
                if getattr(vit, name, None) is not None:
                    setattr(vit, name, None)
        if not last:  # the final norm and the head to the last
            for name in ("norm", "fc_norm", "attn_pool", "head"):
                if getattr(vit, name, None) is not None:
                    setattr(vit, name, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit = self.classifier.model
        if self.first:
            x = vit.norm_pre(
                vit.patch_drop(vit._pos_embed(vit.patch_embed(self.classifier.normalise(x))))
            )
        x = vit.blocks(x)
        if self.last:
            x = vit.forward_head(vit.norm(x))
        return x


class GlooSafeStage(PipelineStage):
    """torch 2.9's first exchange between neighbour stages receives a float32 into the buffer
    its peer fills with an int64; gloo refuses the size mismatch. That exchange only warms up
    NCCL's communicators (the first real send does the same), so gloo skips it."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        if dist.get_backend(self.group) == "gloo":
            return []
        return super()._get_init_p2p_neighbors_ops()


def full_name(stage_name: str) -> str:
    """'0.classifier.model.blocks.3.mlp.fc1.weight' -> 'model.blocks.3.mlp.fc1.weight'."""
    return stage_name.split(PREFIX, 1)[1]


class PipelineBackend(EagerBackend):
    """eager, with the model cut into --pp stages, run by a torch.distributed.pipelining
    schedule; each stage's gradients are averaged over its dp group by an explicit all-reduce."""

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        super().__init__(cfg, ctx)
        self.pp = MeshLayout.build("pp", cfg.pp, self.device.type)
        self.data_parallel = (self.pp.dp_rank, self.pp.dp)

    # --- set-up -------------------------------------------------------------------------------
    def setup(self, model: ImageClassifier) -> None:
        # The ordinary checkpoint numbers the optimizer state in the full model's group order.
        groups = weight_decay_groups(model, self.cfg.optim.weight_decay)
        names = {id(p): n for n, p in model.named_parameters()}
        ordered = [names[id(p)] for g in groups for p in g["params"]]
        self.full_order = {name: i for i, name in enumerate(ordered)}
        self.full_groups = self.adamw(groups).state_dict()["param_groups"]
        self.stages = self.build_stages(model)
        self.module = self.model = nn.ModuleList(self.stages)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = self.make_optimizer(
            weight_decay_groups(self.module, self.cfg.optim.weight_decay)
        )
        self.schedule = self.build_schedule()

    def build_stages(self, model: ImageClassifier) -> list[ViTStage]:
        virtual = 2 if self.cfg.pp_schedule == "interleaved" else 1
        count = self.pp.size * virtual
        ranges = stage_blocks(len(model.model.blocks), count)
        self.num_stages = count
        self.stage_ids = [self.pp.rank + k * self.pp.size for k in range(virtual)]
        embed = model.model.patch_embed
        self.activation = (embed.num_patches + model.model.num_prefix_tokens, model.model.embed_dim)
        stages = []
        for s in self.stage_ids:
            stage = ViTStage(model, ranges[s], first=s == 0, last=s == count - 1)
            stages.append(stage.to(self.device, dtype=self.amp.param_dtype))
        return stages

    def build_schedule(self):
        pipes = [
            GlooSafeStage(stage, s, self.num_stages, self.device, group=self.pp.group)
            for stage, s in zip(self.stages, self.stage_ids, strict=True)
        ]
        scale = self.cfg.pp_microbatches * self.cfg.optim.grad_accum

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # Summed over micro-batches and micro-steps, these make the batch's mean loss
            # (the schedule's own scaling would also rescale earlier micro-steps' gradients).
            return soft_target_loss(logits, targets) / scale

        kind = SCHEDULES[self.cfg.pp_schedule]
        stage = pipes if kind is ScheduleInterleaved1F1B else pipes[0]
        return kind(stage, self.cfg.pp_microbatches, loss_fn=loss_fn, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    # --- the step -----------------------------------------------------------------------------
    def autocast(self):
        """Without autocast's weight-cast cache: the schedule's first step runs each stage once
        under no_grad to infer shapes, and the low-precision weight copies cached then (with no
        graph behind them) would serve the training forwards, so no gradient would reach the
        weights."""
        if not self.amp.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp.dtype, cache_enabled=False)

    def accumulation_context(self, last: bool):
        return contextlib.nullcontext()

    def accumulate(self, micro_batches: list) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for images, targets in micro_batches:
            losses: list[torch.Tensor] = []
            args = (images,) if self.is_first else ()
            with self.autocast():
                if self.is_last:
                    self.schedule.step(*args, target=targets, losses=losses)
                else:
                    self.schedule.step(*args)
            if losses:
                total += torch.stack(losses).sum().detach()
        return total

    def reduce_gradients(self) -> None:
        """Average each stage's gradients over its dp group (the replicas of that stage)."""
        if self.pp.dp < 2:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        for work in [dist.all_reduce(g, group=self.pp.dp_group, async_op=True) for g in grads]:
            work.wait()
        torch._foreach_div_(grads, self.pp.dp)

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, group=self.pp.group)  # only the last stage holds the loss
        if self.pp.dp > 1:
            dist.all_reduce(value, group=self.pp.dp_group)
            value /= self.pp.dp
        return value

    def clip_gradients(self) -> torch.Tensor:
        """The norm over every stage's gradients (each stage holds its own parameters)."""
        params = self.optimizer_params
        grads = [p.grad for p in params if p.grad is not None]
        square = torch.nn.utils.get_total_norm(grads) ** 2
        dist.all_reduce(square, group=self.pp.group)
        norm = square.sqrt()
        if self.cfg.optim.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.clip_grad, norm)
        return norm

    def classifier_params(self) -> list[torch.Tensor]:
        return []

    # --- evaluation: the stages in turn, activations sent point to point ----------------------
    def batch_eval_sums(
        self, images: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        with self.autocast():
            logits = self.forward_only(images)
        if self.is_last:
            return eval_sums(logits, labels, mask)
        return torch.zeros(3, device=self.device)

    def forward_only(self, images: torch.Tensor) -> torch.Tensor | None:
        """The last stage's output on the rank that holds it, None elsewhere."""
        x, ranks, shape = None, self.pp.ranks, (images.shape[0], *self.activation)
        for s in range(self.num_stages):
            if s not in self.stage_ids:
                continue
            if s == 0:
                x = images
            else:
                x = torch.empty(shape, device=self.device)
                dist.recv(x, src=ranks[(s - 1) % self.pp.size])
                x = x.to(self.amp.param_dtype)
            x = self.stages[self.stage_ids.index(s)](x)
            if s < self.num_stages - 1:
                dist.send(x.float().contiguous(), dst=ranks[(s + 1) % self.pp.size])
        return x if self.is_last else None

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, group=self.pp.group)  # only the last stage holds the sums
        if self.pp.dp > 1:
            dist.all_reduce(value, group=self.pp.dp_group)
        return value

    # --- state: merged into, and split from, the ordinary format ------------------------------
    @property
    def gathers_state(self) -> bool:
        return True

    def entries(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(full name, parameter, what the optimizer updates) of this rank's stages."""
        return [
            (full_name(n), p, self.master[p] if self.separate_masters else p)
            for n, p in self.module.named_parameters()
            if p.requires_grad
        ]

    def state_dict(self) -> dict[str, Any]:
        mine = {
            name: (q.detach().cpu().float(), to_cpu(self.optimizer.state.get(q, {})))
            for name, _, q in self.entries()
        }
        parts: list = [None] * self.pp.size
        dist.all_gather_object(parts, mine, group=self.pp.group)
        merged = {name: item for part in parts for name, item in part.items()}
        state = {self.full_order[name]: moments for name, (_, moments) in merged.items() if moments}
        return {
            "model": {name: value for name, (value, _) in merged.items()},
            "optimizer": {"state": state, "param_groups": self.full_groups},
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["optimizer"]["state"]
        index = {id(q): i for i, q in enumerate(self.optimizer_params)}
        mine = {}
        with torch.no_grad():
            for name, p, q in self.entries():
                q.copy_(state["model"][name])
                if p is not q:
                    p.copy_(q)
                if self.full_order[name] in saved:
                    mine[index[id(q)]] = saved[self.full_order[name]]
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": mine, "param_groups": groups})
