"""A user's torch optimizer described by parameter name (what every backend rebuilds or
translates), and each group's learning rate per step."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from accel.config import AccelError

# --- a user's torch optimizer, described by parameter name ------------------------------------
# torch.optim's classes no step of accel's can run, and why.
REFUSED = {
    "LBFGS": "its step calls a closure that evaluates the loss again, several times a step",
    "SparseAdam": "it takes sparse gradients only",
}
# The optimizers of torch.optim accel takes: every other class there (eager, compile and xla run
# torch's own; jax translates those accel/backends/jax/optimizer.py names).
OPTIMIZERS = tuple(
    name
    for name, value in vars(torch.optim).items()
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
    and value is not torch.optim.Optimizer and name not in REFUSED
)  # fmt: skip
FUSED = ("AdamW", "Adam", "SGD")  # torch's fused update, on CUDA and the CPU
# Options that choose torch's implementation, not the update, which each backend picks itself.
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
# Hyperparameters that shape the update, by class (a class not named: every option of its
# groups but IMPLEMENTATION's).
HYPERPARAMETERS = {
    "AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
}


class OptimizerError(AccelError):
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
        if kind in REFUSED and type(optimizer) is getattr(torch.optim, kind):
            raise OptimizerError(f"accel cannot run torch.optim.{kind}: {REFUSED[kind]}")
        if kind not in OPTIMIZERS or type(optimizer) is not getattr(torch.optim, kind):
            raise OptimizerError(
                "accel runs the optimizers of torch.optim (but LBFGS and SparseAdam); got "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
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
            keys = HYPERPARAMETERS.get(kind) or [k for k in group if k not in (*IMPLEMENTATION,
                                                                             "params")]  # fmt: skip
            hyper = {k: group[k] for k in keys if k in group}
            hyper["lr"] = float(hyper["lr"])  # a tensor lr enters the step as a value anyway
            names_here = tuple(names[id(p)] for p in group["params"] if p.requires_grad)
            groups.append(GroupSpec(names_here, hyper, float(group.get("lr_scale", 1.0))))
        return cls(kind, tuple(groups))

    def build(
        self,
        tensor_of: dict[str, torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer] | None = None,
        **implementation: Any,
    ) -> torch.optim.Optimizer:
        """The same optimizer over `tensor_of[name]` (the model's parameters, or fp32 masters,
        all of them or the part this rank keeps), with implementation flags (fused, capturable)
        chosen by the backend; `optimizer_class`:
        a backend's own implementation of the same update (torch_xla's syncfree AdamW)."""
        # A rank that keeps part of the model (a pipeline stage) updates the tensors it holds;
        # its groups stay in order, empty where it holds none of one, so rates match by index.
        # Fused and foreach updates run over one group's tensors at once, and DTensor refuses a
        # list mixing DTensors and plain tensors (a model split by tensors holds both): such a
        # group becomes two, both naming the group they came from (`spec_group`).
        groups = []
        for index, g in enumerate(self.groups):
            tensors = [tensor_of[n] for n in g.names if n in tensor_of]
            kinds = {isinstance(t, DTensor) for t in tensors}
            for split in sorted(kinds) or [False]:
                mine = [t for t in tensors if isinstance(t, DTensor) == split]
                groups.append(
                    {"params": mine, **g.hyper, "lr_scale": g.lr_scale, "spec_group": index}
                )
        kind = optimizer_class or getattr(torch.optim, self.kind)
        return kind(groups, **self.implementation(kind, implementation))

    def implementation(self, kind: type, flags: dict[str, Any]) -> dict[str, Any]:
        """The implementation `flags` a backend asks for that `kind` takes (fused only for
        FUSED's: torch has no fused update of the others everywhere)."""
        takes = inspect.signature(kind).parameters
        fused_ok = self.kind in FUSED
        return {k: v for k, v in flags.items() if k in takes and (k != "fused" or fused_ok)}

    def refusals(self, translatable: bool = False) -> list[str]:
        """What no backend (or, with `translatable`, the optax translation) can run."""
        out = []
        for g in self.groups:
            h = g.hyper
            if translatable and h.get("amsgrad"):
                out.append("amsgrad=True (optax's amsgrad is not torch's)")
            if translatable and self.kind == "SGD" and h.get("dampening"):
                out.append("SGD dampening")
        return sorted(set(out))


ScheduleFn = Callable[[int], float]

# What torch's schedulers change of a group besides its rate (OneCycleLR and CyclicLR cycle
# Adam's beta1 or SGD's momentum), which each step takes from the user's groups as it takes the
# rate: values of the step on every backend, never constants of a compiled program.
FOLLOWED = {"AdamW": ("betas", "weight_decay"), "Adam": ("betas", "weight_decay")}
FOLLOWED["SGD"] = ("momentum", "weight_decay")


class GroupRates(list):
    """Each param group's learning rate for a step (a list of floats), and `followed`: per
    group, the values of FOLLOWED as the user's groups hold them then (empty: the spec's)."""

    def __init__(self, rates: Iterable[float], followed: Iterable[dict[str, Any]] = ()):
        super().__init__(rates)
        self.followed = list(followed)


def followed_values(kind: str, group: dict[str, Any]) -> dict[str, Any]:
    """A torch param group's values of FOLLOWED[kind], as floats (torch takes tensors too)."""
    out: dict[str, Any] = {}
    for key in FOLLOWED.get(kind, ()):
        if key in group:
            value = group[key]
            out[key] = tuple(float(v) for v in value) if key == "betas" else float(value)
    return out


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
        optimizer: torch.optim.Optimizer | None = None,
    ):
        """`optimizer`: the user's, whose groups' rates (as their own scheduler steps them, per
        step or per epoch) each step takes where no `schedule` is given."""
        self.spec, self.schedule, self.optimizer = spec, schedule, optimizer
        self.base = [g.hyper["lr"] for g in spec.groups]
        self.scales = [g.lr_scale for g in spec.groups]
        self.stepped = 0

    def __call__(self, step: int) -> GroupRates:
        s = self.schedule
        if isinstance(s, LRScheduler):
            while self.stepped < step:  # the scheduler counts its own steps
                with warnings.catch_warnings():  # the user's optimizer never steps: accel's does
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                    s.step()
                self.stepped += 1
        rates, others = self.base, []  # no schedule and no optimizer of the user's
        if s is not None and not isinstance(s, LRScheduler):
            first = self.base[0] or 1.0
            rates = [float(s(step)) * b / first for b in self.base]
        elif (followed := self.user_optimizer()) is not None:
            rates = [float(g["lr"]) for g in followed.param_groups]
            others = [followed_values(self.spec.kind, g) for g in followed.param_groups]
            self.check_unfollowed(followed)
        return GroupRates([r * k for r, k in zip(rates, self.scales, strict=True)], others)

    def check_unfollowed(self, optimizer: torch.optim.Optimizer) -> None:
        """OptimizerError where the user's groups changed a value no step follows (a scheduler
        cycling RMSprop's momentum): the steps would go on with the built one, unsaid."""
        followed = ("lr", *FOLLOWED.get(self.spec.kind, ()))
        for spec_group, group in zip(self.spec.groups, optimizer.param_groups, strict=False):
            for key, built in spec_group.hyper.items():
                if key not in followed and key in group and group[key] != built:
                    raise OptimizerError(
                        f"{self.spec.kind}'s {key} changed from {built} to {group[key]} after "
                        f"prepare: accel's step follows its {', '.join(followed)} only; call "
                        "accel.prepare again to train with the new value"
                    )

    def user_optimizer(self) -> torch.optim.Optimizer | None:
        if isinstance(self.schedule, LRScheduler):
            return self.schedule.optimizer
        return self.optimizer

    def saved(self) -> list[float] | None:
        """The user's optimizer's groups' rates as they stand: what a checkpoint keeps."""
        optimizer = self.user_optimizer()
        return None if optimizer is None else [float(g["lr"]) for g in optimizer.param_groups]

    def restore(self, saved: list[float] | None, step: int) -> None:
        """After loading a checkpoint saved at `step`, the user's optimizer's groups take the
        rates they had (`saved`), which their own scheduler, restored from its state_dict, goes
        on from. A scheduler given as `schedule` is stepped from its start as it was for the
        saved run's last step instead, which leaves both it and the optimizer as they were."""
        if isinstance(self.schedule, LRScheduler):
            self(max(step - 1, 0))  # the rates of the step before `step`: the last one taken
            return
        optimizer = self.user_optimizer()
        if saved is None or optimizer is None or len(saved) != len(optimizer.param_groups):
            return
        for group, rate in zip(optimizer.param_groups, saved, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(rate)
            else:
                group["lr"] = rate
