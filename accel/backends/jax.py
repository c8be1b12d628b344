"""JAX backend: the same torch model lowered to JAX by torchax and compiled by XLA (CPU, GPU, TPU).

The training step is one pure function under jax.jit: forward, soft-target loss, JAX autodiff,
an explicit gradient mean over the devices of a 1-D 'data' mesh (shard_map + pmean, the same
contract as the xla backend's all-reduce), then optax AdamW. Weights and optimizer state are
donated. The learning rate comes in as an argument each step, read from the same timm schedule as
the torch backends, so it never triggers a recompile.

One process drives its local devices (`--nproc_per_node` of them). Multi-host: start one process
per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set; the backend calls
jax.distributed.initialize(), the mesh spans every host's devices and each process feeds its shard.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from accel.amp import amp_policy
from accel.backends.base import BackendUnavailable, Batch, StepResult
from accel.config import ConfigError, RunConfig
from accel.distributed import DistContext
from accel.optim import decay_mask, weight_decay_groups
from models.factory import ImageClassifier

INSTALL = "pip install 'accel[jax]' (jax, torchax, optax)"
KERNEL_OPTS = "scaled_dot_product_attention through jax.nn.dot_product_attention (cuDNN on GPU)"

try:
    import jax
    import jax.numpy as jnp
    import optax
    import torchax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop
    from torchax.ops import ops_registry
    from torchax.tensor import OperatorNotFound
except ImportError:  # reported by require() as one line with the install command
    jax = None


def require() -> None:
    if jax is None:
        raise BackendUnavailable(f"the jax backend needs jax, torchax and optax: {INSTALL}")


def build(cfg: RunConfig, ctx: DistContext) -> JaxBackend:
    return JaxBackend(cfg, ctx)


def launch_replicas(cfg: RunConfig, fn: Callable[[int, RunConfig], Any]) -> None:
    """One process drives all its local devices: no extra processes to start."""
    fn(0, cfg)


def replica_context() -> DistContext:
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and not jax.distributed.is_initialized():
        jax.distributed.initialize()
    return DistContext(jax.process_index(), 0, jax.process_count())


# --- torch <-> jax --------------------------------------------------------------------------
def to_jax(tensor: torch.Tensor, dtype=None) -> jax.Array:
    value = tensor.detach().cpu()
    array = jnp.asarray(value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy())
    return array if dtype is None else cast_floating(array, dtype)


def to_torch(array: jax.Array) -> torch.Tensor:
    host = np.asarray(jax.device_get(array))
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(host.copy())


def cast_floating(tree: Any, dtype) -> Any:
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


# --- attention override (--kernel-opt) ------------------------------------------------------
def _jax_attention(query, key, value, mask, scale, is_causal):
    """torch's [B, heads, T, D] in and out; jax.nn.dot_product_attention takes [B, T, heads, D]."""
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
    bias = boolean = None
    if mask is not None:
        boolean, bias = (mask, None) if mask.dtype == jnp.bool_ else (None, mask.astype(q.dtype))
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=boolean, scale=scale, is_causal=is_causal
    )
    return jnp.swapaxes(out, 1, 2)


def _sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if dropout_p:
        raise NotImplementedError("--kernel-opt attention on jax has no attention dropout")
    return interop.call_jax(_jax_attention, query, key, value, attn_mask, scale, is_causal)


@contextlib.contextmanager
def attention_override(env, enabled: bool):
    """Route torch's SDPA to jax.nn.dot_product_attention while tracing, then restore."""
    ops = (
        torch.nn.functional.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
    )
    saved = {op: env._ops.get(op) for op in ops}
    if enabled:
        for op in ops:
            # What env.override_op_definition does; torchax 0.0.13's version omits is_view_op.
            env._ops[op] = ops_registry.Operator(
                op,
                _sdpa,
                is_jax_function=False,
                is_user_defined=True,
                needs_env=False,
                is_view_op=False,
            )
    try:
        yield
    finally:
        if enabled:
            env._ops.update(saved)


