"""The torch model traced through torchax for the jax backend: the user's loss, metrics or the
forward as JAX functions of the weights, with torch's attention routed to the backend's kernels,
and what torchax cannot trace refused in one line."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any, cast

import jax
import jax.numpy as jnp
import torch
from torch.overrides import TorchFunctionMode

import accel.backends.jax.runtime as runtime
from accel.amp import AmpPolicy
from accel.backends.as_eager import AsEager, modes_kept, no_fast_paths, running_stat_names
from accel.backends.base import BackendUnavailable
from accel.backends.host_reads import HostRead, host_read_line
from accel.backends.jax.attention import AttentionKernels
from accel.backends.jax.block_remat import BlockRemat
from accel.backends.jax.inplace import view_ops, write_through_ops
from accel.backends.jax.model_ops import MODEL_LOWERINGS
from accel.backends.jax.ops import EAGER_LOWERINGS, overridden
from accel.backends.jax.trace_rules import (
    METADATA,
    HostConstants,
    NoGradCuts,
    PythonState,
    TorchSignatures,
    leaves,
    own_backwards,
)
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


def eager_lowerings(env: Any) -> dict[Any, Any]:
    """Every op lowered here rather than by torchax while the backend traces (attention
    apart): ops.py's, model_ops.py's, and inplace.py's views and writes into them."""
    return {**EAGER_LOWERINGS, **MODEL_LOWERINGS, **write_through_ops(), **view_ops(env)}


def attention_lowerings(sdpa: Callable) -> dict[Any, Callable]:
    """torch's SDPA, the function and the op, routed to `sdpa` (ops.overridden's table)."""
    ops = (
        torch.nn.functional.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
    )
    return dict.fromkeys(ops, sdpa)


class Objective(torch.nn.Module):
    """fn(model, batch) as a module whose one submodule is the model, so that
    torch.func.functional_call runs the user's loss (or metrics) with the weights it is given;
    `reads`, where set, records which weights the loss hands to torch."""

    def __init__(self, model: torch.nn.Module, fn: Callable):
        super().__init__()
        self.model, self.fn = model, fn
        self.reads: ParameterReads | None = None

    def forward(self, *batch: torch.Tensor) -> Any:
        # TorchSignatures innermost: the first to see each call, its arguments by position for
        # every mode and lowering after it.
        with self.reads or contextlib.nullcontext(), TorchSignatures():
            return self.fn(self.model, batch)


# The layers autocast runs in low precision whatever their input's dtype (torch's autocast
# casts their inputs to it): with the weights cast to bf16 (O1/O2 on jax), a float32 input
# meets them there.
LOW_PRECISION_LAYERS = {
    torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
    torch.nn.functional.conv3d, torch.nn.functional.conv_transpose1d,
    torch.nn.functional.conv_transpose2d, torch.nn.functional.conv_transpose3d,
}  # fmt: skip


class InputsAsWeights(TorchFunctionMode):
    """O1/O2 on jax (weights cast to the compute dtype): a linear or convolution layer's
    floating input is cast to its weight's dtype, as autocast casts it on eager (otherwise a
    float32 input would meet a bfloat16 weight: torch refuses the mix in a convolution, and a
    matmul would run in float32)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LOW_PRECISION_LAYERS:  # torch's own keywords too: F.linear(x, weight=w)
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) >= 2 else kwargs.get("weight")
            if weight is not None and x.is_floating_point() and x.dtype != weight.dtype:
                if args:
                    args = (x.to(weight.dtype), *args[1:])
                else:
                    kwargs = {**kwargs, "input": x.to(weight.dtype)}
        return func(*args, **kwargs)


class ParameterReads(TorchFunctionMode):
    """Which of the weights `params` ({name: tensor}) the traced code hands to a torch
    function with torch's grad mode on. A weight handed to none (or only inside a no_grad
    block) has no gradient in torch, whose optimizers then leave it as it is (no weight decay,
    no moments): the jax step does the same for `unread`."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self.names = {id(t): n for n, t in params.items()}
        self.read: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled() and getattr(func, "__name__", "") not in METADATA:
            for value in leaves((args, kwargs)):
                name = self.names.get(id(value))
                if name is not None:
                    self.read.add(name)
        return func(*args, **kwargs)

    def read_all(self, tensors: Any) -> None:
        """Count `tensors` as read (a recomputed block reads its weights inside its own
        trace, where they are other tensors)."""
        self.read |= {self.names[id(t)] for t in tensors if id(t) in self.names}

    @property
    def unread(self) -> set[str]:
        return set(self.names.values()) - self.read


