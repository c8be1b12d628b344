"""The xla backend's step: one graph per optimizer step (cut by torch_xla.sync) with the forward and
backward of every micro-batch under XLA autocast, the gradients reduced, clipping, the guarded
update and the EMA's; evaluation and the model's forward in graphs of their own."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from accel.amp import AmpPolicy
from accel.backends.as_eager import AsEager, modes_kept, no_fast_paths
from accel.backends.base import Batch, LossFn, MetricFn, StepResult, split_batch
from accel.backends.host_reads import RefuseHostReads, user_frame
from accel.backends.torch_family.core import TorchCore, accumulate, local_norm, metric_sums
from accel.backends.xla.batches import XlaBatches
from accel.backends.xla.compiles import XlaCompiles
from accel.backends.xla.devices import XlaDevices
from accel.backends.xla.layout import XlaLayout
from accel.batches import ModelCall
from accel.config import AccelError, BackendConfig


class XlaStep:
    """The step, evaluation and forward over the laid-out model."""

    def __init__(
        self,
        cfg: BackendConfig,
        amp: AmpPolicy,
        parts: tuple[XlaDevices, XlaLayout, XlaBatches, XlaCompiles],
        core: TorchCore,
    ):
        self.clip, self.grad_reduce = cfg.step.clip_grad, cfg.compiler.grad_reduce
        self.accum = cfg.step.accum
        self.amp, self.core = amp, core
        self.devices, self.layout, self.batches, self.compiles = parts
        # (device type, backend) -> the context the step runs in: RefuseHostReads once adopted
        self.host_reads: Callable[[str, str], contextlib.AbstractContextManager]
        self.host_reads = lambda *_: contextlib.nullcontext()

    def adopt(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.host_reads = RefuseHostReads  # a loss that reads the host: name its line

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.devices.autocast(self.amp)

    def split(self, batch: tuple, parts: int) -> list[tuple]:
        return split_batch(batch, parts)

    def train_step(
        self, micro_batches: list[Batch], lr: float | list[float], ema_decay: float = 0.0
    ) -> torch.Tensor:
        """One graph: forward and backward of every micro-batch, the explicit gradient
        all-reduce, clipping, the guarded update and the EMA's; returns [mean loss, applied,
        *extras]."""
        devices = self.devices
        # Host micro-batches, cut on the host, each split over the mesh as the loader's are.
        micro_batches = [self.batches.on_device(batch) for batch in micro_batches]
        means = accumulate(micro_batches, self.forward_loss, self.core, self.scope, self.accum)
        devices.reduce_gradients(self.core.params, self.grad_reduce)
        means = devices.all_reduce(means, mean=True)  # [loss, *extras] over the replicas
        applied = self.core.update(lr, means[0], self.clip, self.grad_norm, ema_decay)
        devices.sync()
        return torch.cat([means[:1], applied.float()[None], means[1:]])

    def forward_loss(self, *batch: torch.Tensor) -> torch.Tensor:
        try:
            return self.loss_fn(self.layout.forward_module, batch)
        except AttributeError as err:
            # torch.utils.checkpoint looks up a device module `torch.xla`, which torch_xla does
            # not register, and torch_xla's own checkpoint has no non-reentrant form.
            if "no attribute 'xla'" not in str(err):
                raise
            frame = user_frame(traceback.extract_tb(err.__traceback__))
            where = f" at {frame.filename}:{frame.lineno} ({frame.line})" if frame else ""
            raise AccelError(
                f"torch.utils.checkpoint{where} does not run on the xla backend (torch's "
                "checkpoint finds no XLA device module): train this model on eager, compile "
                "or jax, or without the checkpoint"
            ) from None

    @contextlib.contextmanager
    def scope(self, last: bool) -> Iterator[None]:
        """A micro-step's: autocast, a user's loss refused where it reads the host, and the
        functions torch_xla lowers unlike eager done as eager does them (as_eager.py)."""
        with self.autocast(), self.host_reads("xla", "xla"), AsEager():
            yield

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return local_norm([p.grad for p in params if p.grad is not None])

    def fetch_results(self, handles: list[torch.Tensor]) -> list[StepResult]:
        # Each handle is already materialised by its step's sync: a transfer, no new graph
        # (stacking them first would compile one per group size).
        rows = [handle.cpu().tolist() for handle in handles]
        return StepResult.from_rows(rows, self.core.extra_keys)

    def evaluate_sums(
        self, batches: Iterable[Batch], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        devices, layout = self.devices, self.layout
        # evaluation's own graphs (an evaluation every epoch) are not recompiles of the step
        with self.compiles.not_counted(), layout.weights(ema), no_fast_paths():
            keys, sums = metric_sums(
                layout.module, layout.forward_module, map(self.batches.on_device, batches),
                metric_fn, self.autocast, devices.device, after_batch=devices.sync,
            )  # fmt: skip
            sums = devices.all_reduce(sums)
            devices.sync()
        return dict(zip(keys, sums.cpu().tolist(), strict=True))

    @torch.no_grad()
    def forward(self, call: ModelCall) -> Any:
        module = self.layout.module
        sent = self.batches.on_device(call.tensors) if call.tensors else ()
        args, kwargs = call.rebuild(sent)
        with modes_kept(module), no_fast_paths():
            module.eval()
            with self.autocast():
                return self.layout.forward_module(*args, **kwargs)
