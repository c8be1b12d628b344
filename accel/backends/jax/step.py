"""The jax backend's pure parts, apart from torchax and the run: torch and JAX values each way, a
torch optimizer translated to optax (one chain per param group, its state mapped onto torch's by
name), and the whole training step as one pure function (make_train_step). Part of jax.py, which
imports it once jax is known to be installed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accel.amp import AmpPolicy
from accel.config import ConfigError
from accel.optim import OptimizerSpec


# --- torch <-> jax ----------------------------------------------------------------------------
def jnp_dtype(dtype: torch.dtype) -> jnp.dtype:
    """The one place a torch dtype becomes a jnp one (JAX refuses torch dtypes in astype)."""
    table = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}
    if dtype not in table:
        raise ConfigError(f"the jax backend has no {dtype} floating-point mode")
    return jnp.dtype(table[dtype])


@dataclass(frozen=True)
class Precision:
    """An AMP level in jnp dtypes: what the step computes in, what weights and moments are
    stored in."""

    compute: jnp.dtype
    store: jnp.dtype

    @classmethod
    def of(cls, amp: AmpPolicy) -> Precision:
        low = jnp_dtype(amp.dtype)
        return cls(
            compute=jnp.dtype(jnp.float32) if amp.level == "O0" else low,
            store=low if amp.level == "O3" else jnp.dtype(jnp.float32),
        )


def to_jax(tensor: torch.Tensor, dtype: jnp.dtype | None = None) -> jax.Array:
    value = tensor.detach().cpu()
    array = jnp.asarray(value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy())
    return array if dtype is None else cast_floating(array, dtype)


def host_value(array: jax.Array) -> np.ndarray:
    """A replicated array's value on this host (across processes, the local copy: JAX will
    not fetch arrays that span other hosts' devices)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(array.addressable_data(0))


def to_torch(array: jax.Array) -> torch.Tensor:
    host = host_value(array)
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(host.copy())


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    dtype = jnp.dtype(dtype)  # a torch dtype raises here, not deep inside a trace
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


# --- optimizer: a torch optimizer's groups as optax transforms --------------------------------
class OptaxGroups:
    """torch.optim.AdamW, Adam and SGD as optax transforms, one chain per param group over that
    group's parameters (by name), so every group keeps its own hyperparameters and its state
    maps one to one onto torch's (`step`, `exp_avg`, `exp_avg_sq`; `momentum_buffer`). The
    learning rate is not part of a chain: the step multiplies each group's update by -lr, the
    rate being an argument of the step (a changing schedule never recompiles it)."""

    def __init__(self, spec: OptimizerSpec):
        refused = spec.refusals(translatable=True)
        if refused:
            raise ConfigError(
                f"the jax backend has no optax translation of {spec.kind} with "
                f"{', '.join(refused)}: use the eager, compile or xla backend"
            )
        self.spec = spec
        self.chains = [self._chain(g.hyper) for g in spec.groups]

    def _chain(self, h: dict) -> optax.GradientTransformation:
        decay = [optax.add_decayed_weights(h["weight_decay"])] if h.get("weight_decay") else []
        if self.spec.kind == "SGD":
            momentum = [optax.trace(h["momentum"], h["nesterov"])] if h.get("momentum") else []
            parts = [*decay, *momentum]  # torch's SGD: decay coupled to the gradient
            return optax.chain(*parts) if parts else optax.identity()
        b1, b2 = h["betas"]
        adam = optax.scale_by_adam(b1=b1, b2=b2, eps=h["eps"])
        if self.spec.kind == "AdamW" or h.get("decoupled_weight_decay"):
            return optax.chain(adam, *decay)  # decoupled: p -= lr * (adam + wd * p)
        return optax.chain(*decay, adam)  # Adam's L2: the decay joins the gradient

    def _split(self, tree: dict) -> list[dict]:
        return [{n: tree[n] for n in g.names} for g in self.spec.groups]

    def init(self, params: dict) -> tuple:
        return tuple(c.init(p) for c, p in zip(self.chains, self._split(params), strict=True))

    def update(self, grads: dict, state: tuple, params: dict, lrs: jax.Array) -> tuple:
        """(new params, new state); `lrs`: one rate per group."""
        new_params, new_state = dict(params), []
        parts = zip(self.chains, self._split(grads), state, self._split(params), strict=True)
        for i, (chain, g, s, p) in enumerate(parts):
            updates, s = chain.update(g, s, p)
            new_state.append(s)
            for n, u in updates.items():
                new_params[n] = (p[n] - lrs[i] * u).astype(p[n].dtype)
        return new_params, tuple(new_state)

    def rates(self, lr: float | list[float]) -> jax.Array:
        """One base rate (each group scaled by its lr_scale), or one rate per group."""
        if isinstance(lr, int | float):
            lr = [lr * g.lr_scale for g in self.spec.groups]
        return jnp.asarray(lr, jnp.float32)

    def to_torch(self, state: tuple) -> dict[str, dict[str, torch.Tensor]]:
        """torch's state by parameter name."""
        out = {}
        for g, s in zip(self.spec.groups, state, strict=True):
            adam = _find(s, optax.ScaleByAdamState)
            trace = _find(s, optax.TraceState)
            for n in g.names:
                if adam is not None:
                    step = torch.tensor(float(host_value(adam.count)))
                    out[n] = {
                        "step": step,
                        "exp_avg": to_torch(adam.mu[n]).float(),
                        "exp_avg_sq": to_torch(adam.nu[n]).float(),
                    }
                elif trace is not None:
                    out[n] = {"momentum_buffer": to_torch(trace.trace[n]).float()}
        return out

    def from_torch(self, saved: dict, params: dict, dtype: jnp.dtype) -> tuple:
        """A fresh state over `params`, with `saved` (torch's, by name) where it has a group's
        parameters (none: a checkpoint saved before the first step)."""
        state = []
        for g, s in zip(self.spec.groups, self.init(params), strict=True):
            if g.names and g.names[0] in saved:
                first = saved[g.names[0]]
                if "exp_avg" in first:
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


