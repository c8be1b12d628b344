"""How the torch backends (eager, compile) lay one model out over their ranks: replicas (one
process, or DDP), FSDP2 shards, a classifier split by class, a pipeline. A layout builds the part
of the model this rank keeps and says how the step's values are reduced across ranks; the model
transforms themselves are accel/parallel's functions.

A split layout builds the model on the meta device, transforms it, allocates only this rank's
part and takes its values from the whole model rank 0 initialises (accel/parallel/materialize.py).
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
from torch.nn.parallel import DistributedDataParallel

from accel.amp import AmpPolicy
from accel.backends.base import Batch, LossFn, MetricFn, ModelInit
from accel.backends.torch_core import TorchCore, accumulate, local_norm
from accel.config import BackendConfig, ConfigError
from accel.distributed import DistContext
from accel.losses import (
    classifier_loss,
    classifier_metrics,
    eval_sums,
    named_sums,
    soft_target_loss,
)
from accel.models.factory import ImageClassifier
from accel.parallel import fsdp, pipeline, tp_head
from accel.parallel.materialize import (
    allocate,
    builder,
    fill_from_rank0,
    is_meta,
    named_tensors,
    whole,
)
from accel.parallel.mesh import MeshLayout

ForwardLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def all_reduce(value: torch.Tensor, group=None, mean: bool = False) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        if mean:
            value /= dist.get_world_size(group)
    return value


class Replicas:
    """The whole model on every rank: one process, or DDP over the data-parallel ranks."""

    sharded_checkpoint = False
    masters_separate = True  # O2: fp32 masters beside a low-precision model
    autocast_cache = True  # autocast may cache its weight casts within a forward

    def __init__(self, cfg: BackendConfig, ctx: DistContext, device: torch.device, amp: AmpPolicy):
        self.cfg, self.ctx, self.device, self.amp = cfg, ctx, device, amp
        self.data_parallel = (ctx.rank, ctx.world_size)
        self.dp_group = None  # the ranks that split the data (None: all)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.amp.param_dtype

    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        """The modules this rank trains, on the device with their starting values (built by
        `init` where `model` is on the meta device); with DDP, every replica starts from rank
        0's weights (DDP broadcasts them as it wraps)."""
        model = whole(model, init)
        remat(model, self.cfg.step.remat)
        self.module = model.to(self.device, dtype=self.param_dtype)
        self.forward = self.wrap(self.module)
        return [self.module]

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.data_parallel[1] < 2:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, process_group=self.dp_group)

    def sync(self, last: bool):
        """No DDP all-reduce on the micro-steps before the last of an accumulation."""
        if self.data_parallel[1] > 1 and not last:
            return cast(DistributedDataParallel, self.forward).no_sync()  # wrap() made it DDP
        return contextlib.nullcontext()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return soft_target_loss(logits, targets)

    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """The loss this layout trains: the user's, or for the command line's classifier loss
        the layout's own way of computing it (a split classifier's parallel cross-entropy)."""
        if loss_fn is not classifier_loss:
            return loss_fn

        def layout_loss(model: Callable, batch: tuple) -> torch.Tensor:
            images, targets, *extra = batch
            return self.loss(model(images, *extra), targets)

        return layout_loss

    def forward_backward(
        self, micro_batches: list[Batch], forward_loss: ForwardLoss, core: TorchCore
    ) -> torch.Tensor:
        """Accumulate the gradients of the micro-batches; returns this rank's mean loss."""

        @contextlib.contextmanager
        def scope(last: bool):
            with self.sync(last), core.autocast():
                yield

        return accumulate(micro_batches, forward_loss, core, scope)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return all_reduce(loss, mean=True)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return local_norm([p.grad for p in params if p.grad is not None])

    def evaluation(self, metric_fn: MetricFn) -> tuple[Callable, MetricFn]:
        """The model as evaluation calls it, and the metric to sum over it: the user's own, or
        the command line's classifier_metrics, which a split layout computes its own way."""
        return self.module, metric_fn

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        return all_reduce(sums, group=self.dp_group)

    def inference(self) -> nn.Module:
        """The module an eval-mode forward runs (engine.model)."""
        return self.module

    def attached(self, core: TorchCore) -> None:
        """Called once the optimizer exists."""

    def checkpoint_view(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def classifier(self) -> list[nn.Parameter]:
        """The classifier's parameters, whose share of the state is reported apart (a model of
        the user's own has none named)."""
        if isinstance(self.module, ImageClassifier):
            return self.module.classifier_parameters()
        return []


class SplitLayout(Replicas):
    """A layout whose rank keeps part of the model: split on the meta device, only this rank's
    part allocated, its values broadcast from rank 0's whole model."""

    sharded_checkpoint = True

    def materialize(
        self, model: nn.Module, init: ModelInit | None, split: Callable[[nn.Module], list]
    ) -> list:
        """`split` transforms the model on the meta device into the modules this rank keeps; a
        model given whole is split as its meta twin, filled from rank 0's copy of it."""
        if is_meta(model):
            build = builder(init)
        else:
            given = model
            build = lambda: given  # noqa: E731
            model = copy.deepcopy(model).to("meta")
        model = model.to(self.param_dtype)
        reference = copy.deepcopy(model)  # the whole model's names and shapes
        modules = split(model)
        allocate(modules, self.device)
        parts = {n: t for m in modules for n, t in named_tensors(m)}
        parts = self.checkpoint_view({"model": parts, "optim": {}})["model"]
        fill_from_rank0(parts, reference, build, self.device)
        return modules


class Shards(SplitLayout):
    """FSDP2: weights, gradients and AdamW state split over all ranks, one unit per block."""

    masters_separate = False  # the fp32 shards are the masters; FSDP gathers them in bf16

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float32 if self.amp.master_weights else self.amp.param_dtype

    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        """Split by FSDP2, each rank keeping its shards: a model on the meta device is split
        there and filled from rank 0's build; a whole one takes rank 0's values on every rank,
        as DDP would broadcast them."""
        remat(model, self.cfg.step.remat)
        shard, device_type = self.cfg.mesh.shard, self.device.type
        if is_meta(model):

            def split(meta: nn.Module) -> list[nn.Module]:
                fsdp.apply_fsdp(meta, shard, self.amp, device_type)
                return [meta]

            (self.module,) = self.materialize(model, init, split)
        else:
            model = model.to(self.device, dtype=self.param_dtype)
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor, src=0)
            fsdp.apply_fsdp(model, shard, self.amp, device_type)
            self.module = model
        self.forward = self.module
        return [self.module]

    def sync(self, last: bool):
        """No reduce-scatter before the last micro-step (read in the backward: set, not scoped)."""
        cast(FSDPModule, self.module).set_requires_gradient_sync(last)  # fully_shard made it one
        return contextlib.nullcontext()

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return fsdp.full_value(super().grad_norm(params))  # reduced over the shards


