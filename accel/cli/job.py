"""The command line's training job, built as a user would build theirs and handed to
`accel.prepare`: the timm model (on the meta device, built whole by the backend or by rank 0
for a split layout), AdamW over timm's param groups (weight decay, layer decay), the soft-target
loss, timm's cosine schedule and the EMA decay. Nothing here touches a backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import cast

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn

import accel
from accel.cli.config import OptimConfig, RunConfig
from accel.cli.models.factory import ImageClassifier, create_model, meta_model
from accel.cli.task import classifier_loss
from accel.config import BackendConfig
from accel.engine import Engine
from accel.loop import LoopPart

Settings = dict[str, tuple[float, float]]  # parameter name -> (lr scale, weight decay)


def parameter_settings(model: nn.Module, cfg: OptimConfig) -> Settings:
    """timm's optimizer rules, by the name each parameter has in `model` (an ImageClassifier,
    possibly on the meta device): no weight decay on norms, biases and the timm model's own
    no_weight_decay() names; with --layer_decay, timm's per-layer learning-rate scales."""
    inner = cast(ImageClassifier, model).model
    no_decay = getattr(inner, "no_weight_decay", None)  # timm's names without weight decay
    skip = no_decay() if no_decay else ()
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


def param_groups(named: Sequence[tuple[str, torch.Tensor]], settings: Settings) -> list[dict]:
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
        self.decay, self.warmup = cfg.model_ema_decay, cfg.model_ema_warmup
        # ModelEmaV3 copies the module it is given: a one-weight stand-in (it needs a parameter).
        self._ema = ModelEmaV3(
            nn.Linear(1, 1), decay=cfg.model_ema_decay, use_warmup=cfg.model_ema_warmup
        )

    def __call__(self, step: int) -> float:
        """`step`: optimizer steps done, this one included (timm's num_updates)."""
        return float(self._ema.get_decay(step))

    def __repr__(self) -> str:  # the same on every rank and every run: how the config is compared
        return f"EmaDecay(decay={self.decay}, warmup={self.warmup})"


def adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over timm's param groups of `model` (on the meta device: a description the backend
    rebuilds over the tensors it updates)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = param_groups(named, parameter_settings(model, cfg))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def backend_config(cfg: RunConfig) -> BackendConfig:
    """The library's config of the run (RunConfig.accel), with what the command line settles in
    its own terms: the EMA decay from --model_ema*, and the compile cache's folder."""
    optim, accel_cfg = cfg.optim, cfg.accel
    ema = EmaDecay(optim) if optim.model_ema else accel_cfg.step.ema
    return dataclasses.replace(
        accel_cfg,
        step=dataclasses.replace(accel_cfg.step, ema=ema),
        compiler=dataclasses.replace(accel_cfg.compiler, cache_dir=str(cfg.compile_cache_dir())),
    )


def run_model(cfg: RunConfig) -> tuple[ImageClassifier, Callable[[], ImageClassifier]]:
    """The model on the meta device, and how to build it with the run's starting weights."""
    return meta_model(cfg.model), lambda: create_model(cfg.model, seed=cfg.seed)


def build_engine(
    cfg: RunConfig, schedule: Callable[[int], float] | None = None, state: LoopPart | None = None
) -> Engine:
    """The run's model, optimizer, loss and schedule (default: the peak rate throughout) on its
    backend, through `accel.prepare`, as a user's script builds its own."""
    model, init = run_model(cfg)
    optim = cfg.optim
    return accel.prepare(
        model,
        adamw(model, optim),
        classifier_loss,
        schedule=schedule,
        init=init,
        state=state,
        config=backend_config(cfg),
        quiet=True,
    )