def _find(chain_state: tuple, kind: type) -> Any:
    return next((s for s in chain_state if isinstance(s, kind)), None)


def _replace(chain_state: tuple, kind: type, new: Any) -> tuple:
    return tuple(new if isinstance(s, kind) else s for s in chain_state)


# --- the step ---------------------------------------------------------------------------------
# (params, consts, batch, key) -> (loss, extras vector)
LossFnJax = Callable[[dict, dict, tuple, Any], Any]
TrainStep = Callable[..., tuple]


def make_train_step(
    loss_fn: LossFnJax,
    optimizer: OptaxGroups,
    mesh: Mesh,
    *,
    clip_grad: float = 0.0,
    seed: int = 0,
    remat: bool = False,
    grad_shardings: Any = None,
    weight_shardings: Any = None,
) -> TrainStep:
    """The whole optimizer step as one pure function (what torchax's make_train_step builds):

        (params, opt_state, ema, count, consts, batch, lrs, ema_decay)
            -> (params, opt_state, ema, count, [mean loss, 1.0 if applied else 0.0, *extras])

    `loss_fn` returns the loss, or (loss, extras): a scalar and a vector of the loss
    function's extras, averaged over micro-steps and devices as the loss is.

    `batch`: arrays [micro-steps, global batch, ...], split over the mesh's `data` axis; each
    device takes its part's gradients, then the explicit mean over the devices (shard_map +
    pmean, the xla backend's all-reduce). A mesh with a `model` axis too (tensor parallelism)
    runs the gradients as one program over the global batch instead, the weights split as
    `grad_shardings` says, and XLA's partitioner adds the collectives. Then torch's clipping,
    the optimizer (one rate per group, `lrs`), the EMA (empty `ema`: none), and a non-finite
    loss or gradient leaves everything as it was, with no host sync. `count` (updates applied)
    keys the random draws; `grad_shardings`: where the gradients go for a sharded update
    (--shard, --tp); `weight_shardings` (a `model` axis only): where the weights are while the
    gradients are computed."""
    base_key = jax.random.key(seed)

    def with_extras(*args):  # a loss alone, or (loss, extras vector)
        out = given(*args)
        return out if isinstance(out, tuple) else (out, jnp.zeros(0, jnp.float32))

    given, loss_fn = loss_fn, with_extras
    if remat:  # keep the layers' matmul outputs, recompute the rest (attention too)
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        loss_fn = jax.checkpoint(loss_fn, policy=policy)

    def mean_grads(params, consts, batch, key, constrain):
        """The loss, extras and gradients of `batch`, each averaged over its micro-steps."""

        def micro_step(carry, micro):
            part, index = micro
            key_i = jax.random.fold_in(key, index)
            value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, extras), grads = value_and_grad(params, consts, part, key_i)
            loss, grads = jax.tree.map(jnp.add, carry, (loss, grads))
            return (loss, constrain(grads)), extras  # extras stacked by scan

        zeros = (jnp.zeros((), jnp.float32), constrain(jax.tree.map(jnp.zeros_like, params)))
        steps = batch[0].shape[0]
        (loss, grads), extras = jax.lax.scan(micro_step, zeros, (batch, jnp.arange(steps)))
        loss, grads = jax.tree.map(lambda x: x / steps, (loss, grads))
        return loss, extras.mean(axis=0), grads

    def local_grads(params, consts, batch, count):
        # Random draws differ per step, device and micro-step, and follow from the seed and the
        # count alone (saved as the backend's random state).
        key = jax.random.fold_in(jax.random.fold_in(base_key, count), jax.lax.axis_index("data"))
        out = mean_grads(params, consts, batch, key, lambda grads: grads)
        # The explicit all-reduce: every device ends with the mean gradient of the global batch.
        return jax.lax.pmean(out, "data")

    def partitioned_grads(params, consts, batch, count):
        # One program over the global batch: the weights' shardings and the batch's decide each
        # device's part, and the partitioner adds the collectives. A shard_map would gather
        # every weight whole onto each device. No device index here: the draws follow from the
        # count and micro-step.
        batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P(None, "data")))
        if weight_shardings is not None:
            # FSDP's order: weights split over 'data' are gathered for the forward and their
            # gradients reduce-scattered back, each device keeping its part of the batch; left
            # free, the partitioner may gather the batch instead and run all of it on each
            # device.
            params = jax.lax.with_sharding_constraint(params, weight_shardings)
        return mean_grads(params, consts, batch, jax.random.fold_in(base_key, count), constrain)

    def constrain(grads):
        # The accumulated gradients stay split as the weights are, not gathered whole.
        if grad_shardings is None:
            return grads
        return jax.lax.with_sharding_constraint(grads, grad_shardings)

    rep = P()
    grads_fn = (
        partitioned_grads
        if "model" in mesh.axis_names
        else jax.shard_map(
            local_grads,
            mesh=mesh,
            check_vma=False,
            in_specs=(rep, rep, P(None, "data"), rep),  # every array of the batch split
            out_specs=(rep, rep, rep),
        )
    )

    def step(params, opt_state, ema, count, consts, batch, lrs, ema_decay):
        loss, extras, grads = grads_fn(params, consts, batch, count)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        grads, norm = torch_clip(grads, clip_grad)
        new_params, new_state = optimizer.update(grads, opt_state, params, lrs)
        new_ema = {
            n: e + (new_params[n].astype(jnp.float32) - e) * (1.0 - ema_decay)
            for n, e in ema.items()
        }
        # (optax.apply_if_finite checks the gradients only, and applies updates again after
        # max_consecutive_errors.)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm)
        params, opt_state, ema = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (new_params, new_state, new_ema),
            (params, opt_state, ema),
        )
        count = count + finite.astype(jnp.int32)
        head = jnp.stack([loss, finite.astype(jnp.float32)])
        return params, opt_state, ema, count, jnp.concatenate([head, extras])

    return step


def torch_clip(grads: dict, max_norm: float) -> tuple[dict, jax.Array]:
    """torch.nn.utils.clip_grad_norm_'s rule (scale by max_norm / (norm + 1e-6) where above),
    written out because optax.clip_by_global_norm divides by the norm alone: the two would part
    by 1e-6 relative a step. Returns the clipped gradients and the norm before clipping."""
    norm = optax.tree.norm(grads)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads), norm