class SplitHead(SplitLayout):
    """The classifier's classes split over the ranks of a tp group (dp x tp mesh)."""

    def __init__(self, cfg: BackendConfig, ctx: DistContext, device: torch.device, amp: AmpPolicy):
        super().__init__(cfg, ctx, device, amp)
        self.mesh = MeshLayout.build("tp", cfg.mesh.tp_head, device.type)
        self.data_parallel = (self.mesh.dp_rank, self.mesh.dp)
        self.dp_group = self.mesh.dp_group  # a tp group trains on the same batch

    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        classifier_only(model, "the split classifier (tp_head)")
        remat(model, self.cfg.step.remat)

        def split(meta: nn.Module) -> list[nn.Module]:
            self.head = tp_head.apply_tp_head(cast(ImageClassifier, meta).model, self.mesh)
            mine = {id(p) for p in self.head.parameters()}
            self.head_names = {n for n, p in meta.named_parameters() if id(p) in mine}
            return [meta]

        (self.module,) = self.materialize(model, init, split)
        self.forward = self.wrap(self.module)
        return [self.module]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return tp_head.soft_target_loss(logits, targets, self.head)

    def inference(self) -> nn.Module:
        raise ConfigError("a split classifier's logits are split over ranks: use evaluate")

    def attached(self, core: TorchCore) -> None:
        self.head_ids = {id(core.updated(p)) for p in self.head.parameters()}

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return tp_head.grad_norm(params, self.head_ids, self.mesh.group)

    def evaluation(self, metric_fn: MetricFn) -> tuple[Callable, MetricFn]:
        only_classifier_metrics(metric_fn, "a split classifier")

        def metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
            images, labels, mask = batch  # the top-k from each rank's classes, no full logits
            return named_sums(tp_head.eval_sums(model(images), labels, mask, self.head))

        return self.module, metrics

    def checkpoint_view(self, state: dict[str, Any]) -> dict[str, Any]:
        """The head's rows (and their AdamW moments) as DTensors of the whole classifier."""
        names = self.head_names

        def view(tensors: dict) -> dict:
            return {n: self.head.whole_view(t) if n in names else t for n, t in tensors.items()}

        optim = {
            n: {k: self.head.whole_view(v) if n in names and v.dim() else v for k, v in s.items()}
            for n, s in state["optim"].items()
        }
        views = {"model": view(state["model"]), "optim": optim}
        if "ema" in state:
            views["ema"] = view(state["ema"])
        return {**state, **views}

    def classifier(self) -> list[nn.Parameter]:
        return list(self.head.parameters())


