"""Tensor-parallel classifier (`tp_head=2`): the head's classes split over the ranks of a `tp`
group, the body replicated across them, so a classifier over a million classes never holds its
full weight, gradient, optimizer state or logits on one rank.

Ranks form a dp x tp mesh (tp innermost): ranks of a tp group train on the same batch; dp groups
(same tp index) split the data. The caller's loss and metric are computed from the logit
shards (accel.logits: `FromLogits`, `ClassShards`) with a few collectives of one value per
sample.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from accel.parallel.mesh import MeshAxis


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the backward sums the feature gradients of every class shard, so the
    replicated body receives the gradient of the whole loss on every tp rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ShardedClassifier(nn.Module):
    """Rows [start, start + per) of a (classes x features) classifier, the class count padded to
    a multiple of the tp size; padded rows give a logit no softmax can pick."""

    def __init__(self, full: nn.Linear, layout: MeshAxis):
        super().__init__()
        self.classes = full.out_features
        self.per = -(-self.classes // layout.size)
        self.start = layout.rank * self.per
        self.valid = max(0, min(self.per, self.classes - self.start))  # real classes here
        self.group = layout.group
        self.mesh = layout.mesh
        self.weight = nn.Parameter(self.rows(full.weight.detach()))
        self.bias = nn.Parameter(self.rows(full.bias.detach()))

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (classes, ...) tensor, zero-padded."""
        out = full.new_zeros((self.per, *full.shape[1:]))
        out[: self.valid] = full[self.start : self.start + self.valid]
        return out

    def whole_view(self, local: torch.Tensor) -> DTensor:
        """This rank's rows of a (per, ...) tensor (a parameter, or its AdamW moment) as a
        DTensor of the whole classifier's shape, without the padding and without a copy:
        checkpoints save and reshard it as any other sharded tensor. DTensor splits an uneven
        axis as torch.chunk does, ceil(classes / size) rows a rank, which is this layout."""
        shape = (self.classes, *local.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local[: self.valid], self.mesh, [Shard(0)], shape=torch.Size(shape), stride=stride
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(
            _CopyToTensorParallel.apply(x, self.group), self.weight, self.bias
        )
        if self.valid < self.per:
            padded = torch.arange(self.per, device=logits.device) >= self.valid
            logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min / 4)
        return logits

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """This rank's columns of full (batch, classes) soft targets, zero-padded."""
        local = targets[:, self.start : self.start + self.valid]
        return nn.functional.pad(local, (0, self.per - self.valid))


@runtime_checkable
class HasClassifier(Protocol):
    """A model whose classifier can be split (`tp_head=2`): `get_classifier()` returns its final
    nn.Linear (timm's models have the method: ViT's head, Swin's head.fc), a submodule of the
    model whose logits are the model's output."""

    def get_classifier(self) -> Any: ...


def linear_classifier(model: nn.Module) -> nn.Linear:
    """The classifier the model gives (`HasClassifier`), checked; ValueError naming what the
    model must give."""
    if not isinstance(model, HasClassifier):
        raise ValueError(
            f"tp_head= splits the linear classifier a model gives as get_classifier() (timm's "
            f"models do); {type(model).__name__} gives none"
        )
    full = model.get_classifier()
    if not isinstance(full, nn.Linear):
        raise ValueError(
            f"tp_head= splits a linear classifier; this model has {type(full).__name__}"
        )
    return full


def apply_tp_head(model: nn.Module, layout: MeshAxis) -> ShardedClassifier:
    """Replace the model's classifier (`HasClassifier.get_classifier()`) by this rank's shard of
    it (on the meta device, before the rank's part is allocated)."""
    full = linear_classifier(model)
    parent_name, _, attr = next(n for n, m in model.named_modules() if m is full).rpartition(".")
    sharded = ShardedClassifier(full, layout)
    setattr(model.get_submodule(parent_name), attr, sharded)
    return sharded


def grad_norm(params: list[torch.Tensor], head_params: set[int], group) -> torch.Tensor:
    """The global gradient norm: the body's gradients are the same on every tp rank (counted
    once), the head's are summed over its shards."""
    body = [p.grad for p in params if p.grad is not None and id(p) not in head_params]
    head = [p.grad for p in params if p.grad is not None and id(p) in head_params]
    head_sq = torch.nn.utils.get_total_norm(head) ** 2
    dist.all_reduce(head_sq, group=group)
    return (torch.nn.utils.get_total_norm(body) ** 2 + head_sq).sqrt()