class Tracer:
    """fn(model, batch) run by torchax on JAX values: the torch module is traced, never run.
    A traced training loss gives back the constants the model wrote (BatchNorm's running
    statistics) and leaves in `unread` the weights it did not read."""

    def __init__(
        self, model: torch.nn.Module, env: Any, sdpa: Callable, amp: AmpPolicy, remat: str = "none"
    ):
        self.module, self.env, self.sdpa, self.amp = model, env, sdpa, amp
        self.remat = BlockRemat(model, env, remat)
        self.precision = Precision.of(amp)
        # A timm model anywhere in it names itself by its architecture (vit_micro).
        named = (getattr(m, "default_cfg", {}).get("architecture") for m in model.modules())
        self.model_label = next((n for n in named if n), type(model).__name__)
        # Running statistics stay in fp32 under O1/O2, as eager keeps them beside autocast.
        self.full_precision = running_stat_names(model)
        self.objectives: dict[Any, Callable] = {}  # by loss, metric or 'forward'
        self.unread: set[str] = set()  # weights the last traced training loss did not read
        self.training = False  # a training loss is being traced (its blocks recomputed)

    def objective(self, fn: Callable) -> Callable:
        """fn(model, batch) as a JAX function of (weights, constants, *batch), returning fn's
        result and the constants the forward wrote, by name."""
        if fn not in self.objectives:
            wrapped = Objective(self.module, fn)

            def traced(params: dict, consts: dict, batch: tuple) -> tuple[Any, dict]:
                """One trace of fn, on the weights as given (a second trace starts anew)."""
                weights = {f"model.{n}": v for n, v in {**consts, **params}.items()}
                wrapped.reads = ParameterReads(params)
                remat = self.remat.installed(wrapped.reads) if self.training else nullcontext()
                with remat:
                    out = torch.func.functional_call(wrapped, weights, batch)
                return out, weights

            def call(params: dict, consts: dict, *batch: torch.Tensor) -> Any:
                before = {n: runtime.interop.jax_view(v) for n, v in consts.items()}
                # torchax's key for the forward's draws (its env's public `param`): a second
                # trace draws as the first.
                key = self.env.param.prng
                state = PythonState(self.module, self.model_label)
                out, weights = traced(params, consts, batch)
                if state.changed():
                    # Python state written in forward (transformers' Swin settles its
                    # shift_size on the first call): traced again as it settled, and refused
                    # only if that second forward changes it again (a counter).
                    self.env.param.prng = key
                    fresh = {n: runtime.interop.torch_view(a) for n, a in before.items()}
                    state = PythonState(self.module, self.model_label)
                    out, weights = traced(params, fresh, batch)
                    state.check()
                self.unread = cast(ParameterReads, wrapped.reads).unread
                # torchax writes in place by giving the tensor a new array
                written = {
                    n: weights[f"model.{n}"]
                    for n in consts
                    if runtime.interop.jax_view(weights[f"model.{n}"]) is not before[n]
                }
                return out, written

            self.objectives[fn] = runtime.interop.jax_view(call)
        return self.objectives[fn]

    def run_torch(
        self, fn: Callable, params: dict, consts: dict, batch: tuple, key=None
    ) -> tuple[Any, dict]:
        """fn(model, batch) traced through torchax with the model's weights `params`, and the
        constants the model wrote (in the dtypes they are kept in). A PRNG key: the model's
        own train/eval modes as eager would run them, stochastic depth and dropout drawing
        from the key; without one, eval mode. Either way the model's modes are left as they
        were, and tensors the model makes (torch.ones(4)) are made on the devices."""
        kept = consts
        if self.amp.autocast:  # O1/O2: compute in bf16 from the fp32 master weights
            params = cast_floating(params, self.precision.compute)
            consts = {
                n: v if n in self.full_precision else cast_floating(v, self.precision.compute)
                for n, v in consts.items()
            }
        randomness = (
            contextlib.nullcontext() if key is None else self.env.override_property(prng=key)
        )
        self.training = key is not None
        # A training trace records gradients wherever the script steps from (as eager's step
        # does), so that only the model's own no_grad blocks are cut (NoGradCuts).
        grad_mode = torch.enable_grad() if self.training else nullcontext()
        with modes_kept(self.module), grad_mode:
            if key is None:
                self.module.eval()  # read while tracing
            cast = InputsAsWeights() if self.amp.autocast else nullcontext()
            with (
                self.env,
                randomness,
                torch.device("jax"),
                AsEager(),
                cast,
                NoGradCuts(),
                own_backwards(self.env),
                no_fast_paths(),
                HostConstants(),
            ):
                out, written = self.objective(fn)(params, consts, *batch)
        return out, {n: v.astype(kept[n].dtype) for n, v in written.items()}

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Around a call that may trace: torch's attention on the backend's kernels, and what
        torchax cannot trace in one line (lowering_errors)."""
        lowerings = {**attention_lowerings(self.sdpa), **eager_lowerings(self.env)}
        with overridden(self.env, lowerings), self.lowering_errors():
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
