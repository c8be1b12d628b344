"""torch.optim's RMSprop, Adagrad, Adamax, Adadelta, NAdam and RAdam as optax transformations for
the jax backend, written from torch's own update rules (its single-tensor implementations): optax
has most of them, each differing from torch's in a detail that moves the weights (where eps is
added: inside or outside the square root, or the max; NAdam's momentum schedule; RAdam's
threshold and eps), so these follow torch's arithmetic. Each returns the update `u` that the
step applies as `p - lr * u` (optimizer.OptaxGroups.update); its state holds the count (torch's
`step`) and torch's own state tensors by torch's names (`SLOTS`), so checkpoints read and load
as torch's. Part of the jax backend (imported only by accel/backends/jax/)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class TorchOptState(NamedTuple):
    """torch's per-parameter state: `step` as one count, and each of SLOTS[kind] as a tree."""

    step: jax.Array
    slots: dict[str, Any]


# torch's state names (besides `step`) of each optimizer, as its state_dict() holds them.
SLOTS: dict[str, tuple[str, ...]] = {
    "RMSprop": ("square_avg", "grad_avg", "momentum_buffer"),
    "Adagrad": ("sum",),
    "Adamax": ("exp_avg", "exp_inf"),
    "Adadelta": ("square_avg", "acc_delta"),
    "NAdam": ("exp_avg", "exp_avg_sq", "mu_product"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
}


def slots_of(kind: str, h: dict) -> tuple[str, ...]:
    """The state tensors torch keeps for these hyperparameters (RMSprop keeps grad_avg only
    centred, momentum_buffer only with momentum; NAdam's mu_product is a scalar a weight)."""
    if kind == "RMSprop":
        return (
            ("square_avg",)
            + (("grad_avg",) if h.get("centered") else ())
            + (("momentum_buffer",) if h.get("momentum") else ())
        )
    return SLOTS[kind]


def torch_update(kind: str, h: dict) -> optax.GradientTransformation:
    """torch.optim.<kind>'s update with the group's hyperparameters `h` (torch's names)."""
    rule = RULES[kind]
    names = slots_of(kind, h)

    def init(params: Any) -> TorchOptState:
        slots = {n: jax.tree.map(functools.partial(initial, kind, n, h), params) for n in names}
        return TorchOptState(jnp.zeros((), jnp.int32), slots)

    def update(grads: Any, state: TorchOptState, params: Any = None) -> tuple[Any, TorchOptState]:
        step = (state.step + 1).astype(jnp.float32)
        wd = h.get("weight_decay", 0.0)
        decoupled = h.get("decoupled_weight_decay", False)

        def one(g, p, *slots):
            g = -g if h.get("maximize") else g
            if wd and not decoupled:
                g = g + wd * p
            u, new = rule(h, step, g, dict(zip(names, slots, strict=True)))
            if wd and decoupled:  # p (1 - lr wd) - lr u: the decay joins the update
                u = u + wd * p
            return u, tuple(new[n] for n in names)

        trees = [state.slots[n] for n in names]
        out = jax.tree.map(one, grads, params, *trees)  # a (update, slots) pair a leaf
        updates = jax.tree.map(lambda _, pair: pair[0], grads, out)
        slots = {
            n: jax.tree.map(functools.partial(_slot, i), grads, out) for i, n in enumerate(names)
        }
        return updates, TorchOptState(state.step + 1, slots)

    return optax.GradientTransformation(init, update)


def _slot(index: int, _: Any, pair: tuple) -> jax.Array:
    return pair[1][index]


def initial(kind: str, name: str, h: dict, p: jax.Array) -> jax.Array:
    if name == "sum":
        return jnp.full_like(p, h.get("initial_accumulator_value", 0.0))
    if name == "mu_product":
        return jnp.ones((), p.dtype)
    return jnp.zeros_like(p)


Rule = Callable[[dict, jax.Array, jax.Array, dict], tuple[jax.Array, dict]]


def rmsprop(h: dict, step: jax.Array, g: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    alpha, eps = h["alpha"], h["eps"]
    square = alpha * s["square_avg"] + (1 - alpha) * g * g
    new = {"square_avg": square}
    if h.get("centered"):
        mean = s["grad_avg"] + (1 - alpha) * (g - s["grad_avg"])  # torch's lerp
        new["grad_avg"] = mean
        avg = jnp.sqrt(square - mean * mean) + eps
    else:
        avg = jnp.sqrt(square) + eps
    if h.get("momentum"):
        buf = h["momentum"] * s["momentum_buffer"] + g / avg
        new["momentum_buffer"] = buf
        return buf, new
    return g / avg, new


def adagrad(h: dict, step: jax.Array, g: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    total = s["sum"] + g * g
    decay = 1.0 / (1.0 + (step - 1.0) * h.get("lr_decay", 0.0))
    return decay * g / (jnp.sqrt(total) + h["eps"]), {"sum": total}


def adamax(h: dict, step: jax.Array, g: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    b1, b2 = h["betas"]
    avg = s["exp_avg"] + (1 - b1) * (g - s["exp_avg"])
    inf = jnp.maximum(b2 * s["exp_inf"], jnp.abs(g) + h["eps"])
    return avg / ((1 - b1**step) * inf), {"exp_avg": avg, "exp_inf": inf}


def adadelta(h: dict, step: jax.Array, g: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    rho, eps = h["rho"], h["eps"]
    square = rho * s["square_avg"] + (1 - rho) * g * g
    delta = jnp.sqrt(s["acc_delta"] + eps) / jnp.sqrt(square + eps) * g
    acc = rho * s["acc_delta"] + (1 - rho) * delta * delta
    return delta, {"square_avg": square, "acc_delta": acc}


def nadam(h: dict, step: jax.Array, g: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    b1, b2 = h["betas"]
    decay = h.get("momentum_decay", 4e-3)
    mu = b1 * (1.0 - 0.5 * 0.96 ** (step * decay))
    mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * decay))
    product = s["mu_product"] * mu
    avg = s["exp_avg"] + (1 - b1) * (g - s["exp_avg"])
    square = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    denom = jnp.sqrt(square / (1 - b2**step)) + h["eps"]
    u = g * (1.0 - mu) / (1.0 - product) / denom
    u = u + avg * mu_next / (1.0 - product * mu_next) / denom
    return u, {"exp_avg": avg, "exp_avg_sq": square, "mu_product": product}


def radam(h: dict, step: jax.Array, g: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    b1, b2 = h["betas"]
    avg = s["exp_avg"] + (1 - b1) * (g - s["exp_avg"])
    square = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    corrected = avg / (1 - b1**step)
    correction2 = 1 - b2**step
    rho_inf = 2 / (1 - b2) - 1
    rho = rho_inf - 2 * step * b2**step / correction2
    rect = jnp.sqrt(
        jnp.maximum((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho), 0.0)
    )
    adaptive = jnp.sqrt(correction2) / (jnp.sqrt(square) + h["eps"])
    u = jnp.where(rho > 5.0, corrected * adaptive * rect, corrected)
    return u, {"exp_avg": avg, "exp_avg_sq": square}


RULES: dict[str, Rule] = {
    "RMSprop": rmsprop,
    "Adagrad": adagrad,
    "Adamax": adamax,
    "Adadelta": adadelta,
    "NAdam": nadam,
    "RAdam": radam,
}
