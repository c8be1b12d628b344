"""The pipeline's part of a split layout (`pp=2`): this rank's stages cut from a model that gives
its parts (accel.parallel.pipeline: `Pipelined`, `cut_vit`), the schedule that trains them on
the soft-target loss (accel.losses.SoftTargetBatches), and the forward that evaluates them stage
by stage. Only the last stage sees the loss and the evaluation sums."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from accel.backends.base import Batch, MetricFn
from accel.backends.torch_family.core import TorchCore
from accel.backends.torch_family.reductions import all_reduce
from accel.config import BackendConfig
from accel.losses import SoftTargetParts, eval_sums, named_sums, soft_target_loss
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

    def allocated(self) -> None:
        """Called once the stages hold their values: the schedule over them."""
        mesh = self.cfg.mesh
        scale = mesh.pp_microbatches * self.cfg.step.accum

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # Summed over micro-batches and micro-steps, these make the batch's mean loss (the
            # schedule's own scaling would also rescale earlier micro-steps' gradients).
            return soft_target_loss(logits, targets) / scale

        self.schedule = pipeline.schedule_stages(
            self.plan, self.axis, self.device, mesh.pp_schedule, mesh.pp_microbatches, loss_fn
        )

    def backward(
        self, micro_batches: list[Batch], core: TorchCore, parts: Callable[[Batch], SoftTargetParts]
    ) -> torch.Tensor:
        """The schedule runs forward and backward on the (inputs, targets) `parts` reads from
        each micro-batch; only the last stage sees the loss."""
        plan = self.plan
        total = torch.zeros((), device=self.device)
        first, last = 0 in plan.ids, plan.count - 1 in plan.ids
        for micro_batch in micro_batches:
            images, targets, _ = parts(micro_batch)  # no erasing rectangles: refused with pp=
            losses: list[torch.Tensor] = []
            args = (images,) if first else ()
            with core.autocast(cache=False):
                if last:
                    self.schedule.step(*args, target=targets, losses=losses)
                else:
                    self.schedule.step(*args)
            if losses:
                total += torch.stack(losses).sum().detach()
        return total[None]  # no extras: the pipeline's loss is the soft-target loss

    def evaluation(
        self, dtype: torch.dtype, parts: Callable[[tuple], tuple[torch.Tensor, ...]]
    ) -> tuple[Callable, MetricFn]:
        """The stages' forward and accel.losses.ClassificationSums' sums over it, of the
        (inputs, labels, mask) `parts` reads from a batch: the last stage's sums, zeros on the
        other stages."""
        plan, axis = self.plan, self.axis

        def forward(images: torch.Tensor) -> torch.Tensor | None:
            return pipeline.forward_only(plan, axis, images, dtype)

        def metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
            images, labels, mask = parts(batch)
            logits = model(images)  # on the last stage only; the others add zeros
            if logits is None:
                return named_sums(torch.zeros(4, device=self.device))
            return named_sums(eval_sums(logits, labels, mask))

        return forward, metrics

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """A value only the last stage holds (the loss, the sums, zeros elsewhere), on every
        stage; or one each stage holds its part of (a squared norm), summed."""
        return all_reduce(value, group=self.axis.group)
