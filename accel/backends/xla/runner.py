"""The xla backend as the composition of its parts: the devices and what runs across them
(devices.py), the model's layout (layout.py), batches onto the device (batches.py), the optimizer
(optimizer.py), the step (step.py) and compile accounting (compiles.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.backends.base import (
    BackendStats,
    BackendUnavailable,
    Batch,
    LossFn,
    MetricFn,
    ModelInit,
    RunnerBase,
    StepResult,
    final_layer_parameters,
)
from accel.backends.torch_family.core import TorchCore, live_tensors
from accel.backends.xla.batches import XlaBatches
from accel.backends.xla.compiles import XlaCompiles
from accel.backends.xla.devices import XlaDevices
from accel.backends.xla.layout import XlaLayout
from accel.backends.xla.optimizer import XlaOptimizer
from accel.backends.xla.step import XlaStep
from accel.batches import ModelCall
from accel.config import BackendConfig
from accel.distributed import DistContext
from accel.optim import OptimizerSpec
from accel.parallel.materialize import whole


class XlaRunner(RunnerBase):
    """torch_xla's backend: the torch model traced into lazy tensors and compiled by XLA."""

    name = "xla"
    pin_memory = False  # MpDeviceLoader stages host batches itself
    trains_in_place = True  # the model's own parameters, moved to the XLA device
    compiles_per_shape = True
    explain_compiles = "PT_XLA_DEBUG_LEVEL=2 prints the cause of each compile"
    threaded = False
    sharded_checkpoint = False  # one process holds every array: one file

    def __init__(self, cfg: BackendConfig, ctx: DistContext):
        super().__init__(cfg, ctx)
        self.compiles = XlaCompiles(Path(cfg.compiler.cache_dir), not ctx.is_main)
        self.devices = XlaDevices(cfg.mesh, ctx)
        self.device = self.devices.device
        self.data_parallel = (ctx.rank, ctx.world_size)
        self.local_replicas = self.devices.replicas  # the devices the global batch splits over
        self.step_devices = self.devices.count  # the mesh's, tensor-parallel ones included
        self.optim = XlaOptimizer(cfg.step.kernel_opt, self.amp)
        guard, extra = self.optim.guard, self.optim.extra_state
        self.core = TorchCore(self.amp, self.device, self.amp.master_weights, guard, extra)
        # Adam's rate and betas as Python numbers are constants of XLA's graph where they round
        # to 0 or 1 (1 - lr * wd at OneCycleLR's last rate) or enter as one (beta1 ** step):
        # one compile per value. As device tensors they are values of it (capturable Adam); a
        # scheduled beta1 is then read on the host each step (torch's AdamW lerps by a number).
        self.core.device_values = True
        self.layout = XlaLayout(cfg.mesh, self.devices, self.core)
        self.batches = XlaBatches(cfg.compiler, cfg.step.accum, self.devices)
        parts = (self.devices, self.layout, self.batches, self.compiles)
        self.step = XlaStep(cfg, self.amp, parts, self.core)

    @property
    def module(self) -> nn.Module:
        """The model trained, on the device."""
        return self.layout.module

    def adopt(
        self,
        model: nn.Module,
        optimizer: OptimizerSpec,
        loss_fn: LossFn,
        init: ModelInit | None = None,
    ) -> None:
        self.layout.place(whole(model, init), self.amp.param_dtype)
        # Read once placed: moving a module to the XLA device replaces its parameters.
        head = final_layer_parameters(self.layout.module)
        self.devices.seed(self.cfg.step.seed)

        def build(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
            return self.optim.build(optimizer, dict(named))

        self.core.attach([self.layout.module], build, head, bool(self.cfg.step.ema))
        self.layout.place_state()
        self.step.adopt(loss_fn)

    def release(self) -> None:
        """The hooks that made the model read as a host model removed (Engine.close): it stays
        on the XLA device it trained on, its state_dict() the device's tensors."""
        for handle in self.layout.hooks:
            handle.remove()
        self.layout.hooks = []

    # --- what its parts do -----------------------------------------------------------------------
    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Any]:
        return self.batches.device_batches(batches)

    def autocast(self) -> contextlib.AbstractContextManager:
        """XLA's autocast at the config's AMP level (a no-op at O0)."""
        return self.step.autocast()

    def split(self, batch: tuple, parts: int) -> list[Any]:
        return self.step.split(batch, parts)

    def train_step(
        self, micro_batches: list[Any], lr: float | list[float], ema_decay: float = 0.0
    ) -> Any:
        return self.step.train_step(micro_batches, lr, ema_decay)

    def fetch_results(self, handles: list[Any]) -> list[StepResult]:
        return self.step.fetch_results(handles)

    def evaluate_sums(
        self, batches: Iterable[Any], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        return self.step.evaluate_sums(batches, metric_fn, ema)

    def forward(self, call: ModelCall) -> Any:
        return self.step.forward(call)

    def checkpoint_state(self) -> dict[str, Any]:
        return self.layout.checkpoint_state()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.layout.load_checkpoint_state(state)

    def rng_state(self) -> dict[str, torch.Tensor]:
        return self.devices.rng_state()

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.devices.load_rng_state(state)

    def any_rank(self, flag: bool) -> bool:
        return self.devices.any_rank(flag)

    def broadcast_bytes(self, data: bytes) -> bytes:
        return self.devices.broadcast_bytes(data)

    def gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.devices.gather_host(tensor)

    def synchronize(self) -> None:
        self.devices.synchronize()

    def step_compiles(self) -> int:
        return self.compiles.step_compiles()

    def lowered_step(
        self, micro_batches: list[tuple], lr: float | list[float], platforms: Sequence[str] = ()
    ) -> Any:
        raise BackendUnavailable("the xla backend traces its step lazily: no program to lower")

    def live_state(self) -> dict[str, Any]:
        return live_tensors(self.core, self.layout.checkpoint_state())  # sharded as trained

    def stats(self) -> BackendStats:
        return BackendStats(
            **self.compiles.stats(),
            devices=self.devices.count,
            shard=self.devices.shard,
            state_bytes=self.core.measured,
            details={
                "input_shapes": sorted(str(s[0]) for s in self.batches.input_shapes),
                "tp": self.devices.tp,
            },
        )
