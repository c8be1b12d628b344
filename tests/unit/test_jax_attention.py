"""The padded attention path of the jax backend (what cuDNN flash attention gets on a GPU), run
through XLA's implementation on the CPU, against attention written out by hand."""

import warnings

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax
import jax.numpy as jnp
import numpy as np

from accel.backends.jax_attention import AttentionKernels, padded_attention


def plain_attention(q, k, v, bias):
    """softmax(q k^T / sqrt(d) + bias) v over [B, T, heads, D]."""
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1]) + bias
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)


def _inputs(tokens: int, bias_batch: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (2, tokens, 3, 16), jnp.float32) for kk in keys[:3])
    bias = jax.random.normal(keys[3], (bias_batch, 3, tokens, tokens), jnp.float32)
    return q, k, v, bias


@pytest.mark.parametrize(
    ("tokens", "bias_batch"),
    [(197, 1), (49, 2)],  # ViT-B/16's tokens; a Swin window with a per-window (shift) bias
)
def test_padded_path_equals_plain_attention_forward_and_gradients(tokens, bias_batch):
    q, k, v, bias = _inputs(tokens, bias_batch)

    def padded(q, k, v, bias):
        return padded_attention(q, k, v, bias=bias, implementation="xla")

    with jax.default_matmul_precision("highest"):
        out = padded(q, k, v, bias)
        assert out.shape == q.shape
        np.testing.assert_allclose(out, plain_attention(q, k, v, bias), rtol=1e-6, atol=1e-6)
        cotangent = jax.random.normal(jax.random.key(7), out.shape)
        grads = jax.vjp(padded, q, k, v, bias)[1](cotangent)
        expected = jax.vjp(plain_attention, q, k, v, bias)[1](cotangent)
    for name, got, want in zip(("q", "k", "v", "bias"), grads, expected, strict=True):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_shape_cudnn_refuses_falls_back_to_xla_once_named():
    # No cuDNN on this machine: every flash attempt is refused, as an unsupported shape would be.
    kernels = AttentionKernels(flash=True)
    q, k, v, bias = (x.astype(jnp.bfloat16) for x in _inputs(49, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = kernels(q, k, v, bias, None, None, False)
        second = kernels(q, k, v, bias, None, None, False)
    refusals = [w for w in caught if "cuDNN flash attention refused" in str(w.message)]
    assert len(refusals) == 1
    assert "49 tokens" in str(refusals[0].message) and "bias (1, 3, 49, 49)" in str(
        refusals[0].message
    )
    np.testing.assert_array_equal(first, second)
    expected = plain_attention(*(x.astype(jnp.float32) for x in (q, k, v, bias)))
    np.testing.assert_allclose(first.astype(jnp.float32), expected, atol=3e-2)
    assert kernels.stats()["attention"] == "xla" and kernels.flash_calls == 0
