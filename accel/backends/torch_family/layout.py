"""What a layout of the model over the ranks gives the torch backends (eager, compile), whole on
each rank (whole.py) or split over the mesh of `ParallelDims` (split.py): the settings the mesh
decides, and the step's parts as they are where nothing is split, which a split layout
overrides (the loss its way, the reductions over its axes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.amp import AmpPolicy
from accel.backends.base import Batch, LossFn, MetricFn, ModelInit, final_layer_parameters
from accel.backends.torch_family import reductions
from accel.backends.torch_family.core import TorchCore, accumulate
from accel.config import BackendConfig
from accel.parallel.mesh import ParallelDims
from accel.parallel.remat import checkpoint_blocks

ForwardLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Layout:
    """The model over the ranks of `dims`, as the backend's step sees it."""

    module: nn.Module  # what this rank trains (set by adopt)
    forward: nn.Module  # what the loss calls: the module, or DDP's wrapper of it

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
        self.dp_group: Any = None  # whole replicas: the data split over every rank
        self.data_parallel = (dist.get_rank(), dims.world) if dims.world > 1 else (0, 1)

    @property
    def param_dtype(self) -> torch.dtype:
        """O2 with FSDP: the fp32 shards are the masters; FSDP gathers them in low precision."""
        if self.dims.shard != "none" and self.amp.master_weights:
            return torch.float32
        return self.amp.param_dtype

    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        """The modules this rank trains, on the device with their starting values (built by
        `init` where `model` is on the meta device)."""
        raise NotImplementedError

    # --- the step -----------------------------------------------------------------------------
    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """The loss this layout trains: the user's (checked before anything is built)."""
        return loss_fn

    def sync(self, last: bool) -> Any:
        """The scope of a micro-step's forward and backward (`last`: the accumulation's last)."""
        return contextlib.nullcontext()

    def forward_backward(
        self, micro_batches: list[Batch], forward_loss: ForwardLoss, core: TorchCore
    ) -> torch.Tensor:
        """Accumulate the gradients of the micro-batches; returns this rank's mean loss (and
        extras)."""

        @contextlib.contextmanager
        def scope(last: bool):
            with self.sync(last), core.autocast():
                yield

        return accumulate(micro_batches, forward_loss, core, scope, self.cfg.step.accum)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return reductions.all_reduce(loss, group=self.dp_group, mean=True)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return reductions.grad_norm(params, self.device)

    # --- evaluation and state -----------------------------------------------------------------
    def evaluation(self, metric_fn: MetricFn) -> tuple[Callable, MetricFn]:
        """The model as evaluation calls it, and the metric to sum over it."""
        return self.module, metric_fn

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        return reductions.all_reduce(sums, group=self.dp_group)

    def inference(self) -> nn.Module:
        """The module an eval-mode forward runs (engine.model)."""
        return self.module

    def attached(self, core: TorchCore) -> None:
        """Called once the optimizer exists."""

    def checkpoint_view(self, state: dict[str, Any]) -> dict[str, Any]:
        """The named state as checkpoints hold it."""
        return state

    def classifier(self) -> list[nn.Parameter]:
        """The classifier's parameters, whose share of the state is reported apart: those of
        the layer a model gives as `get_classifier()` (none for a model without the method)."""
        return final_layer_parameters(self.module)


def remat(model: nn.Module, choice: str) -> None:
    """Recompute each block's activations in the backward (torch.utils.checkpoint)."""
    checkpoint_blocks(model, choice)
