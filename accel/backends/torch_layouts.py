"""How the torch backends (eager, compile) lay one model out over their ranks: one layout over the
mesh of `ParallelDims` (data groups x tensor-parallel ranks x pipeline stages), its parallelisms
applied to the model in order, as accel/parallel's functions: the pipeline's cut (`cut_vit`), the
blocks' tensor split (`apply_tp`), the classifier's split (`apply_tp_head`), FSDP2 over the data
axis (`apply_fsdp`). The step's reductions follow from the mesh's axes: the gradients over the
data axis (DDP for whole replicas, FSDP's reduce-scatter for shards, an all-reduce otherwise), the
loss over the data axis (and from the pipeline's last stage), the gradient norm over what each
rank holds alone (its DTensor shards, the classifier's rows, its stages).

A layout that splits the model builds it on the meta device, transforms it, allocates only this
rank's part and takes its values from the whole model rank 0 initialises
(accel/parallel/materialize.py).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from accel.amp import AmpPolicy
from accel.backends.base import Batch, LossFn, MetricFn, ModelInit
from accel.backends.torch_core import TorchCore, accumulate, local_part
from accel.config import BackendConfig, ConfigError
from accel.losses import (
    classifier_loss,
    classifier_metrics,
    eval_sums,
    named_sums,
    soft_target_loss,
)
from accel.models.factory import ImageClassifier
from accel.parallel import fsdp, pipeline, tensor_parallel, tp_head
from accel.parallel.materialize import (
    allocate,
    builder,
    is_meta,
    named_tensors,
    pieces_from_rank0,
    place,
    whole,
)
from accel.parallel.mesh import MeshAxis, ParallelDims

ForwardLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def all_reduce(value: torch.Tensor, group=None, mean: bool = False) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        if mean:
            value /= dist.get_world_size(group)
    return value


class TorchLayout:
    """The model over the ranks of `dims`: whole on each (one process, or DDP), or split by any
    combination of FSDP2 shards, tensor-parallel blocks and classifier, and pipeline stages."""

    def __init__(
        self, cfg: BackendConfig, dims: ParallelDims, device: torch.device, amp: AmpPolicy
    ):
        self.cfg, self.dims, self.device, self.amp = cfg, dims, device, amp
        self.sharded_checkpoint = dims.splits_model
        # O2: fp32 masters beside a low-precision model, unless FSDP's fp32 shards are them.
        self.masters_separate = dims.shard == "none"
        # Autocast may cache its weight casts within a forward, except in a pipeline: its
        # schedule runs each stage under no_grad first to infer shapes, and weight copies
        # cached then would serve the training forwards.
        self.autocast_cache = dims.pp == 1
        self.head: tp_head.ShardedClassifier | None = None
        self.plan: pipeline.StagePlan | None = None
        self.head_params: list[torch.Tensor] = []
        self.dp_group = None  # whole replicas: the data split over every rank (DDP's group)
        self.data_parallel = (dist.get_rank(), dims.world) if dims.world > 1 else (0, 1)
        if dims.splits_model and dims.world > 1:
            mesh = dims.build(device.type)
            self.dp, self.tp, self.pp = (MeshAxis.of(mesh, n) for n in ("dp", "tp", "pp"))
            self.dp_group = self.dp.group
            self.data_parallel = (self.dp.rank, self.dp.size)

    @property
    def param_dtype(self) -> torch.dtype:
        """O2 with FSDP: the fp32 shards are the masters; FSDP gathers them in low precision."""
        if self.dims.shard != "none" and self.amp.master_weights:
            return torch.float32
        return self.amp.param_dtype

    # --- building -----------------------------------------------------------------------------
    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        """The modules this rank trains, on the device with their starting values (built by
        `init` where `model` is on the meta device). Whole replicas start from rank 0's weights
        (DDP broadcasts them); a split model is cut on the meta device and each rank's part is
        filled from rank 0's build."""
        dims = self.dims
        if (dims.pp > 1 or dims.tp_head) and not isinstance(model, ImageClassifier):
            what = "the pipeline (pp)" if dims.pp > 1 else "the split classifier (tp_head)"
            raise ConfigError(
                f"{what} cuts the command line's timm classifier; a model of your own splits by "
                "tp (with tp_plan) or shard"
            )
        if not dims.splits_model:
            model = whole(model, init)
            remat(model, self.cfg.step.remat)
            self.module = model.to(self.device, dtype=self.param_dtype)
            self.forward = self.wrap(self.module)
            return [self.module]
        remat(model, self.cfg.step.remat)  # the meta model, which becomes this rank's part
        modules = self.materialize(model, init)
        self.module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        self.forward = self.module
        return modules

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.data_parallel[1] < 2:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def split(self, meta: nn.Module) -> list[nn.Module]:
        """The parallelisms, in order, over the model on the meta device: the pipeline's cut,
        the blocks' tensor split, the classifier's split, FSDP over the data axis; returns the
        modules this rank keeps."""
        dims, mesh = self.dims, self.cfg.mesh
        parts: list[nn.Module] = [meta]
        if dims.pp > 1:
            self.plan = pipeline.cut_vit(cast(ImageClassifier, meta), self.pp, mesh.pp_schedule)
            parts = list(self.plan.stages)
        if dims.tp > 1 and mesh.tp > 1:
            for part in parts:
                plan = tensor_parallel.resolve_plan(part, mesh.tp_plan, dims.tp)
                tensor_parallel.apply_tp(part, plan, self.tp.mesh)
        if dims.tp_head:
            self.head = tp_head.apply_tp_head(cast(ImageClassifier, meta).model, self.tp)
            mine = {id(p) for p in self.head.parameters()}
            self.head_names = {n for n, p in meta.named_parameters() if id(p) in mine}
        if dims.shard != "none":
            for part in parts:
                fsdp.apply_fsdp(part, dims.shard, self.amp, self.dp.mesh)
        return parts

    def materialize(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        """Split the model as its meta twin (a model given whole is copied to the meta device
        and filled from rank 0's copy), allocate this rank's part, fill it from rank 0."""
        if is_meta(model):
            build = builder(init)
        else:
            given = model
            build = lambda: given  # noqa: E731
            model = copy.deepcopy(model).to("meta")
        model = model.to(self.param_dtype)
        reference = copy.deepcopy(model)  # the whole model's names and shapes
        modules = self.split(model)

        def parts() -> dict[str, torch.Tensor]:  # by the whole model's names and regions
            tensors = {n: t for m in modules for n, t in named_tensors(m)}
            return self.checkpoint_view({"model": tensors, "optim": {}})["model"]

        # Rank 0's values first, then this rank's storage: rank 0 never holds a whole model
        # and its own part at once.
        pieces = pieces_from_rank0(parts(), reference, build, self.device)
        allocate(modules, self.device)
        place(parts(), pieces)
        if self.plan is not None:
            self.schedule = self.pipeline_schedule()
        return modules

    def pipeline_schedule(self):
        mesh = self.cfg.mesh
        scale = mesh.pp_microbatches * self.cfg.step.accum

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # Summed over micro-batches and micro-steps, these make the batch's mean loss (the
            # schedule's own scaling would also rescale earlier micro-steps' gradients).
            return soft_target_loss(logits, targets) / scale

        plan = cast(pipeline.StagePlan, self.plan)
        return pipeline.schedule_stages(
            plan, self.pp, self.device, mesh.pp_schedule, mesh.pp_microbatches, loss_fn
        )

    # --- the step -----------------------------------------------------------------------------
    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """The loss this layout trains: the user's, or for the command line's classifier loss
        the layout's own way of computing it (a split classifier's parallel cross-entropy)."""
        if (self.dims.pp > 1 or self.dims.tp_head) and loss_fn is not classifier_loss:
            what = "a pipeline" if self.dims.pp > 1 else "a split classifier"
            raise ConfigError(f"{what} trains the classifier's soft-target loss only")
        if loss_fn is not classifier_loss:
            return loss_fn

        def layout_loss(model: Callable, batch: tuple) -> torch.Tensor:
            images, targets, *extra = batch
            return self.loss(model(images, *extra), targets)

        return layout_loss

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return tp_head.soft_target_loss(logits, targets, self.head)
        return soft_target_loss(logits, targets)

    def sync(self, last: bool):
        """No gradient reduce on the micro-steps before the last of an accumulation (FSDP reads
        its switch in the backward: set, not scoped)."""
        if self.dims.shard != "none":
            cast(FSDPModule, self.module).set_requires_gradient_sync(last)
        elif isinstance(self.forward, DistributedDataParallel) and not last:
            return self.forward.no_sync()
        return contextlib.nullcontext()

    def forward_backward(
        self, micro_batches: list[Batch], forward_loss: ForwardLoss, core: TorchCore
    ) -> torch.Tensor:
        """Accumulate the gradients of the micro-batches and reduce them over the data axis;
        returns this rank's mean loss (and extras)."""
        if self.plan is not None:
            means = self.pipeline_backward(micro_batches, core)
        else:

            @contextlib.contextmanager
            def scope(last: bool):
                with self.sync(last), core.autocast():
                    yield

            means = accumulate(micro_batches, forward_loss, core, scope)
        if self.explicit_reduce:
            self.reduce_gradients(core)
        return means

    def pipeline_backward(self, micro_batches: list[Batch], core: TorchCore) -> torch.Tensor:
        """The schedule runs forward and backward; only the last stage sees the loss."""
        plan = cast(pipeline.StagePlan, self.plan)
        total = torch.zeros((), device=self.device)
        first, last = 0 in plan.ids, plan.count - 1 in plan.ids
        for images, targets, *_ in micro_batches:  # no erasing rectangles: refused with --pp
            losses: list[torch.Tensor] = []
            args = (images,) if first else ()
            with core.autocast(cache=False):
                if last:
                    self.schedule.step(*args, target=targets, losses=losses)
                else:
                    self.schedule.step(*args)
            if losses:
                total += torch.stack(losses).sum().detach()
        return total[None]  # no extras: the pipeline's loss is the classifier's

    @property
    def explicit_reduce(self) -> bool:
        """Whole replicas reduce in DDP's hooks, shards in FSDP's; a model split by tensors or
        stages (and not sharded) has its gradients averaged over the data axis after the
        backward."""
        return self.dims.dp > 1 and self.dims.shard == "none" and self.dims.splits_model

    def reduce_gradients(self, core: TorchCore) -> None:
        grads = [local_part(p.grad) for p in core.params if p.grad is not None]
        for work in [dist.all_reduce(g, group=self.dp_group, async_op=True) for g in grads]:
            work.wait()
        torch._foreach_div_(grads, self.dims.dp)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.plan is not None:
            all_reduce(loss, group=self.pp.group)  # only the last stage holds the loss
        return all_reduce(loss, group=self.dp_group, mean=True)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The global gradient norm: each DTensor's (a shard's, a split layer's) reduced over
        its mesh, the classifier's rows summed over their ranks, the rest counted once (the same
        on every rank that holds it), and the stages' summed over the pipeline."""
        head = {id(p) for p in self.head_params}
        shared: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        by_mesh: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                # Split along every mesh axis it is not replicated on (Shard, and FSDP's
                # strided shard of a tensor-parallel weight, which is no Shard in later torch).
                split = tuple(i for i, pl in enumerate(p.grad.placements) if not pl.is_replicate())
                by_mesh.setdefault((p.grad.device_mesh, split), []).append(p.grad)
            else:
                (rows if id(p) in head else shared).append(p.grad)
        square = torch.zeros((), device=self.device)
        for (mesh, dims), grads in by_mesh.items():
            square = square + sharded_square(grads, mesh, dims)
        if shared:
            square = square + torch.nn.utils.get_total_norm(shared) ** 2
        if rows:
            rows_square = torch.nn.utils.get_total_norm(rows) ** 2
            square = square + all_reduce(rows_square, group=self.tp.group)
        if self.plan is not None:
            square = all_reduce(square, group=self.pp.group)
        return square.sqrt()

    # --- evaluation and state -----------------------------------------------------------------
    def evaluation(self, metric_fn: MetricFn) -> tuple[Callable, MetricFn]:
        """The model as evaluation calls it, and the metric to sum over it: the user's own, or
        the command line's classifier_metrics, which a split classifier or a pipeline computes
        its own way."""
        if self.head is None and self.plan is None:
            return self.module, metric_fn
        if metric_fn is not classifier_metrics:
            what = "a pipeline" if self.plan is not None else "a split classifier"
            raise ConfigError(f"{what} evaluates the classifier's loss, top-1 and top-5 only")
        if self.head is not None:
            head = self.head

            def head_metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
                images, labels, mask = batch  # the top-k from each rank's classes
                return named_sums(tp_head.eval_sums(model(images), labels, mask, head))

            return self.module, head_metrics
        plan, dtype = cast(pipeline.StagePlan, self.plan), self.param_dtype

        def forward(images: torch.Tensor) -> torch.Tensor | None:
            return pipeline.forward_only(plan, self.pp, images, dtype)

        def metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
            images, labels, mask = batch
            logits = model(images)  # on the last stage only; the others add zeros
            if logits is None:
                return named_sums(torch.zeros(4, device=self.device))
            return named_sums(eval_sums(logits, labels, mask))

        return forward, metrics

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        if self.plan is not None:
            all_reduce(sums, group=self.pp.group)  # only the last stage holds the sums
        return all_reduce(sums, group=self.dp_group)

    def inference(self) -> nn.Module:
        """The module an eval-mode forward runs (engine.model)."""
        if self.plan is not None:
            raise ConfigError("a pipeline's stages are on different ranks: use evaluate")
        if self.head is not None:
            raise ConfigError("a split classifier's logits are split over ranks: use evaluate")
        return self.module

    def attached(self, core: TorchCore) -> None:
        """Called once the optimizer exists: the classifier's rows as the optimizer holds them."""
        if self.head is not None:
            self.head_params = [core.updated(p) for p in self.head.parameters()]

    def checkpoint_view(self, state: dict[str, Any]) -> dict[str, Any]:
        """The split classifier's rows (and their AdamW moments) as DTensors of the whole
        classifier; every other split tensor is a DTensor already, or a stage's whole one."""
        if self.head is None:
            return state
        names, head = self.head_names, self.head

        def view(tensors: dict) -> dict:
            return {n: head.whole_view(t) if n in names else t for n, t in tensors.items()}

        optim = {
            n: {k: head.whole_view(v) if n in names and v.dim() else v for k, v in s.items()}
            for n, s in state["optim"].items()
        }
        views = {"model": view(state["model"]), "optim": optim}
        if "ema" in state:
            views["ema"] = view(state["ema"])
        return {**state, **views}

    def classifier(self) -> list[nn.Parameter]:
        """The classifier's parameters, whose share of the state is reported apart (a model of
        the user's own has none named; a pipeline's stages report none)."""
        if self.head is not None:
            return list(self.head.parameters())
        if isinstance(self.module, ImageClassifier):
            return self.module.classifier_parameters()
        return []


def sharded_square(grads: list[torch.Tensor], mesh: Any, dims: tuple[int, ...]) -> torch.Tensor:
    """The squared norm of DTensor gradients split along mesh axes `dims`: the local parts'
    summed over those axes (gradients are reduced, never partial sums). Read off the local
    parts rather than through DTensor's own norm, which gathers a tensor split twice along one
    axis (FSDP over tensor-parallel rows) whole."""
    square = torch.nn.utils.get_total_norm([local_part(g) for g in grads]) ** 2
    for dim in dims:
        square = all_reduce(square, group=mesh.get_group(dim))
    return square


def remat(model: nn.Module, enabled: bool) -> None:
    """Recompute activations in the backward, through the model's own switch (timm's)."""
    if not enabled:
        return
    switch = getattr(model, "set_grad_checkpointing", None)
    if switch is None:
        raise ConfigError(
            f"remat: {type(model).__name__} has no set_grad_checkpointing (timm models have)"
        )
    switch(True)
