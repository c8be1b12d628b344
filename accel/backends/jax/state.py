"""How the jax backend lays out what it trains: the weights, optimizer state, EMA and constants
as arrays on the mesh (ArrayLayout: which array splits over which mesh axis), kept by the torch
model's parameter names for checkpoints, with the step count the random keys follow from."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accel.backends.as_eager import running_stat_names
from accel.backends.jax.optimizer import OptaxGroups
from accel.backends.jax.runtime import Runtime
from accel.backends.jax.values import Precision, host_value, to_jax, to_torch
from accel.config import BackendConfig
from accel.parallel.mesh import Axis
from accel.parallel.tensor_parallel import resolve_plan, weight_splits
from accel.ties import tied_names


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays (its shards of split ones); the gradients
    live only inside the compiled step."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


class ArrayLayout:
    """Where each array lives on the mesh: the weights (`params`), their gradients (`grads`),
    the optimizer state (`opt`), the weights while the step computes (`weights`; None: as
    stored) and the EMA (`ema`). With shard='full' the weights split over the data axis; with
    'grad_op' the gradients and moments only; with tp= the plan's layers split over 'tp' too."""

    def __init__(
        self, runtime: Runtime, model: torch.nn.Module, params: dict, cfg: BackendConfig, opt: Any
    ):
        self.mesh, self.replicated, shard = runtime.mesh, runtime.replicated, runtime.shard
        self.data = runtime.data_axis
        if runtime.dims.tp > 1:
            plan = resolve_plan(model, cfg.mesh.tp_plan, runtime.dims.tp)
            splits = weight_splits(model, plan)
            self.params = self.tp_shardings(params, splits, shard == "full")
            # grad_op: the weights split over 'tp' only, their gradients and moments over
            # the data axis too.
            self.grads = self.tp_shardings(params, splits, shard != "none")
            self.opt = self.state_shardings(opt, params, self.grads)
            # While the step computes: split over 'tp' only.
            self.weights: dict | None = self.tp_shardings(params, splits, False)
        else:
            self.params = self.shardings(params, shard == "full")
            self.grads = self.params
            self.weights = None
            self.opt = self.shardings(opt, shard != "none")
        self.ema = self.params if cfg.step.ema else {}

    def shardings(self, tree: Any, split: bool) -> Any:
        """Per leaf: split along its first axis over the mesh's data axis where `split` and that
        axis divides evenly, else a full copy on each device. XLA then gathers the weights for
        the step and reduce-scatters the gradients onto the shards."""
        n = self.mesh.size

        def sharding(leaf) -> NamedSharding:
            if split and leaf.ndim and leaf.shape[0] % n == 0:
                return NamedSharding(self.mesh, P(self.data))
            return self.replicated

        return jax.tree.map(sharding, tree)

    def tp_shardings(self, params: dict, splits: dict[str, int], data: bool) -> dict:
        """Per weight: its tensor-parallel split (`splits`: name -> axis) over the `model` mesh
        axis, and where `data`, the first other axis the data axis's size divides split over
        it (FSDP across the data groups: a colwise weight [out, in] is P('tp', 'fsdp'), a
        rowwise one P('fsdp', 'tp')); an axis nothing divides stays whole."""
        size = self.mesh.shape[self.data]

        def sharding(name: str, leaf) -> NamedSharding:
            axes: list[str | None] = [None] * leaf.ndim
            if name in splits:
                axes[splits[name]] = Axis.TENSOR
            if data:
                free = [i for i, n in enumerate(leaf.shape) if axes[i] is None and n % size == 0]
                if free:
                    axes[free[0]] = self.data
            return NamedSharding(self.mesh, P(*axes))

        return {name: sharding(name, leaf) for name, leaf in params.items()}

    def state_shardings(self, state: Any, params: dict, by_name: dict[str, NamedSharding]) -> Any:
        """The optimizer state laid out as its weights: a leaf under a weight's name (optax
        keeps moments in dicts keyed as the weights), of that weight's shape, takes its
        sharding; the rest (step counts) is replicated."""

        def sharding(path: tuple, leaf) -> NamedSharding:
            last = path[-1] if path else None
            name = last.key if isinstance(last, jax.tree_util.DictKey) else None
            if name in by_name and leaf.shape == params[name].shape:
                return by_name[name]
            return self.replicated

        return jax.tree_util.tree_map_with_path(sharding, state)


