"""The Pallas kernels of the fused window attention (window_attention.py): one program per group
of sequences and head, each sequence one tile of `padded` rows, padded inside the kernel with
masked loads. Part of the jax backend (imported only by accel/backends/jax/)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

# Each program takes sequences [i * G, (i + 1) * G) of head h (grid (heads, B / G): the heads
# vary fastest, so neighbouring programs read neighbouring D-wide rows of [B, T, heads, D]).
# A ref's block is [G, P, D] (its heads axis squeezed), P = padded_tokens(T): rows >= T of a
# block lie outside the array, so every load and store of them is masked.


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """a . b over a's axis contract[0] and b's contract[1], accumulated in float32 (Triton
    transposes in registers for the other axes)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


class _Tile:
    """The masks of one [P, D] tile of a T-token sequence, and masked loads with them."""

    def __init__(self, tokens: int, padded: int, dim: int) -> None:
        self.valid = jnp.arange(padded) < tokens  # [P]: real tokens
        self.rows = jnp.broadcast_to(self.valid[:, None], (padded, dim))
        self.square = self.valid[:, None] & self.valid[None, :]  # [P, P]

    def load(self, ref: Any, dtype: Any = None) -> jax.Array:
        """A [P, D] tile, zeros in the padded rows (never garbage: 0 * NaN would spread)."""
        x = plgpu.load(ref, mask=self.rows, other=0)
        return x if dtype is None else x.astype(dtype)

    def load_square(self, ref: Any) -> jax.Array:
        """A [P, P] float32 tile of a T x T array (a bias), zeros outside T x T."""
        return plgpu.load(ref, mask=self.square, other=0).astype(jnp.float32)


def _logits(
    tile: _Tile, q: jax.Array, k: jax.Array, bias: jax.Array | None, scale: float
) -> jax.Array:
    """[P, P] float32 logits q k^T * scale + bias, -inf for the padded keys."""
    logits = _dot(q, k, (1, 1)) * scale
    if bias is not None:
        logits = logits + bias
    return jnp.where(tile.valid[None, :], logits, -jnp.inf)


def _loop(group: int, body: Callable[[Any, Any], Any], carry: Any) -> Any:
    """body(g, carry) for g < group: a Python call for one sequence (no loop in the kernel;
    g an int32 all the same, as Pallas's interpreter indexes refs with arrays only)."""
    if group == 1:
        return body(jnp.int32(0), carry)
    return lax.fori_loop(0, group, body, carry)


def forward_kernel(
    *refs: Any, tokens: int, scale: float, group: int, bias_kind: str | None
) -> None:
    """Refs q, k, v[, bias] in, out and the float32 log-sum-exp out: softmax(q k^T * scale +
    bias) v for each of the program's `group` sequences (`bias_kind`: None, "shared" by the
    batch, or one a "sequence")."""
    bias_ref: Any = None
    if bias_kind is None:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, bias_ref, o_ref, lse_ref = refs
    padded, dim = q_ref.shape[1:]
    tile = _Tile(tokens, padded, dim)
    # A shared bias is read once per program, for all its sequences.
    shared = tile.load_square(bias_ref) if bias_kind == "shared" else None

    def body(g, carry):
        q, k, v = (tile.load(ref.at[g]) for ref in (q_ref, k_ref, v_ref))
        bias = tile.load_square(bias_ref.at[g]) if bias_kind == "sequence" else shared
        logits = _logits(tile, q, k, bias, scale)
        top = jnp.max(logits, axis=1)
        probs = jnp.exp(logits - top[:, None])
        total = jnp.sum(probs, axis=1)
        # Normalised before the matmul, in the inputs' dtype: XLA's attention's arithmetic.
        probs = probs * (1.0 / total)[:, None]
        out = _dot(probs.astype(v.dtype), v, (1, 0))
        plgpu.store(o_ref.at[g], out.astype(o_ref.dtype), mask=tile.rows)
        plgpu.store(lse_ref.at[g], top + jnp.log(total), mask=tile.valid)
        return carry

    _loop(group, body, 0)


def backward_kernel(
    *refs: Any, tokens: int, scale: float, group: int, bias_kind: str | None
) -> None:
    """Refs q, k, v[, bias], out, log-sum-exp, the output's gradient in; the gradients of q, k,
    v[, the bias: a shared one summed over the program's sequences] out, the probabilities
    computed again from the log-sum-exp."""
    bias_ref: Any = None
    dbias_ref: Any = None
    if bias_kind is None:
        q_ref, k_ref, v_ref, o_ref, lse_ref, do_ref, dq_ref, dk_ref, dv_ref = refs
    else:
        q_ref, k_ref, v_ref, bias_ref, o_ref, lse_ref, do_ref = refs[:7]
        dq_ref, dk_ref, dv_ref, dbias_ref = refs[7:]
    padded, dim = q_ref.shape[1:]
    tile = _Tile(tokens, padded, dim)
    shared = tile.load_square(bias_ref) if bias_kind == "shared" else None
    f32 = jnp.float32

    def body(g, dbias_sum):
        q, k, v = (tile.load(ref.at[g]) for ref in (q_ref, k_ref, v_ref))
        grad = tile.load(do_ref.at[g])
        lse = plgpu.load(lse_ref.at[g], mask=tile.valid, other=0)
        bias = tile.load_square(bias_ref.at[g]) if bias_kind == "sequence" else shared
        logits = _logits(tile, q, k, bias, scale)
        # Padded query rows (lse 0) would give exp(logits) there: zero them outright.
        probs = jnp.where(tile.valid[:, None], jnp.exp(logits - lse[:, None]), 0.0)
        low = q.dtype
        dv = _dot(probs.astype(low), grad, (0, 0))
        dprobs = _dot(grad, v, (1, 1))
        delta = jnp.sum(grad.astype(f32) * tile.load(o_ref.at[g], f32), axis=1)
        dlogits = probs * (dprobs - delta[:, None])
        dq = _dot(dlogits.astype(low), k, (1, 0)) * scale
        dk = _dot(dlogits.astype(low), q, (0, 0)) * scale
        for ref, value in ((dq_ref, dq), (dk_ref, dk), (dv_ref, dv)):
            plgpu.store(ref.at[g], value.astype(ref.dtype), mask=tile.rows)
        if bias_kind == "sequence":
            plgpu.store(dbias_ref.at[g], dlogits.astype(dbias_ref.dtype), mask=tile.square)
        return dbias_sum + dlogits if bias_kind == "shared" else dbias_sum

    dbias_sum = _loop(group, body, jnp.zeros((padded, padded), f32))
    if bias_kind == "shared":
        plgpu.store(dbias_ref, dbias_sum, mask=tile.square)
