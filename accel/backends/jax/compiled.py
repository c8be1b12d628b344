"""The jax backend's compiled programs: the training step under jax.jit (its weights and
optimizer state donated, laid out as the state's ArrayLayout says), the evaluation and forward
programs, and the accounting of what JAX compiled and how long it took."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import torch

from accel.backends.base import LossFn, MetricFn, StepResult, split_loss
from accel.backends.jax.attention import CUDNN_CALLS, AttentionKernels
from accel.backends.jax.runtime import Runtime
from accel.backends.jax.saved import SavedSteps, arguments_identity, serializable, shardy
from accel.backends.jax.state import TrainState
from accel.backends.jax.step import make_train_step
from accel.backends.jax.tracing import Tracer
from accel.backends.jax.values import host_value, to_torch
from accel.backends.jax.window_attention import TRITON_CALLS
from accel.batches import ModelCall
from accel.config import BackendConfig

DONATED = (0, 1, 2, 3, 4)  # the step's weights, optimizer state, EMA, count and constants


class NotExportable(Exception):
    """jax.export refuses the step (a custom call it gives no promise for, an effect)."""


def exported(fn: Any, args: tuple, platforms: Sequence[str]) -> jax.export.Exported:
    """`fn` exported for `platforms` at these arguments' shapes (traced by the caller's
    tracer). cuDNN's attention calls and the fused window kernel's Triton calls are let through:
    the export is read back by this same jax.
    NotExportable where jax.export refuses it for want of a promise of compatibility."""
    unchecked = [
        jax.export.DisabledSafetyCheck.custom_call(c) for c in (*CUDNN_CALLS, *TRITON_CALLS)
    ]
    serializable(args)
    try:
        return jax.export.export(fn, platforms=tuple(platforms), disabled_checks=unchecked)(*args)
    except ValueError as err:
        if "Cannot serialize code with" in str(err):
            raise NotExportable(str(err).splitlines()[0]) from None
        raise


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


class CompiledStep:
    """The training step (make_train_step) under jax.jit, run on `state`: its weights,
    optimizer state, EMA and count donated and replaced by each call's. One program per set of
    argument shapes, each exported (jax.export) and kept between launches (SavedSteps): a later
    launch of the same job loads it instead of tracing. Where cuDNN took every attention while
    tracing and then refused the step, it is built again on XLA's attention."""

    def __init__(
        self,
        cfg: BackendConfig,
        runtime: Runtime,
        state: TrainState,
        tracer: Tracer,
        attention: AttentionKernels,
        loss_fn: LossFn,
    ):
        self.cfg, self.runtime, self.state, self.tracer = cfg, runtime, state, tracer
        self.attention, self.loss_fn = attention, loss_fn
        self.extra_keys: list[str] = []
        self.frozen: frozenset[str] = frozenset()  # weights no longer requiring a gradient
        self.fn = self._jit()
        folder = Path(cfg.compiler.cache_dir) / "steps" if cfg.compiler.cache_dir else None
        self.saved = SavedSteps(folder, tracer.module, loss_fn, state.optimizer.spec, cfg)
        self.programs: dict[str, Any] = {}  # by the arguments' shapes and shardings
        self.loaded = 0  # programs loaded from an earlier launch's export

    def _loss(self, params: dict, buffers: dict, batch: tuple, key) -> tuple:
        """The loss, the loss function's extras as one fp32 vector (their names kept, in
        order, while tracing) and the buffers the model wrote (BatchNorm's statistics)."""
        out, written = self.tracer.run_torch(self.loss_fn, params, buffers, batch, key)
        loss, extras = split_loss(out)
        self.extra_keys = list(extras)
        values = [jnp.asarray(v, jnp.float32) for v in extras.values()]
        vector = jnp.stack(values) if values else jnp.zeros(0, jnp.float32)
        return loss.astype(jnp.float32), vector, written

    def _outs(self) -> tuple:
        layout, replicated = self.state.layout, self.runtime.replicated
        return (layout.params, layout.opt, layout.ema, replicated, replicated, replicated)

    def _jit(self):
        layout = self.state.layout
        step = make_train_step(
            self._loss,
            self.state.optimizer,
            self.runtime.mesh,
            clip_grad=self.cfg.step.clip_grad,
            seed=self.cfg.step.seed,
            grad_shardings=layout.grads,
            weight_shardings=layout.weights,
            unread=lambda: self.tracer.unread,
            frozen=self.frozen,
            accum=self.cfg.step.accum,
        )
        return jax.jit(step, donate_argnums=DONATED, out_shardings=self._outs())

    def freeze(self, names: frozenset[str]) -> None:
        """From the next step, `names` left as they are (a step traced again: which weights
        train is part of the program)."""
        self.frozen = names
        self.fn = self._jit()
        self.programs.clear()

    def arguments(self, batch: tuple, lr: float | list[float], ema_decay: float) -> tuple:
        """What `fn` takes: the state, the batch ([micro-steps, batch, ...] arrays, or their
        shapes to lower it), the groups' rates and the EMA decay."""
        rates = self.state.optimizer.rates(lr)
        return (*self.state.arguments(), batch, rates, jnp.float32(ema_decay))

    def lower(self, batch: tuple, lr: float | list[float], ema_decay: float) -> Any:
        """The step lowered for `batch`'s shapes, run nowhere (jax.stages.Lowered)."""
        with self.tracer.tracing():
            return self.fn.lower(*self.arguments(batch, lr, ema_decay))

    def export(
        self, batch: tuple, lr: float | list[float], ema_decay: float, platforms: Sequence[str]
    ) -> jax.export.Exported:
        """The step lowered for `platforms` (jax.export: for machines other than this one,
        'cuda' on a CPU-only one), run nowhere; for 'cuda', attention takes the kernels it
        would take on a GPU (AttentionKernels.on_gpu)."""
        gpu = "cuda" in platforms or "rocm" in platforms
        with self.tracer.tracing(), self.attention.on_gpu(gpu):
            fn = self._jit()  # traced afresh: the attention chosen for those platforms
            return exported(fn, self.arguments(batch, lr, ema_decay), platforms)

    def program(self, args: tuple) -> Any:
        """The step for these arguments' shapes: loaded from an earlier launch's export, or
        traced and exported now (and kept). Where nothing is kept (code outside files) or the
        step cannot be exported, the jitted step itself."""
        signature = arguments_identity(args)
        found = self.programs.get(signature)
        if found is not None:
            return found
        if not self.saved.enabled:
            self.programs[signature] = self.fn
            return self.fn
        key = self.saved.key(args, self.frozen)
        kept = self.saved.load(key, args)
        if kept is not None:
            exported_step, traced = kept
            self.extra_keys = traced["extra_keys"]
            self.attention.restore(traced["attention"])
            self.loaded += 1
        else:
            try:
                exported_step = exported(self.fn, args, (jax.default_backend(),))
            except NotExportable:
                self.programs[signature] = self.fn
                return self.fn
            traced = {"extra_keys": self.extra_keys, "attention": self.attention.traced()}
            self.saved.save(key, exported_step, traced)
        call = jax.jit(exported_step.call, donate_argnums=DONATED, out_shardings=self._outs())
        self.programs[signature] = call
        return call

    def __call__(self, batch: tuple, lr: float | list[float], ema_decay: float) -> jax.Array:
        """Returns [mean loss, 1.0 if the update was applied else 0.0, *extras] on the devices."""
        args = self.arguments(batch, lr, ema_decay)
        with self.tracer.tracing(), shardy() if self.saved.enabled else contextlib.nullcontext():
            fn = self.program(args)
            try:
                *new, result = fn(*args)
            except (NotImplementedError, ValueError, RuntimeError) as err:
                if not self.attention.kernel_calls or fn._cache_size():
                    raise
                # cuDNN (or the fused window kernel) took attention calls while tracing the
                # forward, then failed the backward or the compile: build the whole step on
                # XLA's attention instead.
                self.attention.give_up(err)
                self.fn = self._jit()
                self.programs.clear()
                self.saved.folder = None  # what a later launch loads must not take cuDNN
                *new, result = self.program(args)(*args)
        self.state.update(*new)
        return result

    def fetch_results(self, handles: list[jax.Array]) -> list[StepResult]:
        rows = [host_value(handle) for handle in handles]
        return StepResult.from_rows(rows, self.extra_keys)

    def compiled(self) -> int:
        """Programs of the step compiled so far, whichever way each came."""
        programs = {id(p): p for p in [self.fn, *self.programs.values()]}
        return sum(p._cache_size() for p in programs.values())


