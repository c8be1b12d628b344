"""The jax backend's training step as one pure function (make_train_step), apart from torchax and
the run: forward, loss, gradients averaged over the devices, clipping, the optimizer, the EMA, and a
non-finite step skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accel.backends.jax.optimizer import OptaxGroups

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
    (shard=, tp=); `weight_shardings` (a `model` axis only): where the weights are while the
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
