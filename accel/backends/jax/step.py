"""The jax backend's training step as one pure function (make_train_step), apart from torchax and
the run: forward, loss, gradients averaged over the devices, clipping, the optimizer, the EMA, and a
non-finite step skipped."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accel.backends.base import group_divisor, replica_seed
from accel.backends.jax.optimizer import OptaxGroups
from accel.parallel.mesh import Axis

# (params, consts, batch, key) -> loss, (loss, extras vector) or (loss, extras, consts written)
LossFnJax = Callable[[dict, dict, tuple, Any], Any]
TrainStep = Callable[..., tuple]


def make_train_step(
    loss_fn: LossFnJax,
    optimizer: OptaxGroups,
    mesh: Mesh,
    *,
    clip_grad: float = 0.0,
    seed: int = 0,
    grad_shardings: Any = None,
    weight_shardings: Any = None,
    unread: Callable[[], Collection[str]] = frozenset,
    frozen: Collection[str] = frozenset(),
    accum: int = 1,
) -> TrainStep:
    """The whole optimizer step as one pure function (what torchax's make_train_step builds):

        (params, opt_state, ema, count, consts, batch, rates, ema_decay)
            -> (params, opt_state, ema, count, consts,
                [mean loss, 1.0 if applied else 0.0, *extras])

    `loss_fn` returns the loss, or (loss, extras): a scalar and a vector of the loss
    function's extras, averaged over micro-steps and devices as the loss is; or (loss, extras,
    written): the constants the forward wrote ({name: array}: BatchNorm's running statistics),
    carried from one micro-step to the next as eager's forwards write them, their mean over the
    devices kept (each device's batch updates them), whether or not the update is applied (as
    eager's forward wrote them before the update was skipped). `unread()`, asked once the loss
    is traced: the weights the loss did not read, left as they are by the update (no weight
    decay, no moments), as torch's optimizers leave a parameter without a gradient; `frozen`:
    weights that no longer require a gradient, left so too, and out of the clipping norm.
    `accum`: the micro-steps of a whole group; a shorter one's gradients weigh their share of
    it, as the plain loop's (base.group_divisor).

    `batch`: arrays [micro-steps, global batch, ...], split over the mesh's `dp` axis; each
    device takes its part's gradients, then the explicit mean over the devices (shard_map +
    pmean, the xla backend's all-reduce). A mesh with a tensor axis too (tensor parallelism)
    runs the gradients as one program over the global batch instead, the weights split as
    `grad_shardings` says, and XLA's partitioner adds the collectives. Then torch's clipping,
    the optimizer (`rates`: by name, one value per group), the EMA (empty `ema`: none), and
    a non-finite loss or gradient leaves everything as it was, with no host sync. `count`
    (updates applied) keys the random draws; `grad_shardings`: where the gradients go for a
    sharded update (shard=, tp=); `weight_shardings` (a tensor axis only): where the weights
    are while the gradients are computed."""
    parts = StepParts(
        loss_fn, optimizer, mesh, clip_grad, seed, grad_shardings, weight_shardings, unread,
        frozenset(frozen), accum,
    )  # fmt: skip
    return parts.step


class StepParts:
    """make_train_step's step and the parts it is made of, each a method a reader can call on
    its own (under jax.jit, or jax.make_jaxpr): the gradients of a group of micro-batches
    (`mean_grads`, `ragged_grads`), over the devices three ways (`one_device_grads`,
    `replica_grads` with `local_grads` on each device, `partitioned_grads`), and `step`."""

    def __init__(
        self,
        loss_fn: LossFnJax,
        optimizer: OptaxGroups,
        mesh: Mesh,
        clip_grad: float,
        seed: int,
        grad_shardings: Any,
        weight_shardings: Any,
        unread: Callable[[], Collection[str]],
        frozen: frozenset[str],
        accum: int,
    ):
        self.given_loss, self.optimizer, self.mesh = loss_fn, optimizer, mesh
        self.clip_grad, self.accum, self.unread, self.frozen = clip_grad, accum, unread, frozen
        self.grad_shardings, self.weight_shardings = grad_shardings, weight_shardings
        self.data = mesh.axis_names[0]  # the batch's axis (dp, or fsdp where the weights split too)
        # Each data replica's stream of draws, from prepare's seed and its index, as every backend
        # derives it (replica_seed); a replica's draws then follow from the step count alone.
        self.replica_keys = jnp.stack(
            [jax.random.key(replica_seed(seed, r)) for r in range(mesh.shape[self.data])]
        )
        self.written_names: set[str] = set()  # the constants the loss writes, known once traced
        # The gradients' norm as one reduction where every gradient is whole on each device;
        # split ones (FSDP, tensor parallel) keep a norm per weight, reduced where each part lies.
        self.whole = grad_shardings is None or all(
            s.is_fully_replicated for s in jax.tree.leaves(grad_shardings)
        )

    def loss_fn(self, *args):
        """The given loss as (loss, (extras vector, constants written))."""
        out = self.given_loss(*args)
        loss, extras, written = (*out, {})[:3] if isinstance(out, tuple) else (out, None, {})
        self.written_names.update(written)
        return loss, (jnp.zeros(0, jnp.float32) if extras is None else extras, written)

    def mean_grads(self, params, consts, batch, key, constrain):
        """The loss, extras and gradients of `batch`, each averaged over its micro-steps, and
        the constants as the micro-steps' forwards left them."""
        if ragged(batch):  # micro-batches of different sizes: each traced on its own
            return self.ragged_grads(params, consts, batch, key, constrain)
        value_and_grad = jax.value_and_grad(self.loss_fn, has_aux=True)
        steps = batch[0].shape[0]
        divisor = group_divisor(steps, self.accum)  # a short group weighs steps/accum
        if steps == 1:  # no accumulation: the one micro-step as it is, no loop around it
            one = tuple(t[0] for t in batch)
            key_0 = jax.random.fold_in(key, 0)  # the draws a first micro-step makes
            (loss, (extras, written)), grads = value_and_grad(params, consts, one, key_0)
            grads = jax.tree.map(lambda g: g / divisor, grads) if divisor > 1 else grads
            return loss, extras, constrain(grads), {**consts, **written}

        def micro_step(carry, micro):
            loss_sum, grads_sum, consts = carry
            part, index = micro
            key_i = jax.random.fold_in(key, index)
            (loss, (extras, written)), grads = value_and_grad(params, consts, part, key_i)
            loss, grads = jax.tree.map(jnp.add, (loss_sum, grads_sum), (loss, grads))
            return (loss, constrain(grads), {**consts, **written}), extras  # extras stacked

        zeros = (jnp.zeros((), jnp.float32), constrain(jax.tree.map(jnp.zeros_like, params)))
        micro = (batch, jnp.arange(steps))
        (loss, grads, consts), extras = jax.lax.scan(micro_step, (*zeros, consts), micro)
        grads = jax.tree.map(lambda g: g / divisor, grads)
        return loss / steps, extras.mean(axis=0), grads, consts

    def ragged_grads(self, params, consts, batch, key, constrain):
        """mean_grads for a tuple of micro-batches whose sizes differ (the epoch's last one
        ragged): a micro-step each, in order, unrolled."""
        divisor = group_divisor(len(batch), self.accum)
        value_and_grad = jax.value_and_grad(self.loss_fn, has_aux=True)
        losses, grads_sum, extras_all = [], None, []
        for index, part in enumerate(batch):
            key_i = jax.random.fold_in(key, index)
            (loss, (extras, written)), grads = value_and_grad(params, consts, part, key_i)
            grads_sum = grads if grads_sum is None else jax.tree.map(jnp.add, grads_sum, grads)
            consts = {**consts, **written}
            losses.append(loss)
            extras_all.append(extras)
        grads = constrain(jax.tree.map(lambda g: g / divisor, grads_sum))
        return jnp.mean(jnp.stack(losses)), jnp.stack(extras_all).mean(axis=0), grads, consts

    def local_grads(self, params, consts, batch, count):
        """One device's part, inside replica_grads' shard_map, then the explicit all-reduce:
        every device ends with the mean gradient of the global batch, and the mean of the
        statistics each device's forward wrote. Random draws differ per step, device and
        micro-step, and follow from the seed and the count alone (the backend's random state)."""
        key = jax.random.fold_in(self.replica_keys[jax.lax.axis_index(self.data)], count)
        loss, extras, grads, consts = self.mean_grads(params, consts, batch, key, unchanged)
        written = {
            n: jax.lax.pmean(v, self.data) if jnp.issubdtype(v.dtype, jnp.floating) else v
            for n, v in consts.items()
            if n in self.written_names
        }
        loss, extras, grads = jax.lax.pmean((loss, extras, grads), self.data)
        return loss, extras, grads, {**consts, **written}

    def replica_grads(self, params, consts, batch, count):
        """Whole replicas on the devices: every array of the batch split along its batch axis
        (the second, after micro-steps), local_grads on each device."""
        spec, rep = (P(self.data) if ragged(batch) else P(None, self.data)), P()
        return jax.shard_map(
            self.local_grads, mesh=self.mesh, check_vma=False,
            in_specs=(rep, rep, spec, rep), out_specs=(rep, rep, rep, rep),
        )(params, consts, batch, count)  # fmt: skip

    def partitioned_grads(self, params, consts, batch, count):
        """A mesh with a tensor axis: one program over the global batch, where the weights'
        shardings and the batch's decide each device's part and the partitioner adds the
        collectives (a shard_map would gather every weight whole onto each device). No device
        index here: the draws follow from the count and micro-step."""
        spec = P(self.data) if ragged(batch) else P(None, self.data)
        batch = jax.lax.with_sharding_constraint(batch, NamedSharding(self.mesh, spec))
        if self.weight_shardings is not None:
            # FSDP's order: weights split over the data axis are gathered for the forward and
            # their gradients reduce-scattered back, each device keeping its part of the batch;
            # left free, the partitioner may gather the batch instead and run all of it on each
            # device.
            params = jax.lax.with_sharding_constraint(params, self.weight_shardings)
        key = jax.random.fold_in(self.replica_keys[0], count)
        constrain = functools.partial(kept_split, shardings=self.grad_shardings)
        return self.mean_grads(params, consts, batch, key, constrain)

    def one_device_grads(self, params, consts, batch, count):
        """One device: the mean over the devices is the device's own (no collective)."""
        key = jax.random.fold_in(self.replica_keys[0], count)
        return self.mean_grads(params, consts, batch, key, unchanged)

    def grads(self, params, consts, batch, count):
        """The loss, extras, mean gradients and constants written, as the mesh asks."""
        if Axis.TENSOR in self.mesh.axis_names:
            return self.partitioned_grads(params, consts, batch, count)
        if self.mesh.size == 1:
            return self.one_device_grads(params, consts, batch, count)
        return self.replica_grads(params, consts, batch, count)

    def step(self, params, opt_state, ema, count, consts, batch, rates, ema_decay):
        """The whole optimizer step (make_train_step's)."""
        loss, extras, grads, consts = self.grads(params, consts, batch, count)
        if self.grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
        if self.frozen:  # torch gives a frozen weight no gradient: nothing of it in the norm
            grads = {n: jnp.zeros_like(g) if n in self.frozen else g for n, g in grads.items()}
        grads, norm = torch_clip(grads, self.clip_grad, one_reduction=self.whole)
        new_params, new_state = self.optimizer.update(grads, opt_state, params, rates)
        left = set(self.unread()) | set(self.frozen)  # asked now: the loss was traced above
        if left:
            new_params, new_state = keep_named(left, (new_params, new_state), (params, opt_state))
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
        return params, opt_state, ema, count, consts, jnp.concatenate([head, extras])


def kept_split(grads: Any, shardings: Any) -> Any:
    """The accumulated gradients kept split as the weights are (`shardings`; None: whole), not
    gathered whole."""
    return grads if shardings is None else jax.lax.with_sharding_constraint(grads, shardings)


def unchanged(grads: Any) -> Any:
    """The gradients as they are (where nothing splits them: one device, or a replica's)."""
    return grads


def ragged(batch: tuple) -> bool:
    """Whether a step's batch is a tuple of micro-batches (of different sizes) rather than
    arrays stacked [micro-steps, batch, ...]."""
    return bool(batch) and isinstance(batch[0], tuple)


def keep_named(names: Collection[str], new: Any, old: Any) -> Any:
    """`new`, except where a leaf sits under one of `names` as a dict key (the weights, and
    optax's moments, which it keys as the weights): there `old`'s."""

    def pick(path: tuple, new_leaf, old_leaf):
        keyed = {p.key for p in path if isinstance(p, jax.tree_util.DictKey)}
        return old_leaf if keyed & set(names) else new_leaf

    return jax.tree_util.tree_map_with_path(pick, new, old)


def global_norm(grads: Any, one_reduction: bool = True) -> jax.Array:
    """The 2-norm of every gradient together. `one_reduction`: as one sum over all of them
    (their concatenation, which XLA fuses into the reduction: a kernel or a few for the whole
    model, where optax.tree.norm's sum per weight is a kernel each, 174 of Swin-T's step on a
    GPU); else optax's."""
    if not one_reduction:
        return optax.tree.norm(grads)
    leaves = [g.ravel().astype(jnp.float32) for g in jax.tree.leaves(grads)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(jnp.concatenate(leaves))))


def torch_clip(grads: dict, max_norm: float, one_reduction: bool = True) -> tuple[dict, jax.Array]:
    """torch.nn.utils.clip_grad_norm_'s rule (scale by max_norm / (norm + 1e-6) where above),
    written out because optax.clip_by_global_norm divides by the norm alone: the two would part
    by 1e-6 relative a step. Returns the clipped gradients and the norm before clipping (the
    norm as global_norm takes it)."""
    norm = global_norm(grads, one_reduction)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads), norm
