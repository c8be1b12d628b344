"""The split classifier's part of a split layout (`tp_head=2`): the rows of the classifier a
model gives as `get_classifier()` (accel.parallel.tp_head), the loss and the evaluation sums
computed from their logit shards, and the rows in checkpoints as DTensors of the whole
classifier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel.backends.base import MetricFn
from accel.backends.torch_family.core import TorchCore
from accel.losses import SoftTargetParts, named_sums
from accel.parallel import tp_head
from accel.parallel.mesh import MeshAxis


class SplitHead:
    """This rank's rows of the model's classifier, over the ranks of `axis`."""

    def __init__(self, meta: nn.Module, axis: MeshAxis):
        self.axis = axis
        self.rows = tp_head.apply_tp_head(meta, axis)
        mine = {id(p) for p in self.rows.parameters()}
        self.names = {n for n, p in meta.named_parameters() if id(p) in mine}
        self.params: list[torch.Tensor] = []  # the rows as the optimizer holds them

    def parameters(self) -> list[nn.Parameter]:
        return list(self.rows.parameters())

    def loss(self, model: Callable, parts: SoftTargetParts) -> torch.Tensor:
        """accel.losses.soft_target_loss from the logit shards, of a batch's (inputs, targets,
        extras)."""
        images, targets, extras = parts
        return tp_head.soft_target_loss(model(images, *extras), targets, self.rows)

    def metric_fn(self, parts: Callable[[tuple], tuple[torch.Tensor, ...]]) -> MetricFn:
        """accel.losses.ClassificationSums' sums from the logit shards (the top-k from each
        rank's classes), of the (inputs, labels, mask) `parts` reads from a batch."""
        rows = self.rows

        def split_metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
            images, labels, mask = parts(batch)
            return named_sums(tp_head.eval_sums(model(images), labels, mask, rows))

        return split_metrics

    def attached(self, core: TorchCore) -> None:
        """The rows as the optimizer holds them (the gradient norm sums theirs over the ranks)."""
        self.params = [core.updated(p) for p in self.rows.parameters()]

    def checkpoint_view(self, state: dict[str, Any]) -> dict[str, Any]:
        """The rows (and their AdamW moments) as DTensors of the whole classifier."""
        names, rows = self.names, self.rows

        def view(tensors: dict) -> dict:
            return {n: rows.whole_view(t) if n in names else t for n, t in tensors.items()}

        optim = {
            n: {k: rows.whole_view(v) if n in names and v.dim() else v for k, v in s.items()}
            for n, s in state["optim"].items()
        }
        views = {"model": view(state["model"]), "optim": optim}
        if "ema" in state:
            views["ema"] = view(state["ema"])
        return {**state, **views}
