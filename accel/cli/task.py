"""The command line's task, a client of the library like any script's: an image classifier's
loss (the soft-target cross-entropy of its logits, the batch's random-erasing rectangles going to
the model), its evaluation sums (the masked loss, top-1 and top-5), and their names in
summary.json. Both give accel.logits.FromLogits: their value from whole logits and from a split
classifier's logit columns, which the split classifier and the pipeline compute their own way."""

from __future__ import annotations

from collections.abc import Callable

import torch
from timm.loss import SoftTargetCrossEntropy
from torch import nn

from accel.logits import ClassShards

Tensors = tuple[torch.Tensor, ...]


class ClassifierLoss:
    """The loss function (model, batch) -> loss over batches (images, soft targets,
    *rectangles): the mean soft-target cross-entropy of `model(images, *rectangles)`'s logits
    against the (batch, classes) probabilities (mixed, smoothed), in fp32 (timm's
    SoftTargetCrossEntropy).

    >>> loss = ClassifierLoss()
    >>> logits, targets = torch.zeros(2, 4), torch.full((2, 4), 0.25)
    >>> round(float(loss(lambda x: x, (logits, targets))), 4)  # log(4)
    1.3863
    """

    def logits_parts(self, batch: Tensors) -> tuple[Tensors, Tensors]:
        images, targets, *rectangles = batch
        return (images, *rectangles), (targets,)

    def from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return SoftTargetCrossEntropy()(logits.float(), targets)

    def from_shards(self, shards: ClassShards, targets: torch.Tensor) -> torch.Tensor:
        return shards.cross_entropy(targets).mean()

    def __call__(self, model: Callable, batch: Tensors) -> torch.Tensor:
        args, targets = self.logits_parts(batch)
        return self.from_logits(model(*args), *targets)


# The names of the evaluation's sums (over batches and ranks), which summarise reads.
EVAL_SUMS = ("loss_sum", "correct", "count", "correct5")


def masked_sums(
    loss: torch.Tensor, top: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """EVAL_SUMS over the rows `mask` keeps (the padding of a fixed-shape evaluation batch is
    masked out), from each row's loss and its top classes, the best first."""
    hits = top == labels[:, None]
    mask = mask.float()
    parts = (loss.float() * mask, hits[:, 0].float() * mask, mask, hits.any(-1).float() * mask)
    return dict(zip(EVAL_SUMS, (p.sum() for p in parts), strict=True))


class ClassifierMetrics:
    """The metric function (model, batch) -> sums over batches (images, labels, mask): the
    masked cross-entropy, top-1 and top-5 hits and the count of `model(images)`'s logits, the
    padding masked out.

    >>> sums = ClassifierMetrics()(lambda x: x, (torch.eye(3), torch.tensor([0, 2, 2]),
    ...                                          torch.tensor([True, True, False])))
    >>> {name: float(value) for name, value in sums.items()}["correct"]
    1.0
    """

    def logits_parts(self, batch: Tensors) -> tuple[Tensors, Tensors]:
        images, labels, mask = batch
        return (images,), (labels, mask)

    def from_logits(
        self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        logits = logits.float()
        loss = nn.functional.cross_entropy(logits, labels, reduction="none")
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        return masked_sums(loss, top, labels, mask)

    def from_shards(
        self, shards: ClassShards, labels: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return masked_sums(shards.cross_entropy(labels), shards.topk(5), labels, mask)

    def __call__(self, model: Callable, batch: Tensors) -> dict[str, torch.Tensor]:
        args, targets = self.logits_parts(batch)
        return self.from_logits(model(*args), *targets)


# The loss and metric functions of the command line's runs, in the public API's forms.
classifier_loss = ClassifierLoss()
classifier_metrics = ClassifierMetrics()


def summarise(sums: dict[str, float]) -> dict[str, float]:
    """summary.json's eval_loss, eval_acc, eval_acc5 and eval_images from summed
    classifier_metrics.

    >>> summarise({"loss_sum": 6.0, "correct": 2.0, "count": 4.0, "correct5": 4.0})
    {'eval_loss': 1.5, 'eval_acc': 0.5, 'eval_acc5': 1.0, 'eval_images': 4}
    """
    count = max(sums["count"], 1.0)
    return {
        "eval_loss": sums["loss_sum"] / count,
        "eval_acc": sums["correct"] / count,
        "eval_acc5": sums["correct5"] / count,
        "eval_images": int(count),
    }
