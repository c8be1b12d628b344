"""Torch ops whose torchax lowering does not train as eager does, lowered here instead, and the
one way the backend puts its lowerings in torchax's table while it traces:

- cdist: torchax differentiates the norm itself, whose gradient at a zero distance (a point's
  distance to itself) is NaN, so every step was skipped; torch's backward gives 0 there.
- linalg.lstsq: torchax reads the rank back to the host (`rank.item()`), which no traced step
  can; here it stays an array.
- layer_norm: torchax's keeps three activations a norm for its backward (a Flax step keeps
  one); here the input and two float32 statistics a row, the output in the input's dtype.
- add, mul, div with a Python number: torchax makes the result float32 whatever the tensor's
  dtype (a bf16 activation times a scale became float32, and every matmul after it ran in
  float32); here torch's rule (arithmetic.py).
- gelu: torchax's (jax.nn.gelu) keeps, for its backward, an intermediate product as large as
  its output beside its input (ViT-B/16 at batch 128 on an H200: 1.7 GiB of the step's 10.6);
  here the backward computes the derivative again from the input alone, in float32 as torch's
  kernels do for a bf16 input.
- max_pool2d: torchax computes the argmax indices beside the maxima in a reduction JAX cannot
  differentiate, even where nothing reads them (a ResNet's stem could not train); here the
  maxima alone, the indices only where asked for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import accel.backends.jax.runtime as runtime
from accel.backends.jax.arithmetic import add, div, mul


class OfArrays:
    """A lowering written as a function of JAX arrays (and Python numbers), not of torch
    tensors."""

    def __init__(self, fn: Callable):
        self.fn = fn


@contextlib.contextmanager
def overridden(env: Any, table: Mapping[Any, Callable | OfArrays]) -> Iterator[None]:
    """torchax's lowering of each op of `table` (a torch function or an aten op) replaced by its
    own (a function of torch tensors, or OfArrays: of JAX arrays) within the block, torchax's
    restored after it."""
    saved = {op: env._ops.get(op) for op in table}
    for op, lowering in table.items():
        arrays = isinstance(lowering, OfArrays)
        # What env.override_op_definition does; torchax 0.0.13's version omits is_view_op.
        env._ops[op] = runtime.ops_registry.Operator(
            op,
            lowering.fn if isinstance(lowering, OfArrays) else lowering,
            is_jax_function=arrays,
            is_user_defined=True,
            needs_env=False,
            is_view_op=getattr(lowering, "writes_views", False),  # handed views as they are
        )
    try:
        yield
    finally:
        for op, old in saved.items():
            if old is None:
                env._ops.pop(op, None)
            else:
                env._ops[op] = old


def safe_root(value: jax.Array, power: float) -> jax.Array:
    """value ** (1 / power), with a zero gradient where value is 0 (torch's cdist backward)."""
    positive = value > 0
    root = jnp.where(positive, value, 1.0) ** (1.0 / power)
    return jnp.where(positive, root, 0.0)


def jax_cdist(x1: jax.Array, x2: jax.Array, p: float, by_matmul: bool) -> jax.Array:
    """torch.cdist's distances [..., P, Q] between the rows of x1 [..., P, M] and x2 [..., Q,
    M]: Euclidean through a matmul where torch uses one (`by_matmul`), else element-wise."""
    if p == 2 and by_matmul:
        squares = (
            jnp.sum(x1 * x1, -1)[..., :, None]
            + jnp.sum(x2 * x2, -1)[..., None, :]
            - 2 * jnp.einsum("...pm,...qm->...pq", x1, x2)
        )
        return safe_root(jnp.maximum(squares, 0.0), 2.0)
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum(diff != 0, -1).astype(x1.dtype)
    if p == float("inf"):
        return jnp.max(diff, -1)
    if p == 1:
        return jnp.sum(diff, -1)
    return safe_root(jnp.sum(diff**p, -1), p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def jax_layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, dims: int, eps: float) -> jax.Array:
    """Layer norm over the last `dims` axes, the statistics in float32, the output in x's
    dtype; its backward from x and the statistics alone."""
    return layer_norm_forward(x, w, b, dims, eps)[0]


def layer_norm_forward(x, w, b, dims: int, eps: float) -> tuple:
    axes = tuple(range(x.ndim - dims, x.ndim))
    wide = x.astype(jnp.float32)
    mean = wide.mean(axes, keepdims=True)
    centred = wide - mean
    rstd = jax.lax.rsqrt((centred * centred).mean(axes, keepdims=True) + eps)
    y = centred * rstd * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype), (x, mean, rstd, w, b)


