"""The torch model traced through torchax for the jax backend: the user's loss, metrics or the
forward as JAX functions of the weights, with torch's attention routed to the backend's kernels,
and what torchax cannot trace refused in one line."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch

import accel.backends.jax.runtime as runtime
from accel.amp import AmpPolicy
from accel.backends.base import BackendUnavailable
from accel.backends.host_reads import HostRead, host_read_line
from accel.backends.jax.attention import AttentionKernels
from accel.backends.jax.values import Precision, cast_floating


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
        return runtime.interop.call_jax(attention, query, key, value, attn_mask, scale, is_causal)

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
        env._ops[op] = runtime.ops_registry.Operator(
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


class Tracer:
    """fn(model, batch) run by torchax on JAX values: the torch module is traced, never run."""

    def __init__(self, model: torch.nn.Module, env: Any, sdpa: Callable, amp: AmpPolicy):
        self.module, self.env, self.sdpa, self.amp = model, env, sdpa, amp
        self.precision = Precision.of(amp)
        inner = getattr(model, "model", model)  # a timm model behind accel's normalisation
        self.model_label = (
            getattr(inner, "default_cfg", {}).get("architecture") or type(inner).__name__
        )
        self.objectives: dict[Any, Callable] = {}  # by loss, metric or 'forward'

    def objective(self, fn: Callable) -> Callable:
        """fn(model, batch) as a JAX function of (weights, constants, *batch)."""
        if fn not in self.objectives:
            wrapped = Objective(self.module, fn)

            def call(params: dict, consts: dict, *batch: torch.Tensor) -> Any:
                weights = {f"model.{n}": v for n, v in {**consts, **params}.items()}
                return torch.func.functional_call(wrapped, weights, batch)

            self.objectives[fn] = runtime.interop.jax_view(call)
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

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Around a call that may trace: torch's attention on the backend's kernels, and what
        torchax cannot trace in one line (lowering_errors)."""
        with attention_override(self.env, self.sdpa), self.lowering_errors():
            yield

    @contextlib.contextmanager
    def lowering_errors(self) -> Iterator[None]:
        """What torchax cannot trace, in one line: an op it has no lowering for, or a value the
        loss reads back to the host (.item(), a Python branch on a tensor)."""
        try:
            yield
        except runtime.OperatorNotFound as err:
            raise BackendUnavailable(
                f"torchax cannot lower an op of {self.model_label}: {err}; "
                "train it with the eager, compile or xla backend"
            ) from None
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as err:
            raise HostRead(f"the jax backend {host_read_line(err)}") from None
