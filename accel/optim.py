"""Optimizer parameter groups and the learning-rate schedule shared by every backend."""

from __future__ import annotations

import torch
from timm.optim import param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from torch import nn

from accel.config import OptimConfig


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """timm's split: no weight decay on norms, biases and other 1-D parameters."""
    return param_groups_weight_decay(model, weight_decay)


def decay_mask(model: nn.Module) -> dict[str, bool]:
    """Parameter name -> whether weight decay applies (the same split, by name)."""
    no_decay = {
        id(p)
        for g in weight_decay_groups(model, 1.0)
        if g["weight_decay"] == 0.0
        for p in g["params"]
    }
    return {name: id(p) not in no_decay for name, p in model.named_parameters() if p.requires_grad}


class LRSchedule:
    """timm's cosine schedule with linear warm-up, read as a value per optimizer step.

    timm schedulers write into an optimizer's param groups; binding one to a one-parameter dummy
    optimizer gives the value as a number, which every backend (the JAX one too) feeds to its step.
    """

    def __init__(self, cfg: OptimConfig, total_steps: int):
        self._dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
        self._sched = CosineLRScheduler(
            self._dummy,
            # At least 2: a one-step cosine has nothing to anneal (timm warns), and step 0
            # takes the peak either way.
            t_initial=max(2, total_steps - cfg.warmup_steps),
            lr_min=cfg.min_lr,
            warmup_t=cfg.warmup_steps,
            warmup_lr_init=cfg.min_lr,
            warmup_prefix=True,
            t_in_epochs=False,
        )

    def __call__(self, step: int) -> float:
        self._sched.step_update(step)
        return float(self._dummy.param_groups[0]["lr"])
