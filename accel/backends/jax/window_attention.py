"""Fused attention for short biased windows (Swin's), one Pallas kernel each way, lowered to
Triton on a GPU: flash attention's recomputation for sequences that fit one tile.

Why: Swin-T's window attention (49 tokens, head dim 32, an additive bias) on an H200 took 8.5 ms
of a training step as XLA's ops against 5.3 ms for torch.compile's fused CUTLASS kernels; XLA's
ops write the T x T logits, keep the T x T probabilities for the backward (in bf16) and read them
back. Here the forward keeps only the output and a float32 log-sum-exp per query row, and the
backward recomputes the probabilities from q, k, the bias and that log-sum-exp inside its kernel.
Compiled without a GPU for an H200 (XLA:GPU's deviceless compile, jax 0.10.2) at Swin-T's stage 1
(batch 8192 windows, 3 heads, bf16), forward + backward: 3 kernels reading and writing 0.96 GB
with the shared bias (2 kernels, 1.28 GB with the per-window one), against 27 kernels and 7.3 GB
(26, 7.2 GB) for XLA's attention (recomputed_attention.py).

What runs: per (group of sequences, head) one program; every sequence is one tile of
`padded_tokens(T)` rows (T padded to a power of two, at least 16: Triton's blocks and tl.dot's
minimum), padded inside the kernel with masked loads (padded keys -inf, padded query rows never
stored); nothing is padded in memory. Forward: logits q k^T * scale + bias accumulated in
float32, softmax in float32, output in the inputs' dtype, log-sum-exp [B, heads, T] in float32.
Backward (one kernel): dv = p^T do, dp = do v^T, delta = rowsum(do * out), ds = p * (dp - delta),
dq = ds k * scale, dk = ds^T q * scale (ds and p enter the matmuls in the inputs' dtype, as
flash attention's), and the bias's gradient ds summed to the bias's shape: a bias shared by the
batch gets float32 partial sums over groups of sequences ([B / G, heads, T, T], summed by XLA
after), a per-sequence bias its [B, heads, T, T] gradient in its own dtype.

Limits (`supports` says which): self-attention of at most 128 tokens, head dim 16, 32, 64 or
128, q/k/v of one dtype (bf16, f16 or float32), an additive float bias broadcastable to
[B, heads, T, T] whose last two axes are T x T (or none); no boolean mask, no causal mask, no
dropout. float32 inputs take the matmul precision jax's configuration gives (TF32 on a GPU by
default). `interpret=True` runs the kernels through Pallas's interpreter (any backend, slowly:
the tests on a CPU). jax.export refuses the kernels' custom call (Triton's IR carries no
promise that a later jax reads it): a step exported with them names TRITON_CALLS in its
disabled checks, and is read back by this same jax alone. Part of the jax backend (imported only
by accel/backends/jax/).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from accel.backends.jax.window_kernels import backward_kernel, forward_kernel

MAX_TOKENS = 128  # one tile: beyond it a sequence needs flash attention's loop over key blocks
HEAD_DIMS = (16, 32, 64, 128)  # powers of two (Triton's blocks), at least tl.dot's 16
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MIN_TILE = 16  # tl.dot's smallest M, N and K
MAX_GROUP = 16  # sequences one program takes for a shared bias (the gradient's partial sums)
# Programs a grid should keep for the GPU's 132 SMs to have several each: a group is shrunk
# until the grid has this many (or is 1).
MIN_PROGRAMS = 1024
# The custom call a Pallas-Triton kernel lowers to: jaxlib 0.10.2 and older hand XLA the Triton
# IR ("__gpu$xla.gpu.triton", compiled with the program); later ones compile it while lowering
# ("triton_kernel_call_ffi"). Neither is on jax.export's list of stable targets.
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def padded_tokens(tokens: int) -> int:
    """The tile's rows for `tokens` tokens: the next power of two, at least 16."""
    return max(MIN_TILE, pl.next_power_of_2(tokens))