class Evaluation:
    """The model in eval mode, compiled once per metric function (and once for the forward):
    no gradients, the weights or the EMA as they are."""

    def __init__(self, runtime: Runtime, state: TrainState, tracer: Tracer):
        self.runtime, self.state, self.tracer = runtime, state, tracer
        self.programs: dict[Any, Callable] = {}  # by metric function, or 'forward'

    def sums(
        self, batches: Iterable[tuple], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        params = self.state.eval_params(ema)
        fn = self.programs.get(metric_fn)
        if fn is None:
            tracer = self.tracer

            def sums(model: Callable, batch: tuple) -> dict:
                # A count made on the host (torch.tensor(len(y))) joins the traced values.
                found = metric_fn(model, batch)
                return {k: tracer.env.to_xla(torch.as_tensor(v)) for k, v in found.items()}

            fn = jax.jit(lambda p, c, *b: tracer.run_torch(sums, p, c, b)[0])
            self.programs[metric_fn] = fn
        totals: dict | None = None
        with self.tracer.tracing():
            for batch in batches:
                batch_sums = fn(params, self.state.buffers, *self.runtime.arrays(batch))
                totals = batch_sums if totals is None else jax.tree.map(jnp.add, totals, batch_sums)
        return {k: float(host_value(v)) for k, v in sorted((totals or {}).items())}

    def forward(self, call: ModelCall) -> Any:
        """The model in eval mode on `call`'s arguments (host or device tensors), without
        gradients; its output as host torch tensors, in the model's own classes. One program
        per call's structure (its keywords, its flags)."""
        fn = self.programs.get(("forward", call.key))
        if fn is None:
            tracer = self.tracer

            def forward(model: torch.nn.Module, tensors: tuple) -> Any:
                args, kwargs = call.rebuild(tensors)
                return as_pytree(model(*args, **kwargs))

            fn = jax.jit(lambda p, c, *b: tracer.run_torch(forward, p, c, b)[0])
            self.programs[("forward", call.key)] = fn
        with self.tracer.tracing():
            out = fn(self.state.params, self.state.buffers, *self.runtime.arrays(call.tensors))
        return jax.tree.map(to_torch, out)


def as_pytree(out: Any) -> Any:
    """`out` (a forward's output), its dataclasses made jax pytrees first, so that a model
    returning one (`Output(logits=...)`) gives it back from the compiled forward as eager does:
    a jitted function returns only pytrees of arrays. Registered once per class, over its
    fields, in jax's registry alone (torch and the user's code see the class unchanged)."""
    for value in _nodes(out):
        cls = type(value)
        if dataclasses.is_dataclass(value) and jax.tree_util.treedef_is_leaf(
            jax.tree.structure(value)
        ):
            fields = [f.name for f in dataclasses.fields(cls) if f.init]
            jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
    return out


def _nodes(value: Any) -> Iterable[Any]:
    yield value
    if isinstance(value, dict):
        children: Iterable[Any] = value.values()
    elif isinstance(value, list | tuple):
        children = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = (getattr(value, f.name) for f in dataclasses.fields(value))
    else:
        return
    for child in children:
        yield from _nodes(child)
