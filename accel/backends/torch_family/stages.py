"""The pipeline's part of a split layout (`pp=2`): this rank's stages cut from a model that gives
its parts (accel.parallel.pipeline: `Pipelined`, `cut_vit`), the schedule that trains them on
the caller's loss of the logits (accel.logits.FromLogits), and the forward that evaluates them
stage by stage. Only the last stage sees the loss and the metric's sums."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from accel.backends.base import Batch, MetricFn
from accel.backends.torch_family.core import TorchCore
from accel.backends.torch_family.reductions import all_reduce
from accel.config import AccelError, BackendConfig
from accel.logits import FromLogits
from accel.parallel import pipeline
from accel.parallel.mesh import MeshAxis


class Stages:
    """This rank's stages of the model (on the meta device until the layout allocates them)."""

    def __init__(self, meta: nn.Module, axis: MeshAxis, cfg: BackendConfig, device: torch.device):
        self.axis, self.cfg, self.device = axis, cfg, device
        self.plan = pipeline.cut_vit(meta, axis, cfg.mesh.pp_schedule)

    @property
    def modules(self) -> list[nn.Module]:
        return list(self.plan.stages)

    def allocated(self, loss: FromLogits) -> None:
        """Called once the stages hold their values: the schedule over them, of `loss`."""
        mesh = self.cfg.mesh
        scale = mesh.pp_microbatches * self.cfg.step.accum

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # Summed over micro-batches and micro-steps, these make the batch's mean loss (the
            # schedule's own scaling would also rescale earlier micro-steps' gradients).
            return loss.from_logits(logits, targets) / scale

        self.schedule = pipeline.schedule_stages(
            self.plan, self.axis, self.device, mesh.pp_schedule, mesh.pp_microbatches, loss_fn
        )
        self.loss = loss

    def backward(self, micro_batches: list[Batch], core: TorchCore) -> torch.Tensor:
        """The schedule runs forward and backward on each micro-batch's (args, targets) that
        the loss reads from it (its `logits_parts`); only the last stage sees the loss."""
        plan = self.plan
        total = torch.zeros((), device=self.device)
        first, last = 0 in plan.ids, plan.count - 1 in plan.ids
        for micro_batch in micro_batches:
            images, targets = self.parts(micro_batch)
            losses: list[torch.Tensor] = []
            inputs = (images,) if first else ()
            with core.autocast(cache=False):
                if last:
                    self.schedule.step(*inputs, target=targets, losses=losses)
                else:
                    self.schedule.step(*inputs)
            if losses:
                total += torch.stack(losses).sum().detach()
        return total[None]  # no extras: the schedule's loss is a scalar

    def parts(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first stage's input, the loss's target) of a micro-step's batch, as the schedule
        takes them: one tensor each, in the micro-batches it splits the batch into."""
        args, targets = self.loss.logits_parts(batch)
        if len(args) != 1 or len(targets) != 1:
            raise AccelError(
                "a pipeline feeds its first stage one tensor and its loss one target; the "
                f"loss's logits_parts gives {len(args)} and {len(targets)}"
            )
        try:
            pipeline.check_micro_batch(len(args[0]), self.cfg.mesh.pp_microbatches)
        except ValueError as err:  # accel/parallel's own error
            raise AccelError(str(err)) from None
        return args[0], targets[0]

    def evaluation(self, dtype: torch.dtype, metric: FromLogits) -> tuple[Callable, MetricFn]:
        """The stages' forward and `metric`'s sums over it: the last stage's sums, its names
        with zeros on the other stages (the metric's sums of no rows)."""
        plan, axis = self.plan, self.axis

        def forward(images: torch.Tensor) -> torch.Tensor | None:
            return pipeline.forward_only(plan, axis, images, dtype)

        def metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
            args, targets = metric.logits_parts(batch)
            logits = model(args[0])  # on the last stage only; the others add zeros
            if logits is None:
                none = torch.zeros((0, 1), device=self.device)
                return metric.from_logits(none, *(t[:0] for t in targets))
            return metric.from_logits(logits, *targets)

        return forward, metrics

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """A value only the last stage holds (the loss, the sums, zeros elsewhere), on every
        stage; or one each stage holds its part of (a squared norm), summed."""
        return all_reduce(value, group=self.axis.group)
