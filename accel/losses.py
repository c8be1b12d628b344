"""The training loss and the evaluation sums, written once for every backend (jax runs these same
torch functions through torchax; the split classifier builds on `masked_sums`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from timm.loss import SoftTargetCrossEntropy
from torch import nn


def soft_target_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy against soft (mixed, smoothed) targets, in fp32."""
    return SoftTargetCrossEntropy()(logits.float(), targets)


Tensors = tuple[torch.Tensor, ...]
SoftTargetParts = tuple[torch.Tensor, torch.Tensor, Tensors]  # (inputs, targets, extras)


@runtime_checkable
class SoftTargetBatches(Protocol):
    """What a layout that cannot run the model whole needs of a loss, which it computes its own
    way (from a split classifier's logit shards, `tp_head=2`; on a pipeline's last stage,
    `pp=2`): that the loss is the mean soft-target cross-entropy (`soft_target_loss`) of
    `model(inputs, *extras)`'s logits against `targets`, (batch, classes) probabilities, and
    where its batch holds those: `soft_target_parts(batch)` -> (inputs, targets, extras).
    SoftTargetLoss gives it; so may a loss of your own over batches of another order."""

    def soft_target_parts(self, batch: Tensors) -> SoftTargetParts:
        """(inputs, targets, extras) of one batch."""
        ...


@runtime_checkable
class ClassificationBatches(Protocol):
    """What a layout that cannot run the model whole needs of a metric: that it sums
    `named_sums(eval_sums(...))` (the masked loss, top-1 and top-5 sums and the count) of
    `model(inputs)`'s logits, and where its batch holds those: `classification_parts(batch)` ->
    (inputs, labels, mask). ClassificationSums gives it."""

    def classification_parts(self, batch: Tensors) -> tuple[torch.Tensor, ...]:
        """(inputs, labels, mask) of one batch, the padding's rows False in the mask."""
        ...


class SoftTargetLoss:
    """A loss function (model, batch) -> loss that declares what it computes
    (SoftTargetBatches): the mean soft-target cross-entropy (`soft_target_loss`) of
    `model(inputs, *extras)`'s logits against `targets`, over batches (inputs, targets,
    *extras), the targets (batch, classes) probabilities.

    >>> loss = SoftTargetLoss()
    >>> logits, targets = torch.zeros(2, 4), torch.full((2, 4), 0.25)
    >>> round(float(loss(lambda x: x, (logits, targets))), 4)  # log(4)
    1.3863
    """

    def soft_target_parts(self, batch: Tensors) -> SoftTargetParts:
        inputs, targets, *extras = batch
        return inputs, targets, tuple(extras)

    def __call__(self, model: Callable, batch: Tensors) -> torch.Tensor:
        inputs, targets, extras = self.soft_target_parts(batch)
        return soft_target_loss(model(inputs, *extras), targets)


def masked_sums(
    loss: torch.Tensor, correct: torch.Tensor, mask: torch.Tensor, correct5: torch.Tensor
) -> torch.Tensor:
    """[loss sum, top-1 correct, count, top-5 correct] over the rows `mask` keeps (the padding of
    a fixed-shape evaluation batch is masked out)."""
    mask = mask.float()
    parts = (loss.float() * mask, correct.float() * mask, mask, correct5.float() * mask)
    return torch.stack([p.sum() for p in parts])


def eval_sums(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_sums of one evaluation batch from its logits."""
    logits = logits.float()
    loss = nn.functional.cross_entropy(logits, labels, reduction="none")
    top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
    hits = top == labels[:, None]
    return masked_sums(loss, hits[:, 0], mask, hits.any(-1))


# The names of masked_sums' four values, as evaluation sums them (over batches and ranks).
EVAL_SUMS = ("loss_sum", "correct", "count", "correct5")


def named_sums(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """masked_sums by name, as a metric function returns them."""
    return dict(zip(EVAL_SUMS, sums.unbind(), strict=True))


class ClassificationSums:
    """A metric function (model, batch) -> sums that declares what it computes
    (ClassificationBatches): `named_sums` of `eval_sums` (the masked loss, top-1 and top-5 sums
    and the count) of `model(inputs)`'s logits, over batches (inputs, labels, mask), the padding
    masked out."""

    def classification_parts(self, batch: Tensors) -> tuple[torch.Tensor, ...]:
        inputs, labels, mask = batch
        return inputs, labels, mask

    def __call__(self, model: Callable, batch: Tensors) -> dict[str, torch.Tensor]:
        inputs, labels, mask = self.classification_parts(batch)
        return named_sums(eval_sums(model(inputs), labels, mask))
