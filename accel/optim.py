"""What every backend's optimizer shares: each parameter's weight decay and learning-rate scale
(timm's rules, layer-wise decay included), the learning-rate schedule, and the EMA decay."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn

from accel.config import ConfigError, OptimConfig

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


# --- a user's torch optimizer, described by parameter name ------------------------------------
OPTIMIZERS = ("AdamW", "Adam", "SGD")  # the classes every backend runs (jax translates them)
# Hyperparameters that shape the update, by class; the rest (foreach, fused, capturable,
# differentiable) only choose torch's implementation, which each backend picks itself.
HYPERPARAMETERS = {
    "AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
}


class OptimizerError(ConfigError):
    """An optimizer a backend cannot run: one line, exit 2."""


@dataclass(frozen=True)
class GroupSpec:
    """One param group: its parameters by name, its hyperparameters, and timm's `lr_scale`
    (layer decay) where the group has one."""

    names: tuple[str, ...]
    hyper: dict[str, Any]
    lr_scale: float = 1.0


@dataclass(frozen=True)
class OptimizerSpec:
    """A torch optimizer as every backend can rebuild it: its class name and its groups."""

    kind: str
    groups: tuple[GroupSpec, ...]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
        """The spec of `optimizer`, whose parameters must all belong to `model`."""
        kind = type(optimizer).__name__
        if kind not in OPTIMIZERS or type(optimizer) is not getattr(torch.optim, kind):
            raise OptimizerError(
                f"accel runs torch.optim.{', torch.optim.'.join(OPTIMIZERS)}; "
                f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in names]
            if missing:
                raise OptimizerError(
                    f"the optimizer holds {len(missing)} parameter(s) that are not the model's: "
                    "build it from model.parameters() (or the model's param groups)"
                )
            hyper = {k: group[k] for k in HYPERPARAMETERS[kind] if k in group}
            hyper["lr"] = float(hyper["lr"])  # a tensor lr enters the step as a value anyway
            names_here = tuple(names[id(p)] for p in group["params"] if p.requires_grad)
            groups.append(GroupSpec(names_here, hyper, float(group.get("lr_scale", 1.0))))
        return cls(kind, tuple(groups))

    def build(self, tensor_of: dict[str, torch.Tensor], **implementation) -> torch.optim.Optimizer:
        """The same optimizer over `tensor_of[name]` (the model's parameters, or fp32 masters),
        with implementation flags (fused, capturable) chosen by the backend."""
        groups = [
            {"params": [tensor_of[n] for n in g.names], **g.hyper, "lr_scale": g.lr_scale}
            for g in self.groups
        ]
        return getattr(torch.optim, self.kind)(groups, **implementation)

    def refusals(self, translatable: bool = False) -> list[str]:
        """What no backend (or, with `translatable`, the optax translation) can run."""
        out = []
        for g in self.groups:
            h = g.hyper
            if h.get("maximize"):
                out.append("maximize=True")
            if translatable and h.get("amsgrad"):
                out.append("amsgrad=True (optax's amsgrad is not torch's)")
            if translatable and self.kind == "SGD" and h.get("dampening"):
                out.append("SGD dampening")
        return sorted(set(out))


ScheduleFn = Callable[[int], float]


class LearningRates:
    """Each param group's learning rate at an optimizer step, as plain numbers, so a changing
    rate enters the compiled step as a value and never recompiles it.

    `schedule`: None (the groups' own rates), a function of the step giving the base rate (each
    group keeps its ratio to the first group's rate), or a torch LRScheduler bound to the user's
    optimizer (stepped here, its groups' rates read). timm's `lr_scale` multiplies each group's.
    """

    def __init__(
        self,
        spec: OptimizerSpec,
        schedule: ScheduleFn | torch.optim.lr_scheduler.LRScheduler | None = None,
    ):
        self.spec, self.schedule = spec, schedule
        self.base = [g.hyper["lr"] for g in spec.groups]
        self.scales = [g.lr_scale for g in spec.groups]
        self.stepped = 0

    def __call__(self, step: int) -> list[float]:
        s = self.schedule
        if s is None:
            rates = self.base
        elif isinstance(s, torch.optim.lr_scheduler.LRScheduler):
            while self.stepped < step:  # the scheduler counts its own steps
                with warnings.catch_warnings():  # the user's optimizer never steps: accel's does
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                    s.step()
                self.stepped += 1
            rates = [float(g["lr"]) for g in s.optimizer.param_groups]
        else:
            first = self.base[0] or 1.0
            rates = [float(s(step)) * b / first for b in self.base]
        return [r * k for r, k in zip(rates, self.scales, strict=True)]