def layer_norm_backward(dims: int, eps: float, saved: tuple, grad: jax.Array) -> tuple:
    x, mean, rstd, w, b = saved
    axes = tuple(range(x.ndim - dims, x.ndim))
    rows = tuple(range(x.ndim - dims))
    normed = (x.astype(jnp.float32) - mean) * rstd
    g = grad.astype(jnp.float32)
    g_normed = g * w.astype(jnp.float32)
    dx = rstd * (
        g_normed
        - g_normed.mean(axes, keepdims=True)
        - normed * (g_normed * normed).mean(axes, keepdims=True)
    )
    # Written apart from dx's `normed`, which XLA's fusion for dx wrote out times g, whole in
    # float32, for this reduction to read back (155 MB a norm of ViT-B/16's step on an H200).
    normed_again = x.astype(jnp.float32) * rstd - mean * rstd
    dw = (g * normed_again).sum(rows)
    return dx.astype(x.dtype), dw.astype(w.dtype), g.sum(rows).astype(b.dtype)


jax_layer_norm.defvjp(layer_norm_forward, layer_norm_backward)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,  # torch.layer_norm's last argument (F.layer_norm passes it); unused
) -> torch.Tensor:
    """F.layer_norm and torch.layer_norm (a missing weight or bias as ones or zeros)."""
    dims = len(normalized_shape) if isinstance(normalized_shape, list | tuple) else 1
    shape = tuple(input.shape[-dims:])
    if weight is None:
        weight = torch.ones(shape, dtype=input.dtype, device=input.device)
    if bias is None:
        bias = torch.zeros(shape, dtype=input.dtype, device=input.device)
    norm = lambda x, w, b: jax_layer_norm(x, w, b, dims, eps)  # noqa: E731
    return runtime.interop.call_jax(norm, input, weight, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def jax_gelu(x: jax.Array, tanh: bool) -> jax.Array:
    """GELU computed in float32 and given in x's dtype (torch's kernels compute in float32 for a
    bf16 input); its backward from x alone."""
    return gelu_forward(x, tanh)[0]


SQRT_HALF, SQRT_2_OVER_PI, TANH_CUBIC = 0.7071067811865476, 0.7978845608028654, 0.044715


def gelu_forward(x: jax.Array, tanh: bool) -> tuple:
    wide = x.astype(jnp.float32)
    if tanh:
        inner = SQRT_2_OVER_PI * (wide + TANH_CUBIC * wide**3)
        y = 0.5 * wide * (1.0 + jnp.tanh(inner))
    else:
        y = 0.5 * wide * (1.0 + jax.lax.erf(wide * SQRT_HALF))
    return y.astype(x.dtype), x


def gelu_backward(tanh: bool, x: jax.Array, grad: jax.Array) -> tuple:
    wide, g = x.astype(jnp.float32), grad.astype(jnp.float32)
    if tanh:
        t = jnp.tanh(SQRT_2_OVER_PI * (wide + TANH_CUBIC * wide**3))
        slope = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * wide * wide)
        dy = 0.5 * (1.0 + t) + 0.5 * wide * (1.0 - t * t) * slope
    else:
        cdf = 0.5 * (1.0 + jax.lax.erf(wide * SQRT_HALF))
        dy = cdf + wide * jnp.exp(-0.5 * wide * wide) * (SQRT_HALF / np.sqrt(np.pi))
    return ((g * dy).astype(x.dtype),)


jax_gelu.defvjp(gelu_forward, gelu_backward)