class TrainState:
    """The arrays the step trains and reads, laid out by `layout`: the trained weights
    (`params`), the optimizer state, the EMA (fp32; empty without one), the count of updates
    applied (the random keys follow from it and the seed) and the constants (`buffers`:
    buffers and frozen weights). Read and loaded by the torch model's names, as the torch
    backends keep them."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptaxGroups,
        precision: Precision,
        runtime: Runtime,
        cfg: BackendConfig,
    ):
        self.optimizer, self.precision, self.replicated = optimizer, precision, runtime.replicated
        # Its tensors' names and dtypes (fp32 weights, int64 indices; JAX keeps int32), read
        # once: the Engine keeps the user's model current when its state_dict() is read.
        self.state_dtypes = {k: t.dtype for k, t in model.state_dict().items()}
        # A tensor held under two names (tied weights) is one array, under its first name.
        self.aliases = tied_names(model)
        trained = {n for g in optimizer.spec.groups for n in g.names}
        store = precision.store
        params = {n: to_jax(p, store) for n, p in model.named_parameters() if n in trained}
        # Everything else the model holds (buffers, frozen weights) goes in as constants,
        # running statistics in fp32 whatever the weights are stored in (as eager keeps them).
        full = running_stat_names(model)
        held = {**model.state_dict(keep_vars=True), **dict(model.named_buffers())}
        consts = {
            n: to_jax(t, None if n in full else store)
            for n, t in held.items()
            if n not in trained and n not in self.aliases
        }
        self.param_names = [n for n, _ in model.named_parameters() if n in trained]
        state_shapes = jax.eval_shape(optimizer.init, params)
        self.layout = ArrayLayout(runtime, model, params, cfg, state_shapes)
        self.params = jax.device_put(params, self.layout.params)
        self.buffers = jax.device_put(consts, self.replicated)
        self.count = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        # fp32, split as the weights are; an empty tree without an EMA (ema=).
        self.ema = self.ema_from(params) if cfg.step.ema else {}
        # One compiled program for the whole state: op by op, every distinct shape's zeros would
        # compile a kernel of its own.
        init = jax.jit(optimizer.init, out_shardings=self.layout.opt)
        self.opt_state = init(self.params)

    def arguments(self) -> tuple:
        """What the compiled step takes first: (params, opt_state, ema, count, buffers)."""
        return (self.params, self.opt_state, self.ema, self.count, self.buffers)

    def update(
        self, params: dict, opt_state: Any, ema: dict, count: jax.Array, buffers: dict
    ) -> None:
        """The step's new state (the buffers as the forward wrote them: running statistics)."""
        self.params, self.opt_state, self.ema, self.count = params, opt_state, ema, count
        self.buffers = buffers

    def ema_from(self, params: dict) -> dict:
        """An fp32 copy of `params` (its own buffers: the step donates both)."""
        copies = jax.tree.map(lambda a: jnp.array(a, dtype=jnp.float32, copy=True), params)
        return jax.device_put(copies, self.layout.params)

    def eval_params(self, ema: bool) -> dict:
        if ema and not self.ema:
            raise ValueError("no EMA weights kept (ema=)")
        return self.ema if ema else self.params

    def bytes(self) -> dict[str, int]:
        """What one device holds of each part of the state."""
        return {
            "params": device_bytes(self.params),
            "optimizer": device_bytes(self.opt_state),
            "ema": device_bytes(self.ema),
        }

    # --- by the torch model's parameter names, as the torch backends keep them ---------------
    def checkpoint_state(self) -> dict[str, Any]:
        values = {**self.buffers, **self.params}
        model = {
            k: to_torch(values[self.aliases.get(k, k)]).to(dtype)
            for k, dtype in self.state_dtypes.items()
        }
        out = {"model": model, "optim": self.optimizer.to_torch(self.opt_state)}
        if self.ema:
            out["ema"] = {n: to_torch(self.ema[n]).float() for n in self.param_names}
        return out

    def live_state(self) -> dict[str, Any]:
        """checkpoint_state's structure in the arrays themselves, with their shardings."""
        values = {**self.buffers, **self.params}
        out = {
            "model": {k: values[self.aliases.get(k, k)] for k in self.state_dtypes},
            "optim": self.optimizer.named(self.opt_state),
        }
        if self.ema:
            out["ema"] = dict(self.ema)
        return out

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        store = self.precision.store
        params = {n: to_jax(state["model"][n], store) for n in self.param_names}
        self.params = jax.device_put(params, self.layout.params)
        # The constants too: running statistics and frozen weights, each in its own dtype (a
        # non-persistent buffer is in no checkpoint: it stays as it is).
        saved = state["model"]
        buffers = {
            n: to_jax(saved[n], old.dtype) if n in saved else old for n, old in self.buffers.items()
        }
        self.buffers = jax.device_put(buffers, self.replicated)
        if self.ema:  # a checkpoint without an EMA starts it from its weights
            ema = state.get("ema", state["model"])
            self.ema = self.ema_from({n: to_jax(ema[n]) for n in self.param_names})
        opt_state = self.optimizer.from_torch(state["optim"], self.params, store)
        self.opt_state = jax.device_put(opt_state, self.layout.opt)
        steps = [s["step"] for s in state["optim"].values() if "step" in s]
        if steps:  # the random keys' step count, for a checkpoint that saved none of its own
            self.load_rng_state({"jax_step": steps[0]})

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The step count the step's random keys are folded from (with the seed)."""
        return {"jax_step": torch.tensor(int(host_value(self.count)), dtype=torch.int64)}

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        if "jax_step" in state:
            count = jnp.asarray(int(state["jax_step"]), jnp.int32)
            self.count = jax.device_put(count, self.replicated)
