"""JAX backend: the same torch model lowered to JAX by torchax and compiled by XLA (CPU, GPU, TPU).

The training step is one pure function under jax.jit: forward, soft-target loss, JAX autodiff,
an explicit gradient mean over the devices of a 1-D 'data' mesh (shard_map + pmean, the same
contract as the xla backend's all-reduce), then optax AdamW. With tensor parallelism (--tp) the
mesh is 2-D, ('data', 'model'): the plan's linear layers split their weights over 'model' (and
with --shard every weight over 'data' too), the step is one program over the global batch, and
XLA's SPMD partitioner adds the collectives. Weights and optimizer state are donated. The
learning rate comes in as an argument each step, read from the same timm schedule as the torch
backends, so it never triggers a recompile.

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
from typing import Any, ClassVar, cast

import numpy as np
import torch

from accel.amp import amp_policy
from accel.backends.base import (
    BackendStats,
    BackendUnavailable,
    Batch,
    LossFn,
    MetricFn,
    ModelInit,
    StepResult,
    Supports,
    split_batch,
    split_loss,
)
from accel.backends.host_reads import HostRead, host_read_line
from accel.backends.jax.torchax_compat import not_an_accelerator, removed_ops
from accel.backends.quiet import quiet_imports
from accel.config import BackendConfig, ConfigError
from accel.distributed import DistContext
from accel.optim import OptimizerSpec
from accel.parallel import effective_shard
from accel.parallel.materialize import whole
from accel.parallel.mesh import ParallelDims
from accel.parallel.tensor_parallel import resolve_plan, weight_splits
from accel.versions import installed

INSTALL = "pip install 'accel[jax]' (jax, torchax, optax)"
SUPPORTS = Supports(
    shard=("none", "full", "grad_op"),
    tp=True,
    remat=True,
    data_device_gpu=True,
    replicas="devices",
    kernel_opt="nothing more: attention always runs through jax.nn.dot_product_attention "
    "(cuDNN flash attention on GPU)",
)

try:
    with quiet_imports():
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from accel.backends.jax.attention import AttentionKernels
        from accel.backends.jax.step import (
            OptaxGroups,
            Precision,
            cast_floating,
            host_value,
            make_train_step,
            to_jax,
            to_torch,
        )
    IMPORT_ERROR: BaseException | None = None
except Exception as err:  # reported by require() as one line: missing, or not for this torch
    # None where it cannot be imported: require() refuses before any use.
    jax, IMPORT_ERROR = None, err  # type: ignore[assignment]

# torchax is imported when a jax engine is about to be built (require()), not with this module.
# Its import renames torch's PrivateUse1 device to "jax", which makes it torch's accelerator for
# the rest of the process (at::getAccelerator prefers a registered PrivateUse1 device; it cannot
# be unregistered), and from then on no CUDA backward runs in that process (pytorch/pytorch#161129:
# "PyTorch is not linked with support for jax devices"). So importing accel, listing the backends
# or checking a configuration leaves torch as it was; eager.require() refuses CUDA in one line
# once torchax has come in.
torchax: Any = None
interop: Any = None
ops_registry: Any = None
OperatorNotFound: type[Exception] = LookupError  # torchax's own class once it is loaded


def load_torchax() -> BaseException | None:
    """Import torchax (once) and bind its names here; the error, where its import failed."""
    global torchax, interop, ops_registry, OperatorNotFound
    if torchax is not None:
        return None
    try:
        with quiet_imports(), removed_ops():
            import torchax as module
            from torchax import interop as interop_module
            from torchax.ops import ops_registry as registry
            from torchax.tensor import OperatorNotFound as not_found
    except Exception as err:  # reported by require() as one line
        return err
    not_an_accelerator(module.device_module)
    torchax, interop, ops_registry, OperatorNotFound = module, interop_module, registry, not_found
    return None


# JAX's GPU client takes this fraction of the card when it starts (its default, 0.75, leaves a
# quarter of an 80 GB card unused); set before the first device query, a user's value wins.
RUNTIME_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}


def require() -> None:
    """Refuses in one line where jax, optax or torchax is missing or cannot import on this torch;
    otherwise imports torchax (see load_torchax)."""
    error = IMPORT_ERROR or load_torchax()
    if isinstance(error, ImportError):
        raise BackendUnavailable(f"the jax backend needs jax, torchax and optax: {INSTALL}")
    if error is not None:
        versions = ", ".join(f"{p} {installed(p)}" for p in ("torch", "torchax", "jax"))
        raise BackendUnavailable(
            f"the jax backend cannot start: importing torchax failed with {versions} "
            f"({type(error).__name__}: {error}); install a torchax release "
            "made for this torch, or a torch torchax supports"
        )
    for name, value in RUNTIME_ENV.items():
        os.environ.setdefault(name, value)


def build(cfg: BackendConfig, ctx: DistContext) -> JaxBackend:
    require()  # torchax in, where prepare's check did not already bring it
    return JaxBackend(cfg, ctx)


COORDINATION = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def coordination() -> tuple[str, int, int] | None:
    """(coordinator, processes, this process) from the JAX_* variables (the command line sets
    them from --nnodes and --master_addr/--rdzv_endpoint); None for one process."""
    found = {name: os.environ.get(name) for name in COORDINATION}
    if not any(found.values()):
        return None
    if not all(found.values()):
        missing = ", ".join(n for n, v in found.items() if not v)
        raise ConfigError(
            f"multi-process jax needs all of {', '.join(COORDINATION)}: {missing} unset"
        )
    given = cast(dict[str, str], found)  # all set: checked above
    return (
        given["JAX_COORDINATOR_ADDRESS"],
        int(given["JAX_NUM_PROCESSES"]),
        int(given["JAX_PROCESS_ID"]),
    )


def context(cfg: BackendConfig) -> DistContext:
    """One process drives its local devices; several processes (hosts) join through
    jax.distributed into one mesh, and each feeds its own shard of the data."""
    joined = coordination()
    if joined and not jax.distributed.is_initialized():
        address, processes, process = joined
        # Collectives between CPU processes go through gloo (JAX has none of its own there).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                address, processes, process, initialization_timeout=cfg.mesh.rdzv_timeout
            )
        except Exception as err:  # JAX raises XlaRuntimeError / RuntimeError subclasses here
            raise ConfigError(
                f"jax process {process} of {processes} could not join the coordinator at "
                f"{address} within {cfg.mesh.rdzv_timeout} s ({str(err).splitlines()[0]})"
            ) from None
        if jax.process_count() != processes:
            raise ConfigError(f"{processes} jax processes asked for, {jax.process_count()} joined")
    return DistContext(jax.process_index(), 0, jax.process_count())


# --- attention: torch's SDPA onto jax.nn.dot_product_attention (cuDNN flash on GPU) ---------
def torch_sdpa(kernels: AttentionKernels) -> Callable:
    """An SDPA with torch's signature that runs `kernels` ([B, heads, T, D] in and out; JAX's
    attention takes [B, T, heads, D])."""

    def attention(query, key, value, mask, scale, is_causal):
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
        bias = boolean = None
        if mask is not None and mask.dtype == jnp.bool_:
            boolean = mask
        elif mask is not None:
            bias = mask.astype(q.dtype)
        return jnp.swapaxes(kernels(q, k, v, bias, boolean, scale, is_causal), 1, 2)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        if dropout_p:
            raise NotImplementedError("attention dropout is not supported by the jax backend")
        return interop.call_jax(attention, query, key, value, attn_mask, scale, is_causal)

    return sdpa


@contextlib.contextmanager
def attention_override(env, sdpa: Callable):
    """Route torch's SDPA to `sdpa` while tracing, then restore torchax's own."""
    ops = (
        torch.nn.functional.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
    )
    saved = {op: env._ops.get(op) for op in ops}
    for op in ops:
        # What env.override_op_definition does; torchax 0.0.13's version omits is_view_op.
        env._ops[op] = ops_registry.Operator(
            op, sdpa, is_jax_function=False, is_user_defined=True, needs_env=False, is_view_op=False
        )
    try:
        yield
    finally:
        env._ops.update(saved)


class Objective(torch.nn.Module):
    """fn(model, batch) as a module whose one submodule is the model, so that
    torch.func.functional_call runs the user's loss (or metrics) with the weights it is given."""

    def __init__(self, model: torch.nn.Module, fn: Callable):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *batch: torch.Tensor) -> Any:
        return self.fn(self.model, batch)