# --- optimizer --------------------------------------------------------------------------------
def optax_adamw(cfg: RunConfig, mask: dict[str, bool]) -> optax.GradientTransformation:
    """torch.optim.AdamW as optax pieces; the step multiplies the result by -lr (the schedule
    is an argument of the step, not part of the state)."""
    parts = [optax.clip_by_global_norm(cfg.optim.clip_grad)] if cfg.optim.clip_grad > 0 else []
    b1, b2 = cfg.optim.betas
    parts += [
        optax.scale_by_adam(b1=b1, b2=b2, eps=1e-8),
        optax.add_decayed_weights(cfg.optim.weight_decay, mask),
    ]
    return optax.chain(*parts)


def adam_state(opt_state: tuple) -> optax.ScaleByAdamState:
    return next(s for s in opt_state if isinstance(s, optax.ScaleByAdamState))


def replace_adam_state(opt_state: tuple, new: optax.ScaleByAdamState) -> tuple:
    return tuple(new if isinstance(s, optax.ScaleByAdamState) else s for s in opt_state)


# --- input pipeline ---------------------------------------------------------------------------
class DevicePrefetcher:
    """Puts host batches on the devices, sharded along the batch, `depth` batches ahead in a
    background thread: the MpDeviceLoader of this backend (JAX itself ships no data loader)."""

    _END = object()

    def __init__(self, batches: Iterable[Batch], put: Callable[[Batch], Any], depth: int):
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.thread = threading.Thread(target=self._fill, args=(batches, put), daemon=True)
        self.thread.start()

    def _fill(self, batches: Iterable[Batch], put: Callable[[Batch], Any]) -> None:
        try:
            for batch in batches:
                self.queue.put(put(batch))
        except BaseException as err:  # handed to the consumer, raised there
            self.queue.put(err)
        self.queue.put(self._END)

    def __iter__(self) -> Iterator[Any]:
        while (item := self.queue.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            yield item


class JaxBackend:
    name = "jax"

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        if cfg.amp_level != "O0" and cfg.amp_dtype != "bfloat16":
            raise ConfigError("the jax backend does low precision in bfloat16 (--amp_dtype)")
        self.cfg, self.ctx = cfg, ctx
        self.amp = amp_policy(cfg.amp_level, cfg.amp_dtype)
        jax.config.update("jax_compilation_cache_dir", str(cfg.compile_cache_dir()))
        devices = jax.devices() if jax.process_count() > 1 else jax.local_devices()
        self.local_replicas = cfg.nproc_per_node
        if self.local_replicas > jax.local_device_count():
            raise ConfigError(
                f"--nproc_per_node {self.local_replicas} exceeds the {jax.local_device_count()} "
                "local JAX devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
            )
        self.mesh = Mesh(np.array(devices[: self.local_replicas * jax.process_count()]), ("data",))
        self.replicated = NamedSharding(self.mesh, P())
        self.env = torchax.default_env()
        self.compiles_at_warmup: int | None = None
        self.base_key = jax.random.key(cfg.seed)

    # --- set-up -------------------------------------------------------------------------------
    def setup(self, model: ImageClassifier) -> None:
        self.module = model  # torch side: names, shapes, checkpoint layout; traced, never run
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        store = self.amp.dtype if self.amp.level == "O3" else jnp.float32
        params = {n: to_jax(p, store) for n, p in model.named_parameters() if p.requires_grad}
        buffers = {n: to_jax(b) for n, b in model.named_buffers()}
        self.params = jax.device_put(params, self.replicated)
        self.buffers = jax.device_put(buffers, self.replicated)
        self.optimizer = optax_adamw(self.cfg, decay_mask(model))
        self.opt_state = jax.device_put(self.optimizer.init(self.params), self.replicated)
        self.forward = interop.jax_view(self._torch_forward)
        self.step_fn = jax.jit(self._sharded_step(), donate_argnums=(0, 1))
        self.eval_fn = jax.jit(self._eval_sums)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))

    def _torch_forward(self, params: dict, buffers: dict, images: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.module, {**params, **buffers}, (images,))

    def logits(self, params: dict, buffers: dict, images: jax.Array, key=None) -> jax.Array:
        """Train mode when a PRNG key is given: stochastic depth and dropout draw from it."""
        if self.amp.autocast:  # O1/O2: compute in bf16 from the fp32 master weights
            params, buffers = cast_floating((params, buffers), self.amp.dtype)
        self.module.train(key is not None)  # read while tracing
        randomness = (
            contextlib.nullcontext() if key is None else self.env.override_property(prng=key)
        )
        with self.env, randomness:
            return self.forward(params, buffers, images).astype(jnp.float32)

    # --- the step -----------------------------------------------------------------------------
    def _loss(self, params: dict, buffers: dict, images, targets, key) -> jax.Array:
        logp = jax.nn.log_softmax(self.logits(params, buffers, images, key), axis=-1)
        return -(targets * logp).sum(-1).mean()

    def _local_step(self, params, opt_state, buffers, images, targets, lr):
        """One optimizer step on this device's shard; `images` is [micro-steps, batch, ...]."""
        # Random draws differ per step, device and micro-step, and follow from the seed and the
        # optimizer's step count alone: a resumed run draws the same ones, with no state to save.
        key = jax.random.fold_in(self.base_key, adam_state(opt_state).count)
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))

        def micro_step(carry, batch):
            images, targets, index = batch
            loss, grads = jax.value_and_grad(self._loss)(
                params, buffers, images, targets, jax.random.fold_in(key, index)
            )
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        micro_steps = jnp.arange(images.shape[0])
        (loss, grads), _ = jax.lax.scan(micro_step, zeros, (images, targets, micro_steps))
        loss, grads = jax.tree.map(lambda x: x / images.shape[0], (loss, grads))
        # The explicit all-reduce: every device ends with the mean gradient of the global batch.
        loss, grads = jax.lax.pmean((loss, grads), "data")
        updates, new_state = self.optimizer.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        # A non-finite loss or gradient leaves weights and optimizer state as they were, with no
        # host sync. (optax.apply_if_finite checks the gradients only, and applies updates again
        # after max_consecutive_errors.)
        finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (new_params, new_state),
            (params, opt_state),
        )
        return params, opt_state, jnp.stack([loss, finite.astype(jnp.float32)])

    def _sharded_step(self):
        rep, data = P(), P(None, "data")
        return jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            check_vma=False,
            in_specs=(rep, rep, rep, data, data, rep),
            out_specs=(rep, rep, rep),
        )

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[tuple]:
        return iter(DevicePrefetcher(batches, self._put, self.cfg.device_prefetch))

    def _put(self, batch: Batch) -> tuple:
        arrays = (batch[0].numpy(), batch[1].numpy())
        if jax.process_count() > 1:
            return tuple(
                jax.make_array_from_process_local_data(self.batch_sharding, a) for a in arrays
            )
        return tuple(jax.device_put(a, self.batch_sharding) for a in arrays)

    def train_step(self, micro_batches: list[tuple], lr: float) -> jax.Array:
        """Returns [mean loss, 1.0 if the update was applied else 0.0] on the devices."""
        images = jnp.stack([m[0] for m in micro_batches])
        targets = jnp.stack([m[1] for m in micro_batches])
        with attention_override(self.env, self.cfg.kernel_opt):
            try:
                self.params, self.opt_state, result = self.step_fn(
                    self.params, self.opt_state, self.buffers, images, targets, jnp.float32(lr)
                )
            except OperatorNotFound as err:
                raise BackendUnavailable(
                    f"torchax cannot lower an op of {self.cfg.model.name}: {err}; "
                    "train it with --backend eager, compile or xla"
                ) from None
        return result

    def fetch_results(self, handles: list[jax.Array]) -> list[StepResult]:
        rows = jax.device_get(handles)
        return [StepResult(float(loss), bool(applied > 0)) for loss, applied in rows]

    # --- evaluation ---------------------------------------------------------------------------
    def _eval_sums(self, params, buffers, images, labels, mask):
        logits = self.logits(params, buffers, images)
        loss = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[:, None], -1)[:, 0]
        correct = (logits.argmax(-1) == labels).astype(jnp.float32)
        mask = mask.astype(jnp.float32)
        return jnp.stack([(loss * mask).sum(), (correct * mask).sum(), mask.sum()])

    def evaluate(self, batches: Iterable[dict]) -> dict[str, float]:
        sums = jnp.zeros(3, jnp.float32)
        with attention_override(self.env, self.cfg.kernel_opt):
            for batch in batches:
                arrays = [
                    jax.device_put(batch[k].numpy(), self.batch_sharding)
                    for k in ("images", "labels", "mask")
                ]
                sums = sums + self.eval_fn(self.params, self.buffers, *arrays)
        loss_sum, correct, count = (float(x) for x in jax.device_get(sums))
        count = max(count, 1.0)
        return {
            "eval_loss": loss_sum / count,
            "eval_acc": correct / count,
            "eval_images": int(count),
        }

    # --- state: the torch backends' checkpoint format ----------------------------------------
    def _torch_order(self) -> list[str]:
        """Parameter names in the order torch.optim.AdamW numbers them."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        groups = weight_decay_groups(self.module, self.cfg.optim.weight_decay)
        return [names[id(p)] for g in groups for p in g["params"]]

    def _param_groups(self) -> list[dict]:
        groups = weight_decay_groups(self.module, self.cfg.optim.weight_decay)
        template = torch.optim.AdamW(groups, lr=self.cfg.optim.lr, betas=self.cfg.optim.betas)
        return template.state_dict()["param_groups"]

    def state_dict(self) -> dict[str, Any]:
        values = {**self.buffers, **self.params}
        # The torch module's own dtypes (fp32 weights, int64 indices; JAX keeps int32).
        model = {
            k: to_torch(values[k]).to(ref.dtype) for k, ref in self.module.state_dict().items()
        }
        adam = adam_state(self.opt_state)
        step = torch.tensor(float(jax.device_get(adam.count)))
        state = {
            i: {
                "step": step.clone(),
                "exp_avg": to_torch(adam.mu[n]).float(),
                "exp_avg_sq": to_torch(adam.nu[n]).float(),
            }
            for i, n in enumerate(self._torch_order())
        }
        return {"model": model, "optimizer": {"state": state, "param_groups": self._param_groups()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        store = self.amp.dtype if self.amp.level == "O3" else jnp.float32
        params = {n: to_jax(state["model"][n], store) for n in self.param_names}
        self.params = jax.device_put(params, self.replicated)
        saved = state["optimizer"]["state"]
        order = self._torch_order()
        adam = adam_state(self.optimizer.init(self.params))
        if saved:
            step = int(saved[0]["step"])
            mu = {n: to_jax(saved[i]["exp_avg"], store) for i, n in enumerate(order)}
            nu = {n: to_jax(saved[i]["exp_avg_sq"], store) for i, n in enumerate(order)}
            adam = optax.ScaleByAdamState(count=jnp.asarray(step, jnp.int32), mu=mu, nu=nu)
        opt_state = replace_adam_state(self.optimizer.init(self.params), adam)
        self.opt_state = jax.device_put(opt_state, self.replicated)

    def rng_state(self) -> dict[str, Any]:
        """None to save: the step's keys follow from the seed and the optimizer's step count."""
        return {}

    def load_rng_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see rng_state)."""

    # --- bookkeeping --------------------------------------------------------------------------
    def synchronize(self) -> None:
        jax.block_until_ready(self.params)

    def mark_warmup_done(self) -> None:
        self.compiles_at_warmup = self.step_fn._cache_size()

    def stats(self) -> dict[str, Any]:
        compiled = self.step_fn._cache_size()
        after = 0 if self.compiles_at_warmup is None else compiled - self.compiles_at_warmup
        return {
            "compiles_after_warmup": after,
            "graphs_compiled": compiled,
            "fallback_ops": {},
            "devices": self.local_replicas * jax.process_count(),
            "device_kind": jax.devices()[0].device_kind,
        }
