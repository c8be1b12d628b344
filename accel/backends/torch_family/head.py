"""The split classifier's part of a split layout (`tp_head=2`): the rows of the classifier a
model gives as `get_classifier()` (accel.parallel.tp_head), the caller's loss and metric
computed from their logit columns (accel.logits.FromLogits), and the rows in checkpoints as
DTensors of the whole classifier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel.backends.torch_family.core import TorchCore
from accel.logits import ClassShards, FromLogits
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

    def computed(self, objective: FromLogits) -> Callable[[Callable, tuple], Any]:
        """`objective`, a loss or a metric, as a function (model, batch) -> value that computes
        it from this rank's logit columns."""
        rows = self.rows

        def from_columns(model: Callable, batch: tuple) -> Any:
            args, targets = objective.logits_parts(batch)
            return objective.from_shards(ClassShards(model(*args), rows), *targets)

        return from_columns

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