def gelu(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu."""
    tanh = approximate == "tanh"
    return runtime.interop.call_jax(lambda x: jax_gelu(x, tanh), input)


def div_out(
    x: torch.Tensor, y: Any, *, rounding_mode: str | None = None, out: torch.Tensor
) -> torch.Tensor:
    """torch.div(x, y, out=out), as spectral_norm writes its vectors: `div` above, into out."""
    out.copy_(torch.div(x, y, rounding_mode=rounding_mode))
    return out


# aten._cdist_forward's compute_mode, an int, by torch.cdist's names for it
COMPUTE_MODES = {0: "use_mm_for_euclid_dist_if_necessary", 1: "use_mm_for_euclid_dist"}
COMPUTE_MODES[2] = "donot_use_mm_for_euclid_dist"


def cdist(
    x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, compute_mode: str | int | None = None
) -> torch.Tensor:
    """torch.cdist, with torch's choice of the matmul path (more than 25 rows, or asked)."""
    mode = (
        COMPUTE_MODES.get(compute_mode, compute_mode)
        if isinstance(compute_mode, int)
        else (compute_mode or COMPUTE_MODES[0])
    )
    large = x1.shape[-2] > 25 or x2.shape[-2] > 25
    by_matmul = mode == COMPUTE_MODES[1] or (mode == COMPUTE_MODES[0] and large)
    return runtime.interop.call_jax(lambda a, b: jax_cdist(a, b, p, by_matmul), x1, x2)


def lstsq(
    input: torch.Tensor, b: torch.Tensor, rcond: float | None = None, *, driver: str | None = None
) -> Any:
    """torch.linalg.lstsq's (solution, residuals, rank, singular_values), every part an array:
    the residuals and singular values empty, as torch's default driver on the CPU ('gelsy')
    gives them, the rank an array."""

    def solve(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        vector = b.ndim == a.ndim - 1
        b = b[..., None] if vector else b

        def one(a2, b2):
            solution, _, rank, _ = jnp.linalg.lstsq(a2, b2, rcond=rcond)
            return solution, rank

        for _ in range(a.ndim - 2):  # batched: one solve per leading index
            one = jax.vmap(one)
        solution, rank = one(a, b)
        return (solution[..., 0] if vector else solution), rank.astype(jnp.int32)

    solution, rank = runtime.interop.call_jax(solve, input, b)
    empty = torch.empty(0, dtype=input.dtype, device=input.device)
    return torch.return_types.linalg_lstsq((solution, empty, rank, empty))  # type: ignore[attr-defined]


def pool_padding(
    size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool
) -> tuple[int, int]:
    """(low, high) padding of one axis that gives torch's count of windows (ceil_mode's last
    window only where it starts inside the input or its left padding)."""
    span = dilation * (kernel - 1) + 1
    steps = size + 2 * pad - span
    count = (-(-steps // stride) if ceil_mode else steps // stride) + 1
    if ceil_mode and (count - 1) * stride >= size + pad:
        count -= 1
    return pad, max(pad, (count - 1) * stride + span - size - pad)


def max_pool2d(
    input: torch.Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Any:
    """F.max_pool2d as the maxima of each window (torch's own op where indices are asked)."""
    pair = lambda v: tuple(v) if isinstance(v, list | tuple) else (v, v)  # noqa: E731
    kernel = pair(kernel_size)
    strides = pair(stride) if stride not in (None, [], ()) else kernel
    pads, dilations = pair(padding), pair(dilation)
    if return_indices:
        return torch.ops.aten.max_pool2d_with_indices(
            input, kernel, strides, pads, dilations, ceil_mode
        )

    def pool(x: jax.Array) -> jax.Array:
        batch = x.ndim - 2
        padding_ = [(0, 0)] * batch + [
            pool_padding(x.shape[batch + i], kernel[i], strides[i], pads[i], dilations[i],
                         ceil_mode)
            for i in range(2)
        ]  # fmt: skip
        # A NumPy scalar, not an array: only a constant makes it the max reduction JAX
        # differentiates (a traced one is the generic reduction, which it cannot).
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        lowest = np.array(-np.inf if floating else np.iinfo(np.int32).min, x.dtype)
        if dilations == (1, 1):
            return jax.lax.reduce_window(
                x, lowest, jax.lax.max, (1,) * batch + kernel, (1,) * batch + strides, padding_
            )
        # JAX has no gradient of a dilated max window: the windows as patches, then their max
        # (padded with the lowest finite value: the patches are a convolution, -inf x 0 NaN).
        finite = jnp.finfo(x.dtype).min if floating else lowest
        padded = jnp.pad(x, padding_, constant_values=finite)
        shape = padded.shape
        flat = padded.reshape(-1, 1, *shape[-2:])
        patches = jax.lax.conv_general_dilated_patches(
            flat,
            kernel,
            strides,
            "VALID",
            rhs_dilation=dilations,
            precision=jax.lax.Precision.HIGHEST,
        )  # [N * C, kh * kw, out_h, out_w], exact copies of the inputs
        return patches.max(axis=1).reshape(*shape[:-2], *patches.shape[-2:])

    return runtime.interop.call_jax(pool, input)


# Torch's functions and ATen's ops, each lowered as above while the jax backend traces.
EAGER_LOWERINGS: dict[Any, Callable | OfArrays] = {
    torch.ops.aten.mul.Tensor: OfArrays(mul),
    torch.ops.aten.mul.Scalar: OfArrays(mul),
    torch.ops.aten.add.Tensor: OfArrays(add),
    torch.ops.aten.add.Scalar: OfArrays(add),
    torch.ops.aten.div: OfArrays(div),
    torch.ops.aten.div.out: div_out,
    torch.ops.aten.div.out_mode: div_out,
    torch.cdist: cdist,
    torch.ops.aten.cdist: cdist,
    torch.ops.aten._cdist_forward: cdist,
    torch.linalg.lstsq: lstsq,
    torch.ops.aten.linalg_lstsq: lstsq,
    torch.nn.functional.gelu: gelu,
    torch.ops.aten.gelu: gelu,
    torch.nn.functional.layer_norm: layer_norm,
    torch.layer_norm: layer_norm,
    torch.nn.functional.max_pool2d: max_pool2d,
    torch.max_pool2d: max_pool2d,
}