# --- compilation accounting -------------------------------------------------------------------
class CompileMonitor:
    """Process-wide sums of JAX's own compile events: tracing (through torchax), lowering,
    XLA compilation, and persistent-cache hits. jax.monitoring has no public way to unregister,
    so one instance listens for the whole process and backends read differences."""

    DURATIONS: ClassVar[dict[str, str]] = {
        "/jax/core/compile/jaxpr_trace_duration": "trace_s",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
        "/jax/core/compile/backend_compile_duration": "compile_s",
    }
    HITS = "/jax/compilation_cache/cache_hits"
    _instance: CompileMonitor | None = None

    def __init__(self):
        self.totals = dict.fromkeys(self.DURATIONS.values(), 0.0)
        self.cache_hits = 0
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    @classmethod
    def get(cls) -> CompileMonitor:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in self.DURATIONS:
            self.totals[self.DURATIONS[event]] += seconds

    def _event(self, event: str, **_) -> None:
        if event == self.HITS:
            self.cache_hits += 1

    def snapshot(self) -> dict[str, float]:
        return {**self.totals, "cache_hits": self.cache_hits}


# --- input pipeline ---------------------------------------------------------------------------
def from_torch(tensor: torch.Tensor) -> np.ndarray | jax.Array:
    """A batch tensor for device_put: decoded on a CUDA GPU, it crosses by DLPack, without a
    round trip through the host."""
    return jax.dlpack.from_dlpack(tensor) if tensor.is_cuda else tensor.numpy()


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays (its shards of split ones); the gradients
    live only inside the compiled step."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


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
    pin_memory = False  # device_put stages host arrays itself
    trains_in_place = False  # arrays of its own; the torch module is traced, never run
    compiles_per_shape = True
    explain_compiles = "JAX_EXPLAIN_CACHE_MISSES=1 prints the cause of each compile"
    threaded = True  # JAX's runtime runs threads of its own
    sharded_checkpoint = False  # one process holds every array it trains: one file

    def __init__(self, cfg: BackendConfig, ctx: DistContext):
        step = cfg.step
        if step.amp != "O0" and step.amp_dtype != "bfloat16":
            raise ConfigError("the jax backend does low precision in bfloat16 (--amp_dtype)")
        self.cfg, self.ctx = cfg, ctx
        self.data_parallel = (ctx.rank, ctx.world_size)
        self.amp = amp_policy(step.amp, step.amp_dtype)
        self.precision = Precision.of(self.amp)
        # Before the first compile: JAX reads the cache settings once per process.
        jax.config.update("jax_compilation_cache_dir", cfg.compiler.cache_dir)
        self.monitor = CompileMonitor.get()
        self.compile_events_at_start = self.monitor.snapshot()
        devices = jax.devices() if jax.process_count() > 1 else jax.local_devices()
        if cfg.mesh.devices > jax.local_device_count():
            raise ConfigError(
                f"--nproc_per_node {cfg.mesh.devices} exceeds the {jax.local_device_count()} "
                "local JAX devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
            )
        used = np.array(devices[: cfg.mesh.devices * jax.process_count()])
        self.dims = ParallelDims.of(cfg.mesh, used.size)
        if self.dims.tp > 1 and jax.process_count() > 1:
            raise ConfigError("--tp on jax splits over one process's devices, not across hosts")
        if self.dims.tp > 1:
            # 'model' innermost: a tensor-parallel group's devices are neighbours.
            grid = used.reshape(self.dims.dp, self.dims.tp)
            self.mesh = Mesh(grid, ("data", "model"))
        else:
            self.mesh = Mesh(used, ("data",))
        # Data replicas this process feeds: a tensor-parallel group reads one batch.
        self.local_replicas = cfg.mesh.devices // self.dims.tp
        self.replicated = NamedSharding(self.mesh, P())
        self.shard = effective_shard(cfg.mesh.shard, self.dims.dp)
        if self.shard != "none" and jax.process_count() > 1:
            raise ConfigError("--shard on jax shards over one process's devices, not across hosts")
        with quiet_imports(), removed_ops():  # torchax registers its ops here
            self.env = torchax.default_env()
        self.compiles_at_warmup: int | None = None
        on_gpu = jax.default_backend() == "gpu"
        self.attention = AttentionKernels(flash=on_gpu, choice=step.attention)
        # Attention always goes through jax.nn.dot_product_attention (cuDNN flash or XLA's own
        # ops, per shape as step.attention says):
        # torchax's own lowering computes it in fp32 and hands fp32 on to the rest of the
        # block, so O1-O3 would run most matmuls in fp32.
        self.sdpa = torch_sdpa(self.attention)

    # --- set-up -------------------------------------------------------------------------------
    def adopt(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerSpec,
        loss_fn: LossFn,
        init: ModelInit | None = None,
    ) -> None:
        model = whole(model, init)
        self.module = model  # torch side: names, shapes, checkpoint layout; traced, never run
        # Its tensors' names and dtypes (fp32 weights, int64 indices; JAX keeps int32), read
        # once: the Engine keeps the user's model current when its state_dict() is read.
        self.state_dtypes = {k: t.dtype for k, t in model.state_dict().items()}
        inner = getattr(model, "model", model)  # a timm model behind accel's normalisation
        self.model_label = (
            getattr(inner, "default_cfg", {}).get("architecture") or type(inner).__name__
        )
        self.optimizer = OptaxGroups(optimizer)
        self.loss_fn = loss_fn
        trained = {n for g in optimizer.groups for n in g.names}
        store = self.precision.store
        params = {n: to_jax(p, store) for n, p in model.named_parameters() if n in trained}
        # Everything else the model holds (buffers, frozen weights) goes in as constants.
        consts = {n: to_jax(t, store) for n, t in model.state_dict(keep_vars=True).items()}
        consts.update({n: to_jax(b, store) for n, b in model.named_buffers()})
        consts = {n: v for n, v in consts.items() if n not in trained}
        self.param_names = [n for n, _ in model.named_parameters() if n in trained]
        state_shapes = jax.eval_shape(self.optimizer.init, params)
        if self.dims.tp > 1:
            plan = resolve_plan(model, self.cfg.mesh.tp_plan, self.dims.tp)
            splits = weight_splits(model, plan)
            self.param_shardings = self.tp_shardings(params, splits, self.shard == "full")
            # grad_op: the weights split over 'model' only, their gradients and moments over
            # 'data' too.
            self.grad_shardings = self.tp_shardings(params, splits, self.shard != "none")
            self.opt_shardings = self.state_shardings(state_shapes, params, self.grad_shardings)
            # While the step computes: split over 'model' only.
            self.weight_shardings: dict | None = self.tp_shardings(params, splits, False)
        else:
            self.param_shardings = self.shardings(params, self.shard == "full")
            self.grad_shardings = self.param_shardings
            self.weight_shardings = None
            self.opt_shardings = self.shardings(state_shapes, self.shard != "none")
        self.params = jax.device_put(params, self.param_shardings)
        self.buffers = jax.device_put(consts, self.replicated)
        self.count = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        # fp32, split as the weights are; an empty tree without --model_ema.
        self.ema = self.ema_from(params) if self.cfg.step.ema else {}
        # One compiled program for the whole state: op by op, every distinct shape's zeros would
        # compile a kernel of its own.
        init = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)
        self.opt_state = init(self.params)
        self.objectives: dict[Any, Callable] = {}  # by loss, metric or 'forward'
        self.step_fn = self._jit_step()
        self.batch_sharding = NamedSharding(self.mesh, P("data"))

    def ema_from(self, params: dict) -> dict:
        """An fp32 copy of `params` (its own buffers: the step donates both)."""
        copies = jax.tree.map(lambda a: jnp.array(a, dtype=jnp.float32, copy=True), params)
        return jax.device_put(copies, self.param_shardings)

    def shardings(self, tree: Any, split: bool) -> Any:
        """Per leaf: split along its first axis over the `data` mesh axis where `split` and that
        axis divides evenly, else a full copy on each device. XLA then gathers the weights for
        the step and reduce-scatters the gradients onto the shards."""
        n = self.mesh.size

        def sharding(leaf) -> NamedSharding:
            if split and leaf.ndim and leaf.shape[0] % n == 0:
                return NamedSharding(self.mesh, P("data"))
            return self.replicated

        return jax.tree.map(sharding, tree)

    def tp_shardings(self, params: dict, splits: dict[str, int], data: bool) -> dict:
        """Per weight: its tensor-parallel split (`splits`: name -> axis) over the `model` mesh
        axis, and where `data`, the first other axis the `data` axis's size divides split over
        `data` (FSDP across the data groups: a colwise weight [out, in] is P('model', 'data'),
        a rowwise one P('data', 'model')); an axis nothing divides stays whole."""
        size = self.mesh.shape["data"]

        def sharding(name: str, leaf) -> NamedSharding:
            axes: list[str | None] = [None] * leaf.ndim
            if name in splits:
                axes[splits[name]] = "model"
            if data:
                free = [i for i, n in enumerate(leaf.shape) if axes[i] is None and n % size == 0]
                if free:
                    axes[free[0]] = "data"
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

    def objective(self, fn: Callable) -> Callable:
        """fn(model, batch) as a JAX function of (weights, constants, *batch)."""
        if fn not in self.objectives:
            wrapped = Objective(self.module, fn)

            def call(params: dict, consts: dict, *batch: torch.Tensor) -> Any:
                weights = {f"model.{n}": v for n, v in {**consts, **params}.items()}
                return torch.func.functional_call(wrapped, weights, batch)

            self.objectives[fn] = interop.jax_view(call)
        return self.objectives[fn]

    def run_torch(self, fn: Callable, params: dict, consts: dict, batch: tuple, key=None) -> Any:
        """fn(model, batch) traced through torchax with the model's weights `params`. Train mode
        when a PRNG key is given: stochastic depth and dropout draw from it."""
        if self.amp.autocast:  # O1/O2: compute in bf16 from the fp32 master weights
            params, consts = cast_floating((params, consts), self.precision.compute)
        self.module.train(key is not None)  # read while tracing
        randomness = (
            contextlib.nullcontext() if key is None else self.env.override_property(prng=key)
        )
        with self.env, randomness:
            return self.objective(fn)(params, consts, *batch)

    # --- the step -----------------------------------------------------------------------------
    def _loss(self, params: dict, buffers: dict, batch: tuple, key) -> tuple[jax.Array, jax.Array]:
        """The loss, and the loss function's extras as one fp32 vector (their names kept, in
        order, while tracing)."""
        loss, extras = split_loss(self.run_torch(self.loss_fn, params, buffers, batch, key))
        self.extra_keys = list(extras)
        values = [jnp.asarray(v, jnp.float32) for v in extras.values()]
        vector = jnp.stack(values) if values else jnp.zeros(0, jnp.float32)
        return loss.astype(jnp.float32), vector

    def _jit_step(self):
        step = make_train_step(
            self._loss,
            self.optimizer,
            self.mesh,
            clip_grad=self.cfg.step.clip_grad,
            seed=self.cfg.step.seed,
            remat=self.cfg.step.remat,
            grad_shardings=self.grad_shardings,
            weight_shardings=self.weight_shardings,
        )
        state_shardings = (self.param_shardings, self.opt_shardings, self.ema_shardings())
        return jax.jit(
            step,
            donate_argnums=(0, 1, 2, 3),
            out_shardings=(*state_shardings, self.replicated, self.replicated),
        )

    def ema_shardings(self) -> dict:
        return self.param_shardings if self.cfg.step.ema else {}

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[tuple]:
        """The batches on the devices, as torch tensors a script reads as it would any
        (torchax's view of the arrays: `images.size(0)`, `labels.shape`)."""
        prefetched = DevicePrefetcher(batches, self._put, self.cfg.compiler.device_prefetch)
        return (tuple(interop.torch_view(a) for a in arrays) for arrays in prefetched)

    def arrays(self, batch: tuple) -> tuple:
        """A batch as the devices' arrays: torchax's views unwrapped, host tensors put there."""
        if all(isinstance(t, torch.Tensor) and t.device.type == "jax" for t in batch):
            return tuple(interop.jax_view(t) for t in batch)
        if all(isinstance(t, jax.Array) for t in batch):
            return batch
        return self._put(tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch))

    def _put(self, batch: Batch) -> tuple:
        arrays = tuple(from_torch(t) for t in batch)
        if jax.process_count() > 1:
            return tuple(
                jax.make_array_from_process_local_data(self.batch_sharding, a) for a in arrays
            )
        return tuple(jax.device_put(a, self.batch_sharding) for a in arrays)

    def split(self, batch: tuple, parts: int) -> list[tuple]:
        return split_batch(self.arrays(batch), parts)

    def train_step(
        self, micro_batches: list[tuple], lr: float | list[float], ema_decay: float = 0.0
    ) -> jax.Array:
        """Returns [mean loss, 1.0 if the update was applied else 0.0] on the devices."""
        micro_batches = [self.arrays(b) for b in micro_batches]
        batch = tuple(jnp.stack(parts) for parts in zip(*micro_batches, strict=True))
        args = self.step_arguments(batch, lr, ema_decay)
        with attention_override(self.env, self.sdpa), self._lowering_errors():
            try:
                self.params, self.opt_state, self.ema, self.count, result = self.step_fn(*args)
            except (NotImplementedError, ValueError, RuntimeError) as err:
                if not self.attention.flash_calls or self.step_fn._cache_size():
                    raise
                # cuDNN took every attention call while tracing the forward, then refused the
                # backward or the compile: build the whole step on XLA's attention instead.
                self.attention.give_up(err)
                self.step_fn = self._jit_step()
                self.params, self.opt_state, self.ema, self.count, result = self.step_fn(*args)
        return result

    def step_arguments(self, batch: tuple, lr: float | list[float], ema_decay: float) -> tuple:
        """What step_fn takes: the state, the batch ([micro-steps, batch, ...] arrays, or their
        shapes to lower it), the groups' rates and the EMA decay."""
        state = (self.params, self.opt_state, self.ema, self.count, self.buffers)
        return (*state, batch, self.optimizer.rates(lr), jnp.float32(ema_decay))

    @contextlib.contextmanager
    def _lowering_errors(self):
        """What torchax cannot trace, in one line: an op it has no lowering for, or a value the
        loss reads back to the host (.item(), a Python branch on a tensor)."""
        try:
            yield
        except OperatorNotFound as err:
            raise BackendUnavailable(
                f"torchax cannot lower an op of {self.model_label}: {err}; "
                "train it with the eager, compile or xla backend"
            ) from None
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as err:
            raise HostRead(f"the jax backend {host_read_line(err)}") from None

    def fetch_results(self, handles: list[jax.Array]) -> list[StepResult]:
        rows = [host_value(handle) for handle in handles]
        return StepResult.from_rows(rows, self.extra_keys)

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate_sums(
        self, batches: Iterable[tuple], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        params = self.eval_params(ema)
        fn = self.objectives.get(("eval", metric_fn))
        if fn is None:

            def sums(model: Callable, batch: tuple) -> dict:
                # A count made on the host (torch.tensor(len(y))) joins the traced values.
                found = metric_fn(model, batch)
                return {k: self.env.to_xla(torch.as_tensor(v)) for k, v in found.items()}

            fn = jax.jit(lambda p, c, *b: self.run_torch(sums, p, c, b))
            self.objectives[("eval", metric_fn)] = fn
        totals: dict | None = None
        with attention_override(self.env, self.sdpa), self._lowering_errors():
            for batch in batches:
                batch_sums = fn(params, self.buffers, *self.arrays(batch))
                totals = batch_sums if totals is None else jax.tree.map(jnp.add, totals, batch_sums)
        return {k: float(host_value(v)) for k, v in sorted((totals or {}).items())}

    def forward(self, inputs: tuple) -> Any:
        """The model in eval mode on `inputs` (host or device tensors), without gradients; its
        output as host torch tensors."""
        fn = self.objectives.get("forward")
        if fn is None:
            fn = jax.jit(lambda p, c, *b: self.run_torch(lambda model, x: model(*x), p, c, b))
            self.objectives["forward"] = fn
        with attention_override(self.env, self.sdpa), self._lowering_errors():
            out = fn(self.params, self.buffers, *self.arrays(inputs))
        return jax.tree.map(to_torch, out)

    def eval_params(self, ema: bool) -> dict:
        if ema and not self.ema:
            raise ValueError("no EMA weights kept (--model_ema)")
        return self.ema if ema else self.params

    # --- state: by the torch model's parameter names, as the torch backends keep it --------
    def checkpoint_state(self) -> dict[str, Any]:
        values = {**self.buffers, **self.params}
        model = {k: to_torch(values[k]).to(dtype) for k, dtype in self.state_dtypes.items()}
        out = {"model": model, "optim": self.optimizer.to_torch(self.opt_state)}
        if self.ema:
            out["ema"] = {n: to_torch(self.ema[n]).float() for n in self.param_names}
        return out

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        store = self.precision.store
        params = {n: to_jax(state["model"][n], store) for n in self.param_names}
        self.params = jax.device_put(params, self.param_shardings)
        if self.ema:  # a checkpoint without an EMA starts it from its weights
            ema = state.get("ema", state["model"])
            self.ema = self.ema_from({n: to_jax(ema[n]) for n in self.param_names})
        opt_state = self.optimizer.from_torch(state["optim"], self.params, store)
        self.opt_state = jax.device_put(opt_state, self.opt_shardings)
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

    def any_rank(self, flag: bool) -> bool:
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))

    # --- bookkeeping --------------------------------------------------------------------------
    def synchronize(self) -> None:
        jax.block_until_ready(self.params)

    def mark_warmup_done(self) -> None:
        self.compiles_at_warmup = self.step_fn._cache_size()

    def compiles_after_warmup(self) -> int:
        if self.compiles_at_warmup is None:
            return 0
        # max: a step rebuilt on XLA's attention (cuDNN refused) starts a cache of its own
        return max(0, self.step_fn._cache_size() - self.compiles_at_warmup)

    def stats(self) -> BackendStats:
        compiled = self.step_fn._cache_size()
        after = self.compiles_after_warmup()
        events = self.monitor.snapshot()
        spent = {k: events[k] - self.compile_events_at_start[k] for k in events}
        hits = int(spent.pop("cache_hits"))
        return BackendStats(
            graphs_compiled=compiled,
            compiles_after_warmup=after,
            compile_time_s=sum(spent.values()),
            compile_phases_s=spent,
            persistent_cache=True,
            persistent_cache_hits=hits,
            devices=self.mesh.size,
            shard=self.shard,
            state_bytes={
                "params": device_bytes(self.params),
                "optimizer": device_bytes(self.opt_state),
                "ema": device_bytes(self.ema),
            },
            peak_memory_bytes=self.peak_memory_bytes(),
            details={
                "device_kind": jax.devices()[0].device_kind,
                # Where the arrays live ('gpu', 'cpu', 'tpu'): JAX falls back to its CPU
                # platform quietly where its GPU plugin is missing.
                "platform": self.mesh.devices.flat[0].platform,
                "tp": self.dims.tp,
                **self.attention.stats(),
            },
        )

    def peak_memory_bytes(self) -> int | None:
        """The device allocator's high-water mark (None where the platform keeps none: CPU)."""
        stats = [
            d.memory_stats()
            for d in self.mesh.devices.flat
            if d.process_index == jax.process_index()
        ]
        peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
        return max(peaks) if peaks else None
