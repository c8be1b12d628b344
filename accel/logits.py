"""What a layout that never holds a model's logits whole on one rank needs of a loss or a metric:
a split classifier (`tp_head=2`) holds them split by class over its ranks, a pipeline (`pp=2`)
only on its last stage. Such a layout computes the loss or the metric its own way, so the loss
or metric says how: `FromLogits`. Which loss or metric it is stays the caller's (the command
line's classifier task gives its loss and its evaluation sums this way, accel/cli/task.py);
the library gives the split logits' collectives (`ClassShards`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accel.parallel.tp_head import ShardedClassifier

Tensors = tuple[torch.Tensor, ...]


@runtime_checkable
class FromLogits(Protocol):
    """A loss function or a metric function (model, batch) -> value whose value is computed from
    the model's logits alone, and which says how, for the layouts that hold those split:

    - `logits_parts(batch)` -> (args, targets): the model's arguments and the rest of the batch;
      the value is `from_logits(model(*args), *targets)`. A pipeline's loss has one of each
      (its first stage takes one tensor, its schedule's loss one target).
    - `from_logits(logits, *targets)`: the value from whole (batch, classes) logits, as a
      pipeline's last stage computes it. A loss gives the batch's mean; a metric gives named
      sums ({name: scalar}), which are summed over batches and ranks, and for no rows (logits
      of shape (0, 1)) gives its names with zeros: a pipeline's other stages add those.
    - `from_shards(shards, *targets)`: the same value from this rank's logit columns
      (`ClassShards`: a split classifier's), through the collectives they give.

    >>> import torch.nn.functional as F
    >>> class LabelCrossEntropy:  # a loss over (inputs, class labels) batches
    ...     def logits_parts(self, batch):
    ...         return batch[:1], batch[1:]
    ...     def from_logits(self, logits, labels):
    ...         return F.cross_entropy(logits.float(), labels)
    ...     def from_shards(self, shards, labels):
    ...         return shards.cross_entropy(labels).mean()
    ...     def __call__(self, model, batch):
    ...         args, targets = self.logits_parts(batch)
    ...         return self.from_logits(model(*args), *targets)
    >>> loss = LabelCrossEntropy()
    >>> isinstance(loss, FromLogits)
    True
    >>> round(float(loss(lambda x: x, (torch.zeros(2, 4), torch.tensor([0, 3])))), 4)  # log(4)
    1.3863
    """

    def logits_parts(self, batch: Tensors) -> tuple[Tensors, Tensors]:
        """(the model's arguments, the targets) of one batch."""
        ...

    def from_logits(self, logits: torch.Tensor, *targets: torch.Tensor) -> Any:
        """The value from whole logits."""
        ...

    def from_shards(self, shards: ClassShards, *targets: torch.Tensor) -> Any:
        """The value from this rank's logit columns."""
        ...


class _ParallelCrossEntropy(torch.autograd.Function):
    """Per-sample -sum(t * log_softmax(logits)) over the classes of all shards, from each rank's
    logit and target columns. Written here rather than taken from DTensor's `loss_parallel`,
    which supports class-index targets only (mixup and label smoothing need soft ones)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()
        top = logits.max(-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - top).exp()
        total = exp.sum(-1, keepdim=True)
        dist.all_reduce(total, group=group)
        log_z = top + total.log()
        parts = torch.stack([-(targets * (logits - log_z)).sum(-1), targets.sum(-1)])
        dist.all_reduce(parts, group=group)
        loss, target_mass = parts
        ctx.save_for_backward(exp / total, targets, target_mass)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, targets, target_mass = ctx.saved_tensors
        grad_logits = (probs * target_mass[:, None] - targets) * grad[:, None]
        return grad_logits.to(ctx.dtype), None, None


class ClassShards:
    """A split classifier's logits (`tp_head=2`) as one rank holds them: `local`, its (batch,
    per) columns (the padding's columns at a logit no softmax picks), and the collectives over
    the other ranks' columns with which a loss or a metric computes its value from them
    (`FromLogits.from_shards`) without ever gathering a row of logits whole."""

    def __init__(self, local: torch.Tensor, head: ShardedClassifier):
        self.local, self.head = local, head

    @property
    def classes(self) -> int:
        """The whole classifier's class count."""
        return self.head.classes

    def columns(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full (batch, classes) tensor, zero-padded as `local`."""
        return self.head.local_targets(full)

    def cross_entropy(self, target: torch.Tensor) -> torch.Tensor:
        """Per-sample cross-entropy over all the classes, as `F.cross_entropy(logits, target,
        reduction="none")` of the whole logits, in fp32: `target` (batch,) class indices or
        (batch, classes) probabilities (mixed, smoothed), whole. Differentiable in `local`."""
        if target.dim() == 1:
            onehot = torch.zeros_like(self.local, dtype=torch.float32)
            index = target - self.head.start
            here = (index >= 0) & (index < self.head.valid)
            onehot[here, index[here]] = 1.0
        else:
            onehot = self.columns(target.float())
        return _ParallelCrossEntropy.apply(self.local, onehot, self.head.group)

    def topk(self, k: int) -> torch.Tensor:
        """(batch, min(k, classes)) the classes of the k largest logits over all the ranks, the
        largest first: each rank's best k (value, class), compared across the ranks."""
        head = self.head
        best, index = self.local.float().topk(min(k, head.per), dim=-1)
        candidates = torch.stack([best, (index + head.start).float()])
        gathered = [torch.empty_like(candidates) for _ in range(dist.get_world_size(head.group))]
        dist.all_gather(gathered, candidates, group=head.group)
        values = torch.cat([g[0] for g in gathered], dim=-1)  # [batch, tp * k]
        classes = torch.cat([g[1] for g in gathered], dim=-1)
        return classes.gather(-1, values.topk(min(k, head.classes), dim=-1).indices).long()
