"""XLA's attention for the jax backend with flash attention's memory: jax.nn.dot_product_attention's
own arithmetic (its float32 softmax and low-precision matmuls), with a backward of its own that
keeps nothing T x S but the probabilities, once, in the inputs' dtype (XLA's autodiff keeps them
in float32 and again in the inputs' dtype). attention.py chooses it per shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _wide_matmul(spec: str, a: jax.Array, b: jax.Array, exact: bool = False) -> jax.Array:
    """einsum(spec, a, b) into float32 from low-precision operands, kept in their dtype on a GPU;
    `exact` names jax's bf16 x bf16 -> float32 algorithm, as jax.nn.dot_product_attention does
    for its logits. XLA:CPU has no such dot (it fails when run): there the operands are widened
    first, which is exact (a product of two bf16 or f16 values is exact in float32)."""
    f32 = jnp.float32
    if a.dtype == f32 and b.dtype == f32:
        return jnp.einsum(spec, a, b)
    precision = (
        jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if exact and a.dtype == jnp.bfloat16 else None
    )
    return jax.lax.platform_dependent(
        cpu=lambda: jnp.einsum(spec, a.astype(f32), b.astype(f32)),
        default=lambda: jnp.einsum(spec, a, b, precision=precision, preferred_element_type=f32),
    )


def _logits(query, key, bias, mask, scale: float, is_causal: bool) -> jax.Array:
    """[B, N, T, S] float32 logits, scaled, biased and masked (a masked position the lowest
    float, as jax.nn.dot_product_attention masks)."""
    logits = _wide_matmul("BTNH,BSNH->BNTS", query, key, exact=True)
    logits = logits * jnp.float32(scale)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if is_causal:
        tokens, keys = logits.shape[-2:]
        causal = jnp.tril(jnp.ones((tokens, keys), jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return logits


def _attention_forward(query, key, value, bias, mask, scale: float, is_causal: bool) -> tuple:
    logits = _logits(query, key, bias, mask, scale, is_causal)
    # Held as they are (an optimization barrier): otherwise XLA computes the probabilities
    # again from the float32 logits wherever they are read, the backward's reads among them,
    # and so keeps the logits, twice their size, until then.
    probs = jax.lax.optimization_barrier(jax.nn.softmax(logits, axis=-1).astype(value.dtype))
    out = jnp.einsum("BNTS,BSNH->BTNH", probs, value)  # in value's dtype, as jax's own
    return out, (query, key, value, bias, mask, out, probs)


def _summed_to(grad: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`grad` summed over the axes a value of `shape` was broadcast along."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(tuple(range(lead))) if lead else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axes, keepdims=True) if axes else grad


def _attention_backward(scale: float, is_causal: bool, saved: tuple, grad: jax.Array) -> tuple:
    query, key, value, bias, _, out, low_probs = saved
    f32 = jnp.float32
    probs = low_probs.astype(f32)
    d_value = _wide_matmul("BNTS,BTNH->BSNH", low_probs, grad)
    d_probs = _wide_matmul("BTNH,BSNH->BNTS", grad, value)
    delta = jnp.einsum("BTNH,BTNH->BNT", grad.astype(f32), out.astype(f32))[..., None]
    d_logits = probs * (d_probs - delta)
    low = d_logits.astype(query.dtype)  # flash attention's: the gradient's matmuls in bf16
    d_query = _wide_matmul("BNTS,BSNH->BTNH", low, key) * scale
    d_key = _wide_matmul("BNTS,BTNH->BSNH", low, query) * scale
    d_bias = None if bias is None else _summed_to(d_logits, bias.shape).astype(bias.dtype)
    return (
        d_query.astype(query.dtype),
        d_key.astype(key.dtype),
        d_value.astype(value.dtype),
        d_bias,
        None,  # the mask: no gradient
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def recomputed_attention(query, key, value, bias, mask, scale: float, is_causal: bool):
    """[B, T, N, H] attention as XLA's own ops, jax.nn.dot_product_attention's "xla" forward
    (its float32 softmax and low-precision matmuls, the same values), whose backward keeps the
    T x S probabilities once, in the inputs' dtype, beside the inputs and the output; XLA's
    autodiff keeps them in float32 and again in the inputs' dtype. The backward's matmuls take
    the logits' gradient in the inputs' dtype, as flash attention's do."""
    return _attention_forward(query, key, value, bias, mask, scale, is_causal)[0]


recomputed_attention.defvjp(_attention_forward, _attention_backward)
