"""In-place ops written into a view inside a traced forward, as eager writes them.

torchax represents `x[...]` as a view of `x` (torchax.view.View) and its in-place ops that it
registers as such (add_, mul_, copy_, clamp_, ...) write through the view into `x`. Two gaps
made eager's forward differ on jax, with no error (losses 0.1-0.8 off after 4 steps):

- every other in-place op reached torchax's generic path, which first turns a view into a copy:
  the write landed in the copy (`y[:, :3].masked_fill_(m, 0)`, `y[:, 2:].index_add_(...)`,
  `y[0:2].fill_(1)`, `y[1:3].zero_()`). Here each is its functional form written back as
  torchax's own in-place ops are (WriteThrough);
- only indexing made views: narrow, select, t, transpose, permute, view, squeeze, unsqueeze
  and slice, which torch always answers with a view, gave copies (`y.narrow(1, 1, 2).mul_(3)`,
  `y.t()[0].mul_(2)`, `y.view(-1)[::2].add_(1)`). Here they give views too (SelectionView): a
  write into one lands in its source. reshape, contiguous and expand stay as torchax has them:
  torch's reshape copies where it cannot view, and expand refuses a write.

Part of the jax backend (its lowering table, ops.overridden)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

import accel.backends.jax.runtime as runtime

# The in-place ops that torchax 0.0.13 does not write through a view, each with its functional
# form (same arguments, a new tensor). torchax's own in-place table covers the arithmetic ones.
FUNCTIONAL: dict[str, str] = {
    "masked_fill_": "masked_fill",
    "masked_scatter_": "masked_scatter",
    "index_add_": "index_add",
    "index_fill_": "index_fill",
    "index_copy_": "index_copy",
    "fill_": "fill",
    "zero_": "zeros_like",
    "addcmul_": "addcmul",
    "addcdiv_": "addcdiv",
    "lerp_": "lerp",
    "clamp_max_": "clamp_max",
    "exp_": "exp",
    "log_": "log",
    "neg_": "neg",
    "abs_": "abs",
    "reciprocal_": "reciprocal",
    "floor_": "floor",
    "round_": "round",
    "fmod_": "fmod",
    "hardtanh_": "hardtanh",
    "leaky_relu_": "leaky_relu",
    "silu_": "silu",
    "elu_": "elu",
    "hardswish_": "hardswish",
    "hardsigmoid_": "hardsigmoid",
}


class WriteThrough:
    """An in-place op as its functional form, its result written into the first argument (a
    view: into its source too)."""

    writes_views = True  # torchax hands it a view as the view, not a copy (ops.overridden)

    def __init__(self, functional: Callable[..., torch.Tensor]):
        self.functional = functional

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        view = isinstance(target, runtime.torchax.view.View)
        value = self.functional(target.torch() if view else target, *args, **kwargs)
        if view:
            target.update(value)  # torchax's write into a view's source (view.View.update)
        else:
            target.copy_(value)
        return target


def write_through_ops() -> dict[Any, WriteThrough]:
    """Each op of FUNCTIONAL (every overload) by its lowering here."""
    table: dict[Any, WriteThrough] = {}
    for inplace, functional in FUNCTIONAL.items():
        packet = getattr(torch.ops.aten, inplace, None)
        target = getattr(torch.ops.aten, functional, None)
        if packet is None or target is None:  # not in this torch
            continue
        write = WriteThrough(target if functional != "zeros_like" else _zeros_like)
        table[packet] = write
        for overload in packet.overloads():
            table[getattr(packet, overload)] = write
    return table


def _zeros_like(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


# torch's ops that always return a view of their input (reshape may copy: not among them), by
# the overloads torchax lowers.
VIEW_OPS = (
    "narrow.default", "select.int", "t.default", "transpose.int", "permute.default",
    "view.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "unsqueeze.default",
    "slice.Tensor", "alias.default",
)  # fmt: skip


@functools.cache
def selection_view() -> tuple[type, type]:
    """(the view info of an op that selects and rearranges its input's elements, the view that
    holds it). Both subclass torchax.view's classes, which have no public way to add a kind of
    view; torchax is loaded with the backend, so they are made on first use."""
    info_base: Any = runtime.torchax.view.ViewInfo
    view_base: Any = runtime.torchax.view.View

    class SelectionInfo(info_base):
        """A view `fn(source)`; a write of new values goes to the source elements each came
        from (found by applying `fn` to the source's flat indices)."""

        def __init__(self, fn: Callable[[jax.Array], jax.Array]):
            super().__init__()
            self.fn = fn

        def transform_tensor(self, jax_array: jax.Array) -> jax.Array:
            return self.fn(jax_array)

        def update_tensor(self, new_value: jax.Array, jax_array: jax.Array) -> jax.Array:
            ids = self.fn(jnp.arange(jax_array.size, dtype=jnp.int32).reshape(jax_array.shape))
            flat = jax_array.ravel().at[ids.ravel()].set(new_value.astype(jax_array.dtype).ravel())
            return flat.reshape(jax_array.shape)

        def calculate_output_shape(self, source: jax.Array) -> list[int]:
            return list(jax.eval_shape(self.fn, source).shape)

    class SelectionView(view_base):
        """A view that also answers as torchax's tensors do to code reading or setting their
        array (`_elem`: torchax's Tensor methods, type_as among them, read their arguments'):
        read, its values; set, a write into its source."""

        @property
        def _elem(self) -> jax.Array:
            return self.jax()

        @_elem.setter
        def _elem(self, value: jax.Array) -> None:
            self.update(value)

    return SelectionInfo, SelectionView


class ViewOf:
    """A view op (VIEW_OPS) lowered as a view of its input, computed by torchax's own lowering
    of the op (`lowering`, a function of arrays)."""

    writes_views = True  # handed a view as the view (ops.overridden): views of views chain

    def __init__(self, lowering: Callable[..., jax.Array]):
        self.lowering = lowering

    def __call__(self, source: Any, *args: Any, **kwargs: Any) -> Any:
        fn = functools.partial(self.lowering_of, args=args, kwargs=kwargs)
        info, view = selection_view()
        return view(source, info(fn), source._env)

    def lowering_of(self, array: jax.Array, args: tuple, kwargs: dict) -> jax.Array:
        return self.lowering(array, *args, **kwargs)


def _matrix_transpose(array: jax.Array) -> jax.Array:
    return jnp.swapaxes(array, -1, -2)


def _adjoint(array: jax.Array) -> jax.Array:
    return jnp.conj(jnp.swapaxes(array, -1, -2))


# View ops torchax has no lowering of (an affine_grid reaches mT), lowered here.
OWN_VIEWS = {"mT": _matrix_transpose, "mH": _adjoint, "adjoint": _adjoint}


def view_ops(env: Any) -> dict[Any, ViewOf]:
    """VIEW_OPS lowered as views, each through the lowering torchax has for it in `env`, and
    OWN_VIEWS."""
    table: dict[Any, ViewOf] = {}
    for packet_name, fn in OWN_VIEWS.items():
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is not None:
            table[packet] = table[packet.default] = ViewOf(fn)
    for name in VIEW_OPS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        found = env._ops.get(op) or env._ops.get(getattr(torch.ops.aten, packet, None))
        if op is not None and found is not None and found.is_jax_function:
            table[op] = ViewOf(found.func)
    return table
