"""Attention for the jax backend: torch's scaled_dot_product_attention on cuDNN flash attention,
on a fused Pallas kernel for short biased windows (window_attention.py), or on XLA's own ops,
chosen per shape (`prepare(attention=...)`): "xla" every attention as XLA's ops (no custom call);
"cudnn" cuDNN flash attention for every shape it can; "pallas" the fused window kernel for every
shape it can (on a CPU through Pallas's interpreter: slow, for checking it); "auto" per shape
from AUTO_RULES below: the fused kernel for Swin's biased windows on a GPU, cuDNN for ViT's.

cuDNN's fused kernel refuses the sequence lengths of ViT (197 tokens) and Swin windows (49), so
tokens are padded to a multiple of 16 and the true lengths passed as `query_seq_lengths` /
`key_value_seq_lengths`: cuDNN masks the padded keys, and the padded query rows are sliced off.
A shape, dtype or mask that cuDNN refuses falls back to XLA's attention, named once in a warning.
Without a CUDA GPU every shape runs on XLA, and stats() still says what each shape would take.
XLA's attention (recomputed_attention.py) is jax.nn.dot_product_attention's own arithmetic with
a backward of its own that keeps the T x S probabilities once, in the input's dtype (XLA's
autodiff kept them in float32 and in the input's dtype). Part of the jax backend.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from accel.backends.jax import window_attention
from accel.backends.jax.recomputed_attention import recomputed_attention
from accel.config import AttentionChoice

FLASH_MULTIPLE = 16  # sequence lengths cuDNN flash attention takes with padding
# The custom calls of cuDNN's attention (jax's fused_attention_stablehlo), forward and backward,
# with and without a bias and dropout. jax.export refuses them (they carry no promise that a
# later jax reads them); a step exported here is read back by this same jax alone.
CUDNN_CALLS = tuple(
    f"__cudnn$fmha{bias}Softmax{dropout}{backward}"
    for bias in ("", "ScaleBias")
    for dropout in ("", "Dropout")
    for backward in ("", "Backward")
)
FLASH_DTYPES = (jnp.bfloat16, jnp.float16)
Implementation = Literal["cudnn", "pallas", "xla"]


class Rule(NamedTuple):
    """Shapes with at most `max_tokens` tokens and `max_head_dim` per head (None: any), and a
    bias or not (`biased`; None: either), take `implementation`."""

    max_tokens: int | None
    max_head_dim: int | None
    biased: bool | None
    implementation: Implementation
    why: str


# What "auto" picks, first matching rule wins. Measured with bench/attention_shapes.py on one
# H200 (2026-11-26; jax 0.11.2, cuDNN through jax-cuda13-plugin 0.11.2; bf16, batch 128,
# forward + backward with the bias's gradient), bench/results/gpu-check-nvidia-h200.json:
# - Swin-T's 49-token windows, XLA against cuDNN: 1.5-8x faster per call, 8.5 against 28.8 ms of
#   a training step; the whole step 4039 img/s on jax with XLA's attention, 2526 with cuDNN's.
# - Swin-B/384's 144-token windows with a bias: 13.9 (XLA) against 22.1 ms (cuDNN).
# - ViT-B/16 (197 tokens, no bias) on cuDNN: jax at torch.compile's speed (3343 against 3320
#   img/s); XLA's attention at that shape is not yet measured.
# - The fused window kernel for biased windows of at most 128 tokens: not yet timed on a GPU;
#   compiled for an H200, a fifth of XLA's attention's bytes (bench/results/h200-program.json).
AUTO_RULES: tuple[Rule, ...] = (
    Rule(
        window_attention.MAX_TOKENS,
        None,
        True,
        "pallas",
        "a bias on short windows (Swin's relative positions, its shift mask): one fused kernel "
        "each way, nothing T x T kept (XLA's keeps the probabilities; cuDNN's measured 1.5-8x "
        "slower than XLA's at 49 tokens on an H200)",
    ),
    Rule(
        None,
        None,
        True,
        "xla",
        "a bias on long windows: XLA's attention measured faster than cuDNN's at 144 tokens "
        "(Swin-B/384) on an H200",
    ),
    Rule(
        127,
        None,
        None,
        "xla",
        "under 128 tokens: one tile of the flash kernel, padded; the T x T logits are small "
        "enough for XLA's fusions",
    ),
    Rule(
        None,
        128,
        None,
        "cudnn",
        "128 tokens or more, no bias (ViT-B/16's 197, padded to 208): flash attention",
    ),
    Rule(None, None, None, "xla", "head dim above 128: beyond cuDNN flash attention's kernels"),
)


def auto_choice(tokens: int, head_dim: int, biased: bool = False) -> Rule:
    """The rule of AUTO_RULES a [B, tokens, heads, head_dim] attention (with a bias or an
    additive mask where `biased`) falls under."""
    return next(
        rule
        for rule in AUTO_RULES
        if (rule.max_tokens is None or tokens <= rule.max_tokens)
        and (rule.max_head_dim is None or head_dim <= rule.max_head_dim)
        and (rule.biased is None or rule.biased == biased)
    )


def padded_length(tokens: int, multiple: int = FLASH_MULTIPLE) -> int:
    """The sequence length the cuDNN path pads `tokens` to."""
    return math.ceil(tokens / multiple) * multiple


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
    padded = padded_length(tokens, multiple)
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
    """Which attention each traced shape takes, what it ran on, and what cuDNN refused (one
    warning per shape). `choice`: "auto" (AUTO_RULES), "cudnn" or "xla"; its default, "cudnn",
    is the path this class had before there was a choice (the backend passes the config's)."""

    flash: bool  # cuDNN flash attention can run here (a CUDA GPU)
    choice: AttentionChoice = "cudnn"
    calls: int = 0  # attention calls traced
    flash_calls: int = 0  # of which onto cuDNN
    pallas_calls: int = 0  # of which onto the fused window kernel
    gave_up: bool = False  # a custom kernel failed the step: XLA's attention from then on
    refused: dict[str, str] = field(default_factory=dict)  # shape -> cuDNN's reason
    shapes: dict[str, dict] = field(default_factory=dict)  # shape -> what it took, and why

    def chosen(self, tokens: int, head_dim: int, biased: bool) -> tuple[Implementation, str]:
        """The implementation `choice` asks for at this shape, and why."""
        if self.choice == "auto":
            rule = auto_choice(tokens, head_dim, biased)
            return rule.implementation, f"auto: {rule.why}"
        return self.choice, f"asked for ({self.choice})"

    def __call__(self, query, key, value, bias, mask, scale, is_causal) -> jax.Array:
        self.calls += 1
        shape = describe(query, bias, mask)
        tokens, head_dim = query.shape[1], query.shape[-1]
        chose, why = self.chosen(tokens, head_dim, biased=bias is not None or mask is not None)
        ran: Implementation = "xla"
        out = None
        if chose == "cudnn":
            out, why = self.cudnn(shape, query, key, value, bias, mask, scale, is_causal, why)
        elif chose == "pallas":
            out, why = self.pallas(query, key, value, bias, mask, scale, is_causal, why)
        if out is not None:
            ran = chose
            self.flash_calls += chose == "cudnn"
            self.pallas_calls += chose == "pallas"
        self.note(shape, tokens, chose, ran, why)
        if out is not None:
            return out
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        return recomputed_attention(query, key, value, bias, mask, scale, is_causal)

    def cudnn(self, shape, query, key, value, bias, mask, scale, is_causal, why: str) -> tuple:
        """(cuDNN flash attention's output, or None where it cannot run it; why)."""
        if not self.flash:
            return None, why + "; no cuDNN here (no CUDA GPU, or it failed): XLA ran it"
        if query.dtype not in FLASH_DTYPES or query.shape[1] != key.shape[1]:
            return None, why + "; cuDNN flash takes bf16/fp16 self-attention only: XLA ran it"
        try:
            return padded_attention(query, key, value, bias, mask, scale, is_causal), why
        except (NotImplementedError, ValueError, RuntimeError) as err:
            self.refuse(shape, err)
            return None, why + "; cuDNN refused it: XLA ran it"

    def pallas(self, query, key, value, bias, mask, scale, is_causal, why: str) -> tuple:
        """(the fused window kernel's output, or None where it does not take the shape; why).
        Without a GPU only when asked for by name, through Pallas's interpreter."""
        if self.gave_up:
            return None, why + "; it failed the step before: XLA ran it"
        if not self.flash and self.choice != "pallas":
            return None, why + "; no CUDA GPU here: XLA ran it"
        refused = window_attention.supports(query, key, bias, mask, is_causal)
        if refused is not None:
            return None, why + f"; the fused kernel does not take {refused}: XLA ran it"
        interpret = not self.flash
        out = window_attention.fused_attention(query, key, value, bias, scale, interpret)
        return out, why + ("; through Pallas's interpreter (no CUDA GPU)" if interpret else "")

    def note(self, shape: str, tokens: int, chose: str, ran: str, why: str) -> None:
        seen = self.shapes.get(shape, {"calls": 0})
        self.shapes[shape] = {
            "calls": seen["calls"] + 1,
            "tokens": tokens,
            "cudnn_padded_tokens": padded_length(tokens),
            "chose": chose,
            "ran": ran,
            "why": why,
        }

    def refuse(self, shape: str, err: BaseException) -> None:
        if shape in self.refused:
            return
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.refused[shape] = reason
        warnings.warn(
            f"cuDNN flash attention refused {shape} ({reason}): XLA's attention runs it",
            stacklevel=2,
        )

    def traced(self) -> dict:
        """What tracing told of each shape, kept with a step saved for later launches."""
        keys = ("calls", "flash_calls", "pallas_calls", "refused", "shapes")
        return {k: getattr(self, k) for k in keys}

    def restore(self, traced: dict) -> None:
        """What `traced` kept, for a step loaded instead of traced."""
        for key, value in traced.items():
            setattr(self, key, value)

    @contextlib.contextmanager
    def on_gpu(self, gpu: bool = True) -> Iterator[None]:
        """Within: each shape takes what it would on a CUDA GPU (cuDNN where chosen and taken),
        for a step lowered here for one (Engine.lowered_step's platforms); the shapes traced
        within are forgotten after it."""
        kept = self.flash, self.flash_calls, self.pallas_calls, dict(self.shapes)
        self.flash = self.flash or gpu
        try:
            yield
        finally:
            self.flash, self.flash_calls, self.pallas_calls, self.shapes = kept

    @property
    def kernel_calls(self) -> int:
        """Attention calls traced onto a custom kernel (cuDNN's or the fused window one)."""
        return self.flash_calls + self.pallas_calls

    def give_up(self, err: BaseException) -> None:
        """A custom kernel failed after tracing had chosen it: XLA's attention from here on
        (the shapes are traced again, and say so)."""
        self.flash, self.gave_up = False, True
        self.flash_calls = self.pallas_calls = 0
        self.shapes.clear()
        self.refuse("the whole step (backward or compile)", err)

    def stats(self) -> dict:
        ran = {s["ran"] for s in self.shapes.values()}
        return {
            "attention": "+".join(sorted(ran)) if ran else "xla",
            "attention_choice": self.choice,
            "attention_shapes": {k: dict(v) for k, v in self.shapes.items()},
            "flash_attention_calls": self.flash_calls,
            "pallas_attention_calls": self.pallas_calls,
            "flash_attention_refused": dict(self.refused),
        }


def describe(query: jax.Array, bias: jax.Array | None, mask: jax.Array | None) -> str:
    batch, tokens, heads, dim = query.shape
    extra = [
        f", {n} {tuple(x.shape)}" for n, x in (("bias", bias), ("mask", mask)) if x is not None
    ]
    return f"batch {batch}, {tokens} tokens, {heads} heads of {dim}, {query.dtype}" + "".join(extra)
