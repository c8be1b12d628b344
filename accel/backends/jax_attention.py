"""Attention for the jax backend: torch's scaled_dot_product_attention as
jax.nn.dot_product_attention, on cuDNN flash attention where the GPU takes it.

cuDNN's fused kernel refuses the sequence lengths of ViT (197 tokens) and Swin windows (49), so
tokens are padded to a multiple of 16 and the true lengths passed as `query_seq_lengths` /
`key_value_seq_lengths`: cuDNN masks the padded keys, and the padded query rows are sliced off.
A shape, dtype or mask that cuDNN refuses falls back to XLA's attention, named once in a warning.
Part of the jax backend (imported only by accel/backends/jax.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp

FLASH_MULTIPLE = 16  # sequence lengths cuDNN flash attention takes with padding
FLASH_DTYPES = (jnp.bfloat16, jnp.float16)


def _pad_axis(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _pad_mask_like(x: jax.Array | None, tokens: int, padded: int, value) -> jax.Array | None:
    """Pads the query and key axes of a [.., T, S] bias or mask that has them (not the
    broadcast ones of size 1)."""
    if x is None:
        return None
    for axis in (-2, -1):
        if x.shape[axis] == tokens:
            x = _pad_axis(x, x.ndim + axis, padded, value)
    return x


def padded_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    implementation: Literal["xla", "cudnn"] | None = "cudnn",
    multiple: int = FLASH_MULTIPLE,
) -> jax.Array:
    """[B, T, heads, D] attention with T padded to `multiple` and the true length passed on;
    equal to unpadded attention (self-attention: queries and keys have the same length)."""
    batch, tokens = query.shape[:2]
    padded = math.ceil(tokens / multiple) * multiple
    q, k, v = (_pad_axis(t, 1, padded) for t in (query, key, value))
    lengths = jnp.full((batch,), tokens, jnp.int32)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=_pad_mask_like(bias, tokens, padded, 0),
        mask=_pad_mask_like(mask, tokens, padded, False),
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )
    return out[:, :tokens]


@dataclass
class AttentionKernels:
    """Which attention the traced step uses, and what cuDNN refused (one warning per shape)."""

    flash: bool  # try cuDNN flash attention (CUDA GPU, bf16/fp16 inputs)
    calls: int = 0  # attention calls traced
    flash_calls: int = 0  # of which onto cuDNN
    refused: dict[str, str] = field(default_factory=dict)  # shape -> cuDNN's reason

    def __call__(self, query, key, value, bias, mask, scale, is_causal) -> jax.Array:
        self.calls += 1
        if self.flash and query.dtype in FLASH_DTYPES and query.shape[1] == key.shape[1]:
            try:
                out = padded_attention(query, key, value, bias, mask, scale, is_causal)
            except (NotImplementedError, ValueError, RuntimeError) as err:
                self.refuse(describe(query, bias, mask), err)
            else:
                self.flash_calls += 1
                return out
        return jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal
        )

    def refuse(self, shape: str, err: BaseException) -> None:
        if shape in self.refused:
            return
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.refused[shape] = reason
        warnings.warn(
            f"cuDNN flash attention refused {shape} ({reason}): XLA's attention runs it",
            stacklevel=2,
        )

    def give_up(self, err: BaseException) -> None:
        """cuDNN failed after tracing had chosen it: no flash attention from here on."""
        self.flash = False
        self.flash_calls = 0
        self.refuse("the whole step (backward or compile)", err)

    def stats(self) -> dict:
        return {
            "attention": "cudnn" if self.flash_calls and not self.refused else "xla",
            "flash_attention_calls": self.flash_calls,
            "flash_attention_refused": dict(self.refused),
        }


def describe(query: jax.Array, bias: jax.Array | None, mask: jax.Array | None) -> str:
    batch, tokens, heads, dim = query.shape
    text = f"batch {batch}, {tokens} tokens, {heads} heads of {dim}, {query.dtype}"
    if bias is not None:
        text += f", bias {tuple(bias.shape)}"
    if mask is not None:
        text += f", mask {tuple(mask.shape)}"
    return text