def sequence_group(batch: int, heads: int) -> int:
    """Sequences per program for a bias shared by the batch: the largest divisor of `batch` up
    to MAX_GROUP that leaves at least MIN_PROGRAMS programs (batch / G x heads), else 1. Each
    program sums its sequences' bias gradients, so the gradient written is [batch / G, heads,
    T, T] float32 partial sums rather than [batch, heads, T, T]."""
    fits = [
        g
        for g in range(1, MAX_GROUP + 1)
        if batch % g == 0 and (batch // g) * heads >= MIN_PROGRAMS
    ]
    return max(fits, default=1)


def _bias_4d(bias: jax.Array, batch: int, heads: int) -> tuple[int, int] | None:
    """(batch, heads) of `bias` seen as [b, h, T, T] with b in {1, batch}, h in {1, heads}, or
    None where it is not broadcastable that way."""
    if bias.ndim < 2 or bias.ndim > 4:
        return None
    lead = (1,) * (4 - bias.ndim) + tuple(bias.shape[:-2])
    if lead[0] not in (1, batch) or lead[1] not in (1, heads):
        return None
    return lead[0], lead[1]


def supports(
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    is_causal: bool,
) -> str | None:
    """None where fused_attention takes this [B, T, heads, D] attention, else why not (one
    line)."""
    if mask is not None:
        return "a boolean mask (the kernel takes an additive float bias only)"
    if is_causal:
        return "causal attention (not implemented in the kernel)"
    if query.ndim != 4:
        return f"query of rank {query.ndim} (the kernel takes [B, T, heads, D])"
    if key.shape != query.shape:
        return f"not self-attention of one shape: query {query.shape}, key {key.shape}"
    batch, tokens, heads, dim = query.shape
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens (at most {MAX_TOKENS}: one tile per sequence)"
    if dim not in HEAD_DIMS:
        return f"head dim {dim} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    if query.dtype not in DTYPES or key.dtype != query.dtype:
        return f"dtypes {query.dtype}/{key.dtype} (bf16, f16 or float32, the same for q, k, v)"
    if bias is None:
        return None
    if bias.dtype not in DTYPES:
        return f"bias of dtype {bias.dtype} (an additive bf16, f16 or float32 bias only)"
    if bias.shape[-2:] != (tokens, tokens) or _bias_4d(bias, batch, heads) is None:
        return (
            f"bias {tuple(bias.shape)} (broadcastable to [B, heads, T, T] as [1 or {batch}, "
            f"1 or {heads}, {tokens}, {tokens}])"
        )
    return None


# --- pallas_call and the custom VJP ---------------------------------------------------------


class _Plan:
    """Shapes, grid and block specs of one attention's kernels."""

    def __init__(self, query: jax.Array, bias: jax.Array | None) -> None:
        self.batch, self.tokens, self.heads, self.dim = query.shape
        self.padded = padded_tokens(self.tokens)
        self.bias_kind: str | None = None
        self.bias_heads = 1
        self.group = 1
        if bias is not None:
            found = _bias_4d(bias, self.batch, self.heads)
            if found is None:
                raise ValueError(f"bias {bias.shape} is not broadcastable to {query.shape}")
            bias_batch, self.bias_heads = found
            self.bias_kind = "sequence" if bias_batch == self.batch > 1 else "shared"
            if self.bias_kind == "shared":
                self.group = sequence_group(self.batch, self.heads)
        self.grid = (self.heads, self.batch // self.group)
        # A [P, P] float32 tile is P * P / (32 * warps) registers a thread: 8 warps at 128.
        self.params = plgpu.CompilerParams(num_warps=4 if self.padded <= 64 else 8, num_stages=2)

    def tokens_spec(self) -> pl.BlockSpec:
        """[G, P, D] of [B, T, heads, D]."""
        return pl.BlockSpec((self.group, self.padded, None, self.dim), lambda h, i: (i, 0, h, 0))

    def lse_spec(self) -> pl.BlockSpec:
        """[G, P] of [B, heads, T]."""
        return pl.BlockSpec((self.group, None, self.padded), lambda h, i: (i, h, 0))

    def bias_spec(self) -> pl.BlockSpec:
        """The bias as [b, h, T, T]: [P, P] of its one batch entry (shared), else [G, P, P]."""
        head = (lambda h: h) if self.bias_heads > 1 else (lambda h: 0)
        square = (self.padded, self.padded)
        if self.bias_kind == "shared":
            return pl.BlockSpec((None, None, *square), lambda h, i: (0, head(h), 0, 0))
        return pl.BlockSpec((self.group, None, *square), lambda h, i: (i, head(h), 0, 0))

    def dbias_spec(self) -> pl.BlockSpec:
        """The bias's gradient: [P, P] of [B / G, heads, T, T] partial sums (shared), else
        [G, P, P] of [B, heads, T, T]."""
        square = (self.padded, self.padded)
        if self.bias_kind == "shared":
            return pl.BlockSpec((None, None, *square), lambda h, i: (i, h, 0, 0))
        return pl.BlockSpec((self.group, None, *square), lambda h, i: (i, h, 0, 0))

    def kernel(self, fn: Callable[..., None], scale: float) -> Callable[..., None]:
        """`fn` with this plan's static arguments."""
        return functools.partial(
            fn, tokens=self.tokens, scale=scale, group=self.group, bias_kind=self.bias_kind
        )


def _as_4d(bias: jax.Array | None) -> jax.Array | None:
    """The bias with leading axes of 1 up to rank 4 (a reshape: no copy)."""
    if bias is None or bias.ndim == 4:
        return bias
    return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


def _forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    scale: float,
    interpret: bool,
) -> tuple[jax.Array, tuple]:
    bias4 = _as_4d(bias)
    plan = _Plan(query, bias4)
    tokens = plan.tokens_spec()
    in_specs = [tokens, tokens, tokens]
    operands = [query, key, value]
    if bias4 is not None:
        in_specs.append(plan.bias_spec())
        operands.append(bias4)
    out, lse = pl.pallas_call(
        plan.kernel(forward_kernel, scale),
        grid=plan.grid,
        in_specs=in_specs,
        out_specs=[tokens, plan.lse_spec()],
        out_shape=[
            jax.ShapeDtypeStruct(query.shape, value.dtype),
            jax.ShapeDtypeStruct((plan.batch, plan.heads, plan.tokens), jnp.float32),
        ],
        compiler_params=plan.params,
        interpret=interpret,
        name="window_attention_forward",
    )(*operands)
    return out, (query, key, value, bias, out, lse)


def _backward(scale: float, interpret: bool, saved: tuple, grad: jax.Array) -> tuple:
    query, key, value, bias, out, lse = saved
    bias4 = _as_4d(bias)
    plan = _Plan(query, bias4)
    tokens = plan.tokens_spec()
    in_specs = [tokens, tokens, tokens]
    operands = [query, key, value]
    out_specs = [tokens, tokens, tokens]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (query, key, value)]
    if bias4 is not None:
        in_specs.append(plan.bias_spec())
        operands.append(bias4)
        out_specs.append(plan.dbias_spec())
        if plan.bias_kind == "shared":  # float32 partial sums, one per group of sequences
            shape = (plan.batch // plan.group, plan.heads, plan.tokens, plan.tokens)
            out_shape.append(jax.ShapeDtypeStruct(shape, jnp.float32))
        else:
            shape = (plan.batch, plan.heads, plan.tokens, plan.tokens)
            out_shape.append(jax.ShapeDtypeStruct(shape, bias4.dtype))
    in_specs += [tokens, plan.lse_spec(), tokens]
    operands += [out, lse, grad]
    grads = pl.pallas_call(
        plan.kernel(backward_kernel, scale),
        grid=plan.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plan.params,
        interpret=interpret,
        name="window_attention_backward",
    )(*operands)
    d_bias = None
    if bias4 is not None:
        d_bias = grads[3]
        # Summed to the bias's shape: the groups' partial sums of a bias shared by the batch,
        # and the heads of a bias shared by them.
        axes = tuple(a for a in (0, 1) if bias4.shape[a] == 1 and d_bias.shape[a] != 1)
        if axes:
            d_bias = d_bias.sum(axes, keepdims=True, dtype=jnp.float32)
        d_bias = d_bias.astype(bias.dtype).reshape(bias.shape)
    return grads[0], grads[1], grads[2], d_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    scale: float,
    interpret: bool,
) -> jax.Array:
    return _forward(query, key, value, bias, scale, interpret)[0]


_attention.defvjp(_forward, _backward)


def fused_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """softmax(q k^T * scale + bias) v over [B, T, heads, D] as one fused Pallas kernel (Triton
    on a GPU), differentiable (one fused kernel backward, the bias's gradient included).
    `scale` defaults to 1 / sqrt(D); `interpret` runs Pallas's interpreter (any backend).
    Raises ValueError for what `supports` refuses.

    >>> import jax.numpy as jnp
    >>> windows = jnp.ones((2, 49, 3, 32))  # 2 windows of 7 x 7 tokens, 3 heads of 32
    >>> bias = jnp.zeros((1, 3, 49, 49))  # a relative-position bias shared by the windows
    >>> fused_attention(windows, windows, windows, bias, interpret=True).shape
    (2, 49, 3, 32)
    """
    reason = supports(query, key, bias, None, False)
    if reason is None and (value.shape != key.shape or value.dtype != key.dtype):
        reason = f"value {value.shape} {value.dtype} unlike key {key.shape} {key.dtype}"
    if reason is not None:
        raise ValueError(f"fused window attention does not take this attention: {reason}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return _attention(query, key, value, bias, scale, bool(interpret))
