"""Lowerings of torch functions a user's loss or model reaches that torchax 0.0.13 has none of (each
was refused in one line, and the model did not train on jax):

- F.ctc_loss (aten::_ctc_loss): through optax.ctc_loss, with torch's targets (padded [N, S] or
  concatenated), lengths, blank, reductions ("mean": each loss over its target length, then the
  batch's mean) and zero_infinity (an alignment the input is too short for: inf, or 0). optax
  normalises its input with a log-softmax, which leaves torch's log-probabilities as they are:
  `log_probs` as F.log_softmax gives them, as torch's documentation asks.
- torch.distributions' argument validation (aten::_is_all_true, read on the host to raise):
  a traced step cannot stop on a value, so inside it the check passes; eager's step raises for
  an invalid argument.
- F.embedding_bag (torch reads its offsets on the host): the bags as segment sums, means and
  maxima over static shapes, padding_idx left out of a bag, per_sample_weights with "sum".

Part of the jax backend (its lowering table, ops.overridden)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch

import accel.backends.jax.runtime as runtime
from accel.backends.jax.ops import OfArrays


def jax_ctc_loss(
    log_probs: jax.Array,
    targets: jax.Array,
    input_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    reduction: str,
    zero_infinity: bool,
) -> jax.Array:
    """torch.nn.functional.ctc_loss on arrays: `log_probs` [T, N, C] (or [T, C])."""
    if log_probs.ndim == 2:  # one sequence
        log_probs, targets = log_probs[:, None], targets.reshape(1, -1)
    input_lengths = jnp.reshape(input_lengths, (-1,)).astype(jnp.int32)
    target_lengths = jnp.reshape(target_lengths, (-1,)).astype(jnp.int32)
    batch, steps = log_probs.shape[1], log_probs.shape[0]
    labels = padded_labels(targets, target_lengths, batch)
    width = labels.shape[1]
    label_pad = (jnp.arange(width)[None] >= target_lengths[:, None]).astype(jnp.float32)
    logit_pad = (jnp.arange(steps)[None] >= input_lengths[:, None]).astype(jnp.float32)
    logits = jnp.swapaxes(log_probs, 0, 1).astype(jnp.float32)
    loss = optax.ctc_loss(logits, logit_pad, labels, label_pad, blank_id=blank)
    # torch's infinity: an input shorter than its labels plus a blank between each repeat
    repeats = jnp.sum((labels[:, 1:] == labels[:, :-1]) & (label_pad[:, 1:] == 0), axis=1)
    impossible = input_lengths < target_lengths + repeats
    loss = jnp.where(impossible, 0.0 if zero_infinity else jnp.inf, loss)
    if reduction == "none":
        return loss.astype(log_probs.dtype)
    if reduction == "sum":
        return loss.sum().astype(log_probs.dtype)
    return (loss / jnp.maximum(target_lengths, 1)).mean().astype(log_probs.dtype)


def padded_labels(targets: jax.Array, lengths: jax.Array, batch: int) -> jax.Array:
    """[N, S] labels: `targets` as given where padded, else torch's concatenation of each
    sequence's labels cut by `lengths` (at most the whole concatenation's length each)."""
    if targets.ndim == 2:
        return targets.astype(jnp.int32)
    width = targets.shape[0]
    starts = jnp.cumsum(lengths) - lengths
    index = jnp.clip(starts[:, None] + jnp.arange(width)[None], 0, max(width - 1, 0))
    labels = targets.astype(jnp.int32)[index]
    return jnp.where(jnp.arange(width)[None] < lengths[:, None], labels, 0)[:batch]


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: Any,
    target_lengths: Any,
    blank: int = 0,
    reduction: str | int = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """F.ctc_loss and torch.ctc_loss (lengths as tensors or lists; torch.ctc_loss's reduction
    by its number)."""
    reduction = REDUCTIONS.get(reduction, reduction) if isinstance(reduction, int) else reduction
    given = {"il": input_lengths, "tl": target_lengths}
    tensors = {k: v for k, v in given.items() if isinstance(v, torch.Tensor)}
    lists = {k: jnp.asarray(v) for k, v in given.items() if k not in tensors}

    def loss(lp, tg, lengths):
        lengths = {**lists, **lengths}
        return jax_ctc_loss(lp, tg, lengths["il"], lengths["tl"], blank, reduction, zero_infinity)

    return runtime.interop.call_jax(loss, log_probs, targets, tensors)


REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch's enum of reductions (at::Reduction)


def all_true(value: jax.Array) -> jax.Array:
    """aten::_is_all_true, which only torch's own checks call to raise on a value: true, and
    concrete, so that the Python branch on it can be taken inside a trace (an array made
    inside a trace is traced unless made at compile time)."""
    with jax.ensure_compile_time_eval():
        return jnp.asarray(True)


MODES = {"sum": 0, "mean": 1, "max": 2}


def embedding_bag(
    input: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """F.embedding_bag: max_norm (which renormalises the table in place) and
    scale_grad_by_freq are refused in one line."""
    if max_norm is not None or scale_grad_by_freq:
        what = "max_norm" if max_norm is not None else "scale_grad_by_freq"
        raise NotImplementedError(f"F.embedding_bag's {what} on the jax backend")

    def bags(ids, table, starts, scales):
        return jax_embedding_bag(ids, table, starts, scales, mode, include_last_offset, padding_idx)

    return runtime.interop.call_jax(bags, input, weight, offsets, per_sample_weights)


def jax_embedding_bag(
    ids: jax.Array,
    table: jax.Array,
    offsets: jax.Array | None,
    scales: jax.Array | None,
    mode: str,
    include_last_offset: bool,
    padding_idx: int | None,
) -> jax.Array:
    """The bags of `ids` (1-D with `offsets`, or [B, L]: a bag a row) of `table`'s rows."""
    if ids.ndim == 2:
        count, length = ids.shape
        segment = jnp.repeat(jnp.arange(count), length)
        ids = ids.reshape(-1)
    elif offsets is None:
        raise ValueError("F.embedding_bag of 1-D input takes offsets")  # as torch's
    else:
        count = offsets.shape[0] - (1 if include_last_offset else 0)
        segment = jnp.searchsorted(offsets[:count], jnp.arange(ids.shape[0]), side="right") - 1
    keep = jnp.ones(ids.shape, table.dtype)
    if padding_idx is not None:
        keep = (ids != padding_idx).astype(table.dtype)
    rows = table[ids] * keep[:, None]
    if scales is not None:
        rows = rows * scales.reshape(-1)[:, None].astype(table.dtype)
    if mode == "max":
        low = jnp.finfo(table.dtype).min
        top = jax.ops.segment_max(jnp.where(keep[:, None] > 0, rows, low), segment, count)
        return jnp.where(top == low, 0, top)  # an empty bag: zeros, as torch's
    total = jax.ops.segment_sum(rows, segment, count)
    if mode == "sum":
        return total
    sizes = jax.ops.segment_sum(keep, segment, count)
    return total / jnp.maximum(sizes, 1)[:, None]


MODEL_LOWERINGS: dict[Any, Any] = {
    torch.nn.functional.ctc_loss: ctc_loss,
    torch.ctc_loss: ctc_loss,
    torch.ops.aten._is_all_true: OfArrays(all_true),
    torch.nn.functional.embedding_bag: embedding_bag,
}