class Pipeline(SplitLayout):
    """A ViT cut into --pp stages (dp x pp mesh), run by a torch.distributed.pipelining schedule;
    each stage's gradients are averaged over its dp group by an explicit all-reduce."""

    autocast_cache = False  # see forward_backward

    def __init__(self, cfg: BackendConfig, ctx: DistContext, device: torch.device, amp: AmpPolicy):
        super().__init__(cfg, ctx, device, amp)
        self.mesh = MeshLayout.build("pp", cfg.mesh.pp, device.type)
        self.data_parallel = (self.mesh.dp_rank, self.mesh.dp)
        self.dp_group = self.mesh.dp_group

    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        classifier_only(model, "the pipeline (pp)")
        mesh = self.cfg.mesh

        def split(meta: nn.Module) -> list[pipeline.ViTStage]:
            self.plan = pipeline.cut_vit(cast(ImageClassifier, meta), self.mesh, mesh.pp_schedule)
            return self.plan.stages

        stages = self.materialize(model, init, split)
        scale = mesh.pp_microbatches * self.cfg.step.accum

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # Summed over micro-batches and micro-steps, these make the batch's mean loss (the
            # schedule's own scaling would also rescale earlier micro-steps' gradients).
            return soft_target_loss(logits, targets) / scale

        self.schedule = pipeline.schedule_stages(
            self.plan, self.mesh, self.device, mesh.pp_schedule, mesh.pp_microbatches, loss_fn
        )
        self.module = nn.ModuleList(stages)
        return stages

    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        if loss_fn is not classifier_loss:
            raise ConfigError("a pipeline trains the classifier's soft-target loss only")
        return loss_fn

    def forward_backward(
        self, micro_batches: list[Batch], forward_loss: ForwardLoss, core: TorchCore
    ) -> torch.Tensor:
        """The schedule runs forward and backward; only the last stage sees the loss. Autocast
        without its weight-cast cache: the schedule's first step runs each stage under no_grad
        to infer shapes, and weight copies cached then would serve the training forwards."""
        total = torch.zeros((), device=self.device)
        first, last = 0 in self.plan.ids, self.plan.count - 1 in self.plan.ids
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
        self.reduce_gradients(core)
        return total[None]  # no extras: the pipeline's loss is the classifier's

    def reduce_gradients(self, core: TorchCore) -> None:
        """Average each stage's gradients over its dp group (the replicas of that stage)."""
        if self.mesh.dp < 2:
            return
        grads = [p.grad for p in core.params if p.grad is not None]
        for work in [dist.all_reduce(g, group=self.mesh.dp_group, async_op=True) for g in grads]:
            work.wait()
        torch._foreach_div_(grads, self.mesh.dp)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        all_reduce(loss, group=self.mesh.group)  # only the last stage holds the loss
        return all_reduce(loss, group=self.mesh.dp_group, mean=True)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The norm over every stage's gradients (each stage holds its own parameters)."""
        square = local_norm([p.grad for p in params if p.grad is not None]) ** 2
        return all_reduce(square, group=self.mesh.group).sqrt()

    def evaluation(self, metric_fn: MetricFn) -> tuple[Callable, MetricFn]:
        only_classifier_metrics(metric_fn, "a pipeline")

        def forward(images: torch.Tensor) -> torch.Tensor | None:
            return pipeline.forward_only(self.plan, self.mesh, images, self.param_dtype)

        def metrics(model: Callable, batch: tuple) -> dict[str, torch.Tensor]:
            images, labels, mask = batch
            logits = model(images)  # on the last stage only; the others add zeros
            if logits is None:
                return named_sums(torch.zeros(4, device=self.device))
            return named_sums(eval_sums(logits, labels, mask))

        return forward, metrics

    def inference(self) -> nn.Module:
        raise ConfigError("a pipeline's stages are on different ranks: use evaluate")

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        all_reduce(sums, group=self.mesh.group)  # only the last stage holds the sums
        return all_reduce(sums, group=self.mesh.dp_group)

    def classifier(self) -> list[nn.Parameter]:
        return []


def only_classifier_metrics(metric_fn: MetricFn, layout: str) -> None:
    if metric_fn is not classifier_metrics:
        raise ConfigError(f"{layout} evaluates the classifier's loss, top-1 and top-5 only")


def classifier_only(model: nn.Module, layout: str) -> None:
    """The split layouts cut accel's ImageClassifier (a timm model behind its normalisation)."""
    if not isinstance(model, ImageClassifier):
        raise ConfigError(
            f"{layout} splits the command line's timm classifier; a model of your own trains "
            "replicated or sharded (shard=)"
        )


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


def make_layout(
    cfg: BackendConfig, ctx: DistContext, device: torch.device, amp: AmpPolicy, shard: str
) -> Replicas:
    mesh = cfg.mesh
    if mesh.pp > 1:
        return Pipeline(cfg, ctx, device, amp)
    if mesh.tp_head > 1:
        return SplitHead(cfg, ctx, device, amp)
    if shard != "none":
        return Shards(cfg, ctx, device, amp)
    return Replicas(cfg, ctx, device, amp)
