"""A torch optimizer translated to optax for the jax backend: one chain per param group, its state
mapped onto torch's by name."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch

from accel.backends.jax.torch_optax import RULES, TorchOptState, slots_of, torch_update
from accel.backends.jax.values import host_value, to_jax, to_torch
from accel.config import AccelError
from accel.optim import OptimizerSpec, followed_values


class OptaxGroups:
    """A torch optimizer (TRANSLATED: AdamW, Adam and SGD through optax's transforms, RMSprop,
    Adagrad, Adamax, Adadelta, NAdam and RAdam through torch_optax.py's) as one chain per param
    group over that group's parameters (by name), so every group keeps its own hyperparameters
    and its state maps one to one onto torch's (`step`, `exp_avg`, `exp_avg_sq`;
    `momentum_buffer`; torch's own names for the others). The
    learning rate is not part of a chain: the step multiplies each group's update by -lr. The
    rate and what a scheduler changes besides (beta1, momentum, weight decay: optim.FOLLOWED;
    beta2 stays as built, check_beta2) are arguments of the step (`rates`), so a changing
    schedule never recompiles it; which transforms a chain holds is the user's optimizer's, as
    built."""

    def __init__(self, spec: OptimizerSpec):
        if spec.kind not in TRANSLATED:
            raise AccelError(
                f"the jax backend has no optax translation of torch.optim.{spec.kind} (it "
                f"translates {', '.join(TRANSLATED)}): use the eager, compile or xla backend"
            )
        refused = spec.refusals(translatable=True)
        if refused:
            raise AccelError(
                f"the jax backend has no optax translation of {spec.kind} with "
                f"{', '.join(refused)}: use the eager, compile or xla backend"
            )
        self.spec = spec
        self.chains = [self._chain(g.hyper) for g in spec.groups]

    def _chain(self, h: dict, values: dict | None = None) -> optax.GradientTransformation:
        """The group's chain: its transforms as `h` (the user's group) has them, with the
        step's `values` (arrays: weight_decay, momentum, b1) where given."""
        if self.spec.kind in RULES:  # torch's own arithmetic (torch_optax.py), maximize inside
            return optax.chain(torch_update(self.spec.kind, h))
        v = {**h, "b1": h["betas"][0], "b2": h["betas"][1]} if "betas" in h else dict(h)
        v.update(values or {})
        # torch's maximize: the gradient negated before anything else (the decay included)
        negate = [optax.scale(-1.0)] if h.get("maximize") else []
        decay = [optax.add_decayed_weights(v["weight_decay"])] if h.get("weight_decay") else []
        if self.spec.kind == "SGD":
            momentum = [optax.trace(v["momentum"], h["nesterov"])] if h.get("momentum") else []
            parts = [*negate, *decay, *momentum]  # torch's SGD: decay coupled to the gradient
            return optax.chain(*parts) if parts else optax.identity()
        adam = optax.scale_by_adam(b1=v["b1"], b2=v["b2"], eps=h["eps"])
        if self.spec.kind == "AdamW" or h.get("decoupled_weight_decay"):
            return optax.chain(*negate, adam, *decay)  # decoupled: p -= lr * (adam + wd * p)
        return optax.chain(*negate, *decay, adam)  # Adam's L2: the decay joins the gradient

    def _split(self, tree: dict) -> list[dict]:
        return [{n: tree[n] for n in g.names} for g in self.spec.groups]

    def init(self, params: dict) -> tuple:
        return tuple(c.init(p) for c, p in zip(self.chains, self._split(params), strict=True))

    def update(self, grads: dict, state: tuple, params: dict, rates: dict) -> tuple:
        """(new params, new state); `rates`: per name ("lr", and FOLLOWED's), one value per
        group (`rates`)."""
        new_params, new_state = dict(params), []
        parts = zip(self.spec.groups, self._split(grads), state, self._split(params), strict=True)
        for i, (group, g, s, p) in enumerate(parts):
            values = {k: v[i] for k, v in rates.items() if k != "lr"}
            updates, s = self._chain(group.hyper, values).update(g, s, p)
            new_state.append(s)
            for n, u in updates.items():
                new_params[n] = (p[n] - rates["lr"][i] * u).astype(p[n].dtype)
        return new_params, tuple(new_state)

    def rates(self, lr: float | list[float]) -> dict[str, jax.Array]:
        """The step's values by name, one per group: "lr" (one base rate, each group scaled by
        its lr_scale, or one rate per group) and what the user's scheduler changes besides
        (GroupRates.followed; else the groups' own)."""
        groups = self.spec.groups
        if isinstance(lr, int | float):
            lr = [lr * g.lr_scale for g in groups]
        followed = getattr(lr, "followed", None) or [followed_values(self.spec.kind, g.hyper)
                                                     for g in groups]  # fmt: skip
        values: dict[str, list[float]] = {"lr": list(lr)}
        for spec_group, group in zip(groups, followed, strict=True):
            if "betas" in group:
                check_beta2(spec_group.hyper["betas"][1], group["betas"][1])
                group = {**group, "b1": group["betas"][0]}
            for key in ("b1", "momentum", "weight_decay"):
                if key in group:
                    values.setdefault(key, []).append(group[key])
        return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}

    def to_torch(self, state: tuple) -> dict[str, dict[str, torch.Tensor]]:
        """torch's state by parameter name."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, moments in self.named(state).items():
            out[name] = {k: to_torch(v).float() for k, v in moments.items() if k != "step"}
            if "step" in moments:
                out[name]["step"] = torch.tensor(float(host_value(moments["step"])))
        return out

    def named(self, state: tuple) -> dict[str, dict[str, jax.Array]]:
        """The optimizer's state by parameter name, under torch's names, as the arrays it is."""
        out: dict[str, dict[str, jax.Array]] = {}
        for g, s in zip(self.spec.groups, state, strict=True):
            adam = _find(s, optax.ScaleByAdamState)
            trace = _find(s, optax.TraceState)
            own = _find(s, TorchOptState)
            for n in g.names:
                if own is not None:
                    out[n] = {"step": own.step, **{k: v[n] for k, v in own.slots.items()}}
                elif adam is not None:
                    out[n] = {"step": adam.count, "exp_avg": adam.mu[n], "exp_avg_sq": adam.nu[n]}
                elif trace is not None:
                    out[n] = {"momentum_buffer": trace.trace[n]}
        return out

    def from_torch(self, saved: dict, params: dict, dtype: jnp.dtype) -> tuple:
        """A fresh state over `params`, with `saved` (torch's, by name) where it has a group's
        parameters (none: a checkpoint saved before the first step)."""
        state = []
        for g, s in zip(self.spec.groups, self.init(params), strict=True):
            if g.names and g.names[0] in saved:
                first = saved[g.names[0]]
                if self.spec.kind in RULES:
                    slots = slots_of(self.spec.kind, g.hyper)
                    own = TorchOptState(
                        step=jnp.asarray(int(first["step"]), jnp.int32),
                        slots={k: {n: to_jax(saved[n][k], dtype) for n in g.names} for k in slots},
                    )
                    s = _replace(s, TorchOptState, own)
                elif "exp_avg" in first:
                    adam = optax.ScaleByAdamState(
                        count=jnp.asarray(int(first["step"]), jnp.int32),
                        mu={n: to_jax(saved[n]["exp_avg"], dtype) for n in g.names},
                        nu={n: to_jax(saved[n]["exp_avg_sq"], dtype) for n in g.names},
                    )
                    s = _replace(s, optax.ScaleByAdamState, adam)
                elif "momentum_buffer" in first:
                    buffers = {n: to_jax(saved[n]["momentum_buffer"], dtype) for n in g.names}
                    s = _replace(s, optax.TraceState, optax.TraceState(trace=buffers))
            state.append(s)
        return tuple(state)


TRANSLATED = ("AdamW", "Adam", "SGD", *RULES)  # the optimizers of torch.optim translated here


def check_beta2(built: float, now: float) -> None:
    """Adam's beta2 stays a constant of the step: optax computes 1 - beta2 in the arrays' float32,
    which loses half its digits at 0.999 (torch computes it in float64). A scheduler that
    changes it is refused in one line."""
    if now != built:
        raise AccelError(
            f"the jax backend keeps Adam's beta2 as the optimizer was built ({built}); your "
            f"scheduler changed it to {now}: schedule beta1 only, or train on eager, compile "
            "or xla"
        )


def _find(chain_state: tuple, kind: type) -> Any:
    return next((s for s in chain_state if isinstance(s, kind)), None)


def _replace(chain_state: tuple, kind: type, new: Any) -> tuple:
    return tuple(new if isinstance(s, kind) else s for s in chain_state)
