"""What eager does while the user's forward runs, kept where jax traces it once and
differentiates the whole trace:

- `NoGradCuts`: what a `torch.no_grad()` block (or `torch.set_grad_enabled(False)`,
  `torch.inference_mode()`) computes is cut from the gradient, as eager records no graph there.
- `own_backwards`: a `torch.autograd.Function`'s own backward is the gradient of what its
  forward computes (jax.custom_vjp from its forward and backward), as on eager.
- `HostConstants`: a host tensor the loss or the model closes over (a normalisation's mean and
  std made outside `loss_fn`) meets the traced values as a constant on the devices, as it would
  be moved on the other backends.
- `TorchSignatures`: a torch function called with the keywords torch names its arguments by
  (`F.linear(input=x, weight=w)`, as timm's EVA-02 calls it) reaches torchax's lowering, which
  names them otherwise, with them by position.
- `PythonState`: a forward that changes a module's Python attributes (a call counter) would
  change them once, at the trace, not at every step: refused in one line, naming the attribute.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import accel.backends.jax.runtime as runtime
from accel.backends.jax.values import to_jax
from accel.config import AccelError

# Functions that describe a tensor rather than compute one: no read of a weight, nothing to cut.
METADATA = {"__get__", "size", "dim", "numel", "__len__", "ndimension", "nelement"}


class NoGradCuts(TorchFunctionMode):
    """While active (inside the traced forward), each tensor a torch function makes while
    torch's grad mode is off is cut from the gradient (jax.lax.stop_gradient), as eager builds
    no graph for it: a weight read only there gets no gradient. A function that writes into
    one of its arguments (x.copy_(y), a running statistic) is left as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() or getattr(func, "__name__", "") in METADATA:
            return out
        given = {id(v) for v in leaves((args, kwargs))}

        def cut(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or id(value) in given:
                return value
            array = runtime.interop.jax_view(value)
            if not isinstance(array, jax.Array):  # a host tensor torchax has not taken
                return value
            return runtime.interop.torch_view(jax.lax.stop_gradient(array))

        return jax.tree.map(cut, out)


class HostConstants(TorchFunctionMode):
    """While active (inside the trace), a host tensor handed to a torch function beside the
    traced values (one the loss or the model closes over) is handed over as a constant of the
    program, its value as it is when the step is traced."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        traced = (runtime.torchax.tensor.Tensor, runtime.torchax.view.View)
        values = (args, kwargs)
        if any(isinstance(v, traced) for v in leaves(values)) and any(
            is_host(v) for v in leaves(values)
        ):
            args, kwargs = jax.tree.map(lambda v: as_constant(v) if is_host(v) else v, values)
        return func(*args, **kwargs)


class TorchSignatures(TorchFunctionMode):
    """While active, the arguments a torch function requires (those without a default) are
    handed to it by position, whatever keywords the call named them by: torchax's lowerings
    name them their own way (F.linear's `input` is its `self`). Optional ones stay as given:
    lowerings take some only by keyword (gelu's `approximate`). torch's table gives one
    signature of an overloaded function: a call naming a keyword it lacks means another
    overload (`x.to(device=d, dtype=t)` is not `x.to(dtype, ...)`), and stays as given."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        signature = torch_signature(func) if kwargs else None
        if signature is not None and kwargs.keys() <= signature.parameters.keys():
            args, kwargs = list(args), dict(kwargs)
            for param in list(signature.parameters.values())[len(args) :]:
                positional = param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
                if not positional or param.default is not param.empty or param.name not in kwargs:
                    break
                args.append(kwargs.pop(param.name))
        return func(*args, **kwargs)


@functools.cache
def torch_signature(func: Callable) -> inspect.Signature | None:
    """torch's signature of `func`, a builtin having none of its own: torch.overrides' table
    gives, for each of torch's functions, a lambda taking the same parameters."""
    override = _testing_overrides().get(func)
    return None if override is None else inspect.signature(override)


@functools.cache
def _testing_overrides() -> dict[Callable, Callable]:
    return torch.overrides.get_testing_overrides()


def leaves(value: Any) -> Iterator[Any]:
    """The values inside tuples, lists and dicts (a torch function's arguments)."""
    if isinstance(value, tuple | list):
        for item in value:
            yield from leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    else:
        yield value


def is_host(value: Any) -> bool:
    """A plain torch tensor, not one torchax traces."""
    return isinstance(value, torch.Tensor) and not isinstance(
        value, runtime.torchax.tensor.Tensor | runtime.torchax.view.View
    )


def as_constant(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s value as a constant of the traced program, in its dtype."""
    array = to_jax(tensor)
    if tensor.dtype == torch.bfloat16:  # to_jax reads bfloat16 through float32
        array = array.astype(jnp.bfloat16)
    return runtime.interop.torch_view(array)


class FunctionContext:
    """torch's `ctx` for a Function's forward and backward while jax traces them: what the
    forward saves for the backward (tensors through `save_for_backward`, anything else as an
    attribute), which inputs need a gradient, and the flags the backward reads."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Nothing to mark: jax gives those outputs' gradients to the backward as zeros."""

    def mark_dirty(self, *inputs: Any) -> None:
        """Nothing to mark: the trace has no version counters."""

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def own_function(cls: type) -> bool:
    """A Function of the user's, a library's or torch's, not one torchax or accel apply while
    they trace (those keep torch's own apply)."""
    return cls.__module__.split(".")[0] not in ("torchax", "accel")


def refuse_reentrant_checkpoint(cls: type) -> None:
    """torch.utils.checkpoint(..., use_reentrant=True) runs its block's backward through
    torch's autograd engine, which a jax trace does not drive: refused in one line, with the
    cure."""
    from torch.utils.checkpoint import CheckpointFunction

    if cls is CheckpointFunction:
        raise AccelError(
            "torch.utils.checkpoint(..., use_reentrant=True) cannot run in the jax backend's "
            "traced step: pass use_reentrant=False (the same gradients, and what torch "
            "recommends), or have accel recompute the blocks (prepare's remat)"
        )


def apply_with_own_backward(cls: Any, args: tuple, kwargs: dict, env: Any) -> Any:
    """`cls.apply(*args, **kwargs)` in the jax trace: the forward's result, whose gradient is
    the Function's own backward (jax.custom_vjp). Tensors of the inputs are its arguments;
    what else the forward kept on `ctx` is shared with the backward as it is. jax runs the
    backward after the forward's trace has returned: in torchax's `env` again."""
    interop = runtime.interop
    at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    avals = [(tuple(args[i].shape), interop.jax_view(args[i]).dtype) for i in at]
    contexts: list[FunctionContext] = []

    def forward(*arrays: jax.Array) -> tuple[Any, list]:
        inputs = list(args)
        for i, array in zip(at, arrays, strict=True):
            inputs[i] = interop.torch_view(array)
        needs = tuple(i in at and args[i].is_floating_point() for i in range(len(args)))
        ctx = FunctionContext(needs)
        with torch.no_grad():  # as torch runs a Function's forward
            if cls.setup_context is not torch.autograd.Function.setup_context:  # forward(*args)
                out = cls.forward(*inputs, **kwargs)
                cls.setup_context(ctx, tuple(inputs), out)
            else:
                out = cls.forward(ctx, *inputs, **kwargs)
        contexts[:] = [ctx]
        saved = [interop.jax_view(t) if isinstance(t, torch.Tensor) else t for t in ctx.to_save]
        return jax.tree.map(interop.jax_view, out), saved

    @jax.custom_vjp
    def applied(*arrays: jax.Array) -> Any:
        return forward(*arrays)[0]

    def applied_forward(*arrays: jax.Array) -> tuple:
        return forward(*arrays)

    def applied_backward(saved: list, grads: Any) -> tuple:
        ctx = contexts[0]
        ctx.saved_tensors = tuple(
            interop.torch_view(s) if isinstance(s, jax.Array) else s for s in saved
        )
        given = grads if isinstance(grads, tuple) else (grads,)
        with env, torch.device("jax"), torch.no_grad():
            got = cls.backward(ctx, *(interop.torch_view(g) for g in given))
        got = got if isinstance(got, tuple) else (got,)
        result: list[Any] = []
        for i, (shape, dtype) in zip(at, avals, strict=True):
            grad = got[i] if i < len(got) else None
            if not jnp.issubdtype(dtype, jnp.inexact):
                result.append(np.zeros(shape, jax.dtypes.float0))
            elif grad is None:
                result.append(jnp.zeros(shape, dtype))
            else:
                result.append(interop.jax_view(grad).astype(dtype))
        return tuple(result)

    applied.defvjp(applied_forward, applied_backward)
    out = applied(*(interop.jax_view(args[i]) for i in at))
    return jax.tree.map(interop.torch_view, out)


@contextlib.contextmanager
def own_backwards(env: Any) -> Iterator[None]:
    """While the forward is traced, a user's torch.autograd.Function trains with its own
    backward (apply_with_own_backward). torch has no hook for a Function's application (a
    TorchFunctionMode sees only the ops of its forward, with grad mode off), so
    Function.apply is replaced for the trace, and put back after it."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_reentrant_checkpoint(cls)
        if own_function(cls):
            return apply_with_own_backward(cls, args, kwargs, env)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


# Plain attributes torch itself sets on a module (its mode, a flag its hooks' first call sets):
# not the user's Python state.
MODULE_MACHINERY = {"training", "_is_full_backward_hook", "_compiled_call_impl"}
PLAIN = (bool, int, float, str, type(None))


class PythonState:
    """The plain Python values (numbers, strings, flags) the modules of `model` hold, read
    before a trace and compared after it: a forward that changed one ran its change once, at
    the trace, where eager changes it at every call."""

    def __init__(self, model: torch.nn.Module, label: str):
        self.model, self.label = model, label
        self.before = self.values()

    def values(self) -> dict[tuple[str, str], Any]:
        found = {}
        for prefix, module in self.model.named_modules():
            for attr, value in vars(module).items():
                if attr not in MODULE_MACHINERY and isinstance(value, PLAIN):
                    found[(prefix, attr)] = value
        return found

    def changed(self) -> tuple[str, Any, Any] | None:
        """The first attribute a trace changed (its name, before, after), or None."""
        after = self.values()
        for key, value in self.before.items():
            if key in after and after[key] != value:
                prefix, attr = key
                return (f"{prefix}.{attr}" if prefix else attr), value, after[key]
        return None

    def check(self) -> None:
        """Refuses, in one line naming the first attribute changed, a trace that changed one."""
        change = self.changed()
        if change is not None:
            where, value, now = change
            raise AccelError(
                f"the jax backend traces {self.label}'s forward once, and its forward changes "
                f"{where} at every call ({value!r} to {now!r}): that change would happen once, "
                "not at every step as on eager; keep such state in a tensor (a buffer: "
                "register_buffer) or out of forward, or train with the eager, compile or xla "
                "backend"
            )


__all__ = [
    "METADATA",
    "HostConstants",
    "NoGradCuts",
    "PythonState",
    "TorchSignatures",
    "leaves",
    "own_backwards",
]
