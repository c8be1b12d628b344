"""The command line's task, a client of the library like any script's: an image classifier's
loss (the soft-target cross-entropy of its logits, the batch's random-erasing rectangles going to
the model), its evaluation sums, and their names in summary.json. The library gives the loss and
metric functions their general form (accel.losses), which the split classifier and the pipeline
read; the task is here."""

from __future__ import annotations

from accel.losses import ClassificationSums, SoftTargetLoss

# The loss function in the public API's form (model, batch) -> loss, over (images, soft targets,
# *rectangles).
classifier_loss = SoftTargetLoss()

# The evaluation in the public API's metric form (model, batch) -> sums: masked loss, top-1 and
# top-5 over (images, labels, mask), the padding masked out.
classifier_metrics = ClassificationSums()


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
