"""What every backend's optimizer shares: each parameter's weight decay and learning-rate scale
(timm's rules, layer-wise decay included), the learning-rate schedule, and the EMA decay."""

from __future__ import annotations

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn

from accel.config import OptimConfig

Settings = dict[str, tuple[float, float]]  # parameter name -> (lr scale, weight decay)


def parameter_settings(model: nn.Module, cfg: OptimConfig) -> Settings:
    """timm's optimizer rules, by the name each parameter has in `model` (an ImageClassifier,
    possibly on the meta device): no weight decay on norms, biases and the timm model's own
    no_weight_decay() names; with --layer_decay, timm's per-layer learning-rate scales."""
    inner = model.model
    skip = inner.no_weight_decay() if hasattr(inner, "no_weight_decay") else ()
    if cfg.layer_decay:
        groups = param_groups_layer_decay(
            inner, cfg.weight_decay, skip, layer_decay=cfg.layer_decay
        )
    else:
        groups = param_groups_weight_decay(inner, cfg.weight_decay, no_weight_decay_list=skip)
    names = {id(p): f"model.{n}" for n, p in inner.named_parameters()}
    return {
        names[id(p)]: (g.get("lr_scale", 1.0), g["weight_decay"])
        for g in groups
        for p in g["params"]
    }


def param_groups(named: list[tuple[str, torch.Tensor]], settings: Settings) -> list[dict]:
    """Optimizer groups of `named` parameters (any part of the model) by their settings."""
    buckets: dict[tuple[float, float], list[torch.Tensor]] = {}
    for name, param in named:
        buckets.setdefault(settings[name], []).append(param)
    return [
        {"params": params, "lr_scale": scale, "weight_decay": decay}
        for (scale, decay), params in buckets.items()
    ]


class LRSchedule:
    """timm's cosine schedule with linear warm-up, read as a value per optimizer step.

    timm schedulers write into an optimizer's param groups; binding one to a one-parameter dummy
    optimizer gives the value as a number, which every backend (the JAX one too) feeds to its
    step, each group's learning rate being that times the group's scale.
    """

    def __init__(self, cfg: OptimConfig, total_steps: int, steps_per_epoch: int = 1):
        warmup = cfg.warmup_steps + round(cfg.warmup_epochs * steps_per_epoch)
        self._dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
        self._sched = CosineLRScheduler(
            self._dummy,
            # At least 2: a one-step cosine has nothing to anneal (timm warns), and step 0
            # takes the peak either way.
            t_initial=max(2, total_steps - warmup),
            lr_min=cfg.min_lr,
            warmup_t=warmup,
            warmup_lr_init=cfg.min_lr,
            warmup_prefix=True,
            t_in_epochs=False,
        )

    def __call__(self, step: int) -> float:
        self._sched.step_update(step)
        return float(self._dummy.param_groups[0]["lr"])


class EmaDecay:
    """The EMA decay of an optimizer step, as timm's ModelEmaV3 computes it (with its warm-up
    where asked); the EMA weights themselves are each backend's, updated inside its step."""

    def __init__(self, cfg: OptimConfig):
        # ModelEmaV3 copies the module it is given: a one-weight stand-in (it needs a parameter).
        self._ema = ModelEmaV3(
            nn.Linear(1, 1), decay=cfg.model_ema_decay, use_warmup=cfg.model_ema_warmup
        )

    def __call__(self, step: int) -> float:
        """`step`: optimizer steps done, this one included (timm's num_updates)."""
        return float(self._ema.get_decay(step))
