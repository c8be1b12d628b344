"""The model split over the mesh of `ParallelDims` (data groups x tensor-parallel ranks x
pipeline stages), its parallelisms applied to the model in order, as accel/parallel's functions:
the pipeline's cut (`cut_vit`, stages.py), the blocks' tensor split (`apply_tp`), the
classifier's split (`apply_tp_head`, head.py), FSDP2 over the data axis (`apply_fsdp`). The
step's reductions follow from the mesh's axes (reductions.py): the gradients over the data axis
(FSDP's reduce-scatter for shards, an all-reduce otherwise), the loss over the data axis (and
from the pipeline's last stage), the gradient norm over what each rank holds alone.

The layout builds the model on the meta device, transforms it, allocates only this rank's part
and takes its values from the whole model rank 0 initialises (accel/parallel/materialize.py).

What the pipeline and the split classifier need of the model and the loss comes as hooks any
model can give: `pipeline_parts()` (accel.parallel.pipeline.Pipelined), `get_classifier()`
(accel.parallel.tp_head.HasClassifier), and a loss and a metric that give
accel.logits.FromLogits (their value from the logits, whole and split by class, which those
layouts compute their own way, and where their batches hold the model's arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from accel.amp import AmpPolicy
from accel.backends.base import Batch, LossFn, MetricFn, ModelInit
from accel.backends.torch_family import reductions
from accel.backends.torch_family.core import TorchCore
from accel.backends.torch_family.head import SplitHead
from accel.backends.torch_family.layout import ForwardLoss, Layout, remat
from accel.backends.torch_family.stages import Stages
from accel.config import AccelError, BackendConfig
from accel.logits import FromLogits
from accel.parallel import fsdp, tensor_parallel
from accel.parallel.materialize import materialize
from accel.parallel.mesh import Axis, MeshAxis, ParallelDims


class SplitLayout(Layout):
    """The model split by any combination of FSDP2 shards, tensor-parallel blocks and
    classifier, and pipeline stages."""

    def __init__(
        self, cfg: BackendConfig, dims: ParallelDims, device: torch.device, amp: AmpPolicy
    ):
        super().__init__(cfg, dims, device, amp)
        mesh = dims.build(device.type)
        axes = (dims.data_axis, Axis.TENSOR, Axis.PIPELINE)
        self.dp, self.tp, self.pp = (MeshAxis.of(mesh, n) for n in axes)
        self.dp_group = self.dp.group
        self.data_parallel = (self.dp.rank, self.dp.size)
        self.head: SplitHead | None = None
        self.stages: Stages | None = None
        self.loss: FromLogits | None = None  # by loss_fn, before adopt

    def what(self) -> str:
        """The part of this layout that computes the loss its own way, for refusals."""
        return "a pipeline (pp=)" if self.dims.pp > 1 else "a split classifier (tp_head=)"

    # --- building -----------------------------------------------------------------------------
    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        """A split model is cut on the meta device and each rank's part is filled from rank 0's
        build (what it cuts, prepare has checked the model gives: accel/checks.py)."""
        remat(model, self.cfg.step.remat)  # the meta model, which becomes this rank's part
        modules = materialize(
            model, init, self.split, self.model_view, self.param_dtype, self.device
        )
        if self.stages is not None:
            self.stages.allocated(cast(FromLogits, self.loss))
        self.module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        self.forward = self.module
        return modules

    def split(self, meta: nn.Module) -> list[nn.Module]:
        """The parallelisms, in order, over the model on the meta device: the pipeline's cut,
        the blocks' tensor split, the classifier's split, FSDP over the data axis; returns the
        modules this rank keeps."""
        dims, mesh = self.dims, self.cfg.mesh
        parts: list[nn.Module] = [meta]
        if dims.pp > 1:
            self.stages = Stages(meta, self.pp, self.cfg, self.device)
            parts = self.stages.modules
        if dims.tp > 1 and mesh.tp > 1:
            for part in parts:
                plan = tensor_parallel.resolve_plan(part, mesh.tp_plan, dims.tp)
                tensor_parallel.apply_tp(part, plan, self.tp.mesh)
        if dims.tp_head:
            self.head = SplitHead(meta, self.tp)
        if dims.shard != "none":
            for part in parts:
                fsdp.apply_fsdp(part, dims.shard, self.amp, self.dp.mesh)
        return parts

    # --- the step -----------------------------------------------------------------------------
    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """The user's loss, or for a split classifier the same loss computed from its logit
        columns; a pipeline's schedule computes it on the last stage. Both read it through
        accel.logits.FromLogits."""
        if not (self.dims.pp > 1 or self.dims.tp_head):
            return loss_fn
        loss = self.loss = self.from_logits(loss_fn, "trains a loss")
        if not self.dims.tp_head:
            return loss_fn

        def split_loss(model: Callable, batch: tuple) -> torch.Tensor:
            return cast(SplitHead, self.head).computed(loss)(model, batch)  # built by adopt

        return split_loss

    def from_logits(self, fn: Callable, what: str) -> FromLogits:
        """`fn`, which this layout computes its own way, checked to say how (FromLogits)."""
        if not isinstance(fn, FromLogits):
            raise AccelError(
                f"{self.what()} {what} that gives accel.logits.FromLogits (its value from the "
                "logits, whole and split by class, and logits_parts(batch))"
            )
        return fn

    def sync(self, last: bool) -> Any:
        """FSDP skips the gradient reduce before the last micro-step of an accumulation (it
        reads its switch in the backward: set, not scoped)."""
        if self.dims.shard != "none":
            cast(FSDPModule, self.module).set_requires_gradient_sync(last)
        return super().sync(last)

    def forward_backward(
        self, micro_batches: list[Batch], forward_loss: ForwardLoss, core: TorchCore
    ) -> torch.Tensor:
        """Accumulate the gradients of the micro-batches and reduce them over the data axis;
        returns this rank's mean loss (and extras)."""
        if self.stages is not None:
            means = self.stages.backward(micro_batches, core)
        else:
            means = super().forward_backward(micro_batches, forward_loss, core)
        if self.explicit_reduce:
            reductions.average_gradients(core.params, self.dp_group, self.dims.dp)
        return means

    @property
    def explicit_reduce(self) -> bool:
        """Shards reduce in FSDP's hooks; a model split by tensors or stages (and not sharded)
        has its gradients averaged over the data axis after the backward."""
        return self.dims.dp > 1 and self.dims.shard == "none"

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.stages is not None:
            self.stages.gather(loss)  # only the last stage holds the loss
        return super().mean_loss(loss)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """DTensors' norms over their meshes, the classifier's rows summed over their ranks,
        the stages' summed over the pipeline."""
        rows = {id(p) for p in self.head.params} if self.head is not None else set()
        stages = self.pp.group if self.stages is not None else None
        return reductions.grad_norm(params, self.device, rows, self.tp.group, stages)

    # --- evaluation and state -----------------------------------------------------------------
    def evaluation(self, metric_fn: MetricFn) -> tuple[Callable, MetricFn]:
        """The user's metric over the module, or for a pipeline or a split classifier their own
        way of computing it (accel.logits.FromLogits)."""
        if self.head is None and self.stages is None:
            return self.module, metric_fn
        metric = self.from_logits(metric_fn, "evaluates a metric")
        if self.head is not None:
            return self.module, self.head.computed(metric)
        return cast(Stages, self.stages).evaluation(self.param_dtype, metric)

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        if self.stages is not None:
            self.stages.gather(sums)  # only the last stage holds the sums
        return super().sum_over_ranks(sums)

    def inference(self) -> nn.Module:
        if self.stages is not None:
            raise AccelError("a pipeline's stages are on different ranks: use evaluate")
        if self.head is not None:
            raise AccelError("a split classifier's logits are split over ranks: use evaluate")
        return self.module

    def attached(self, core: TorchCore) -> None:
        if self.head is not None:
            self.head.attached(core)

    def model_view(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors by the whole model's names and regions."""
        return self.checkpoint_view({"model": tensors, "optim": {}})["model"]

    def checkpoint_view(self, state: dict[str, Any]) -> dict[str, Any]:
        """The split classifier's rows as DTensors of the whole classifier; every other split
        tensor is a DTensor already, or a stage's whole one."""
        return state if self.head is None else self.head.checkpoint_view(state)

    def classifier(self) -> list[nn.Parameter]:
        """The split classifier's rows, the model's get_classifier()'s otherwise (a pipeline's
        stages report none)."""
        if self.head is not None:
            return self.head.parameters()
        return super().classifier()
