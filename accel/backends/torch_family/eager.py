"""PyTorch eager backend: the shared torch step (core.py) over a layout of the model on the ranks
(whole.py: replicas with DDP over NCCL or gloo; split.py: any combination of FSDP2 shards,
tensor-parallel blocks and classifier, and pipeline stages). compile.py is this backend with the
forward and loss compiled."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from accel.backends.as_eager import modes_kept
from accel.backends.base import (
    BackendStats,
    BackendUnavailable,
    Batch,
    LossFn,
    MetricFn,
    ModelInit,
    RunnerBase,
    StepResult,
    Supports,
    split_batch,
)
from accel.backends.torch_family.core import TorchCore, fused_guard, live_tensors, metric_sums
from accel.backends.torch_family.layout import Layout
from accel.backends.torch_family.named_state import load_named_state, named_state
from accel.backends.torch_family.split import SplitLayout
from accel.backends.torch_family.step_random import StepRandom
from accel.backends.torch_family.whole import WholeLayout
from accel.batches import ModelCall
from accel.config import SHARD_MODES, BackendConfig
from accel.distributed import DistContext, broadcast_bytes, collective_device, env_context
from accel.optim import OptimizerSpec
from accel.parallel.mesh import ParallelDims

SUPPORTS = Supports(
    float16=True,
    gradient_hooks=("module", "tensor"),
    shard=SHARD_MODES,
    tp=True,
    tp_head=True,
    pp=True,
    exclusive=(
        ("pp", "shard", "a stage's gradients are reduced once after the schedule"),
        ("pp", "tp_head", "the last stage computes the whole classifier's loss"),
        ("tp_head", "shard", "the split classifier's rows are not sharded further"),
    ),
    remat=True,
    cuda_batches=True,
    kernel_opt="nothing more: AdamW is always the fused one",
)


def require() -> None:
    """Eager needs nothing beyond torch; on a CUDA GPU, torch's accelerator must still be CUDA."""
    accelerator = torch.accelerator.current_accelerator()
    refusal = cuda_refusal(torch.cuda.is_available(), accelerator.type if accelerator else None)
    if refusal:
        raise BackendUnavailable(refusal)


def cuda_refusal(cuda: bool, accelerator: str | None) -> str | None:
    """Why a CUDA step cannot run in this process, or None. Once a PrivateUse1 device is
    registered (torchax registers "jax" when a jax engine is built), torch takes it for the
    process's accelerator for good, and the autograd engine no longer finds CUDA's streams:
    the first CUDA backward would fail deep inside torch (pytorch/pytorch#161129). On the CPU
    nothing of that is used.

    >>> cuda_refusal(True, "jax").split(":")[0]
    "torch's accelerator in this process is 'jax', not CUDA"
    >>> cuda_refusal(False, "jax") is None and cuda_refusal(True, "cuda") is None
    True
    """
    if not cuda or accelerator in (None, "cuda"):
        return None
    return (
        f"torch's accelerator in this process is '{accelerator}', not CUDA: a jax engine "
        "(torchax) registered it, and no CUDA backward runs in a process after that "
        "(pytorch/pytorch#161129); train eager and compile in a process of their own, before "
        "any jax engine, or compare backends in a process each"
    )


def context(cfg: BackendConfig) -> DistContext:
    return env_context()


def build(cfg: BackendConfig, ctx: DistContext) -> EagerRunner:
    return EagerRunner(cfg, ctx)


class Compiler(Protocol):
    """What compile.py adds: the training forward and loss compiled, and its accounting."""

    def __call__(self, fn: Callable) -> Callable: ...

    def step_compiles(self) -> int: ...

    def stats(self) -> dict[str, Any]:
        """graphs_compiled (BackendStats' field)."""


def torch_device(ctx: DistContext) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(f"cuda:{ctx.local_rank}")
    torch.cuda.set_device(device)
    return device


def cuda_prefetch(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """Copies the next batch on a side stream while the current one computes (the pattern of
    timm's PrefetchLoader, which wraps a whole loader and normalises; here batches stay uint8
    and the model normalises them)."""
    stream = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    ready = None
    for batch in batches:
        with torch.cuda.stream(stream):
            moved = tuple(t.to(device, non_blocking=True) for t in batch)
        if ready is not None:
            yield ready
        main.wait_stream(stream)
        for t in moved:  # allocated on the side stream, used on the main one
            t.record_stream(main)
        ready = moved
    if ready is not None:
        yield ready


class EagerRunner(RunnerBase):
    """torch's own ops on this process's device, run as they come (eager) or through a
    `compiler` (compile: torch.compile), the model whole or split over the mesh (layout)."""

    local_replicas = 1  # data replicas this process feeds
    step_devices = 1  # devices this process's step runs on
    trains_in_place = True
    threaded = False
    explain_compiles = "TORCH_LOGS=recompiles prints the cause of each compile"

    def __init__(self, cfg: BackendConfig, ctx: DistContext, compiler: Compiler | None = None):
        super().__init__(cfg, ctx)
        self.compiler = compiler
        self.name = "compile" if compiler else "eager"
        self.compiles_per_shape = compiler is not None  # dynamo guards on the input shapes
        self.device = torch_device(ctx)
        dims = ParallelDims.of(cfg.mesh, ctx.world_size)
        self.shard = dims.shard
        kind = SplitLayout if dims.splits_model else WholeLayout
        self.layout: Layout = kind(cfg, dims, self.device, self.amp)
        self.data_parallel = self.layout.data_parallel
        self.sharded_checkpoint = self.layout.sharded_checkpoint
        masters = self.amp.master_weights and self.layout.masters_separate
        self.core = TorchCore(self.amp, self.device, masters, fused_guard)
        self.random = StepRandom(self.device, cfg.step.seed, replica=self.data_parallel[0])

    @property
    def pin_memory(self) -> bool:
        """Host batches in pinned memory: asynchronous copies to a CUDA device."""
        return self.device.type == "cuda"

    def adopt(
        self,
        model: nn.Module,
        optimizer: OptimizerSpec,
        loss_fn: LossFn,
        init: ModelInit | None = None,
    ) -> None:
        loss_fn = self.layout.loss_fn(loss_fn)  # checked before anything is built
        modules = self.layout.adopt(model, init)
        # Fused (CUDA and CPU): one kernel for the whole update, and it takes `found_inf`,
        # which skips a non-finite step on the device (core.fused_guard).
        build = lambda named: optimizer.build(dict(named), fused=True)  # noqa: E731
        self.core.attach(modules, build, self.layout.classifier(), bool(self.cfg.step.ema))
        self.layout.attached(self.core)

        def forward_loss(*batch: torch.Tensor) -> torch.Tensor:
            return loss_fn(self.layout.forward, batch)

        self.forward_loss = self.compiler(forward_loss) if self.compiler else forward_loss

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        if self.device.type == "cuda":
            return cuda_prefetch(batches, self.device)
        return (tuple(t.to(self.device) for t in batch) for batch in batches)

    def split(self, batch: tuple, parts: int) -> list[tuple]:
        return split_batch(batch, parts)

    def lowered_step(
        self, micro_batches: list[tuple], lr: float | list[float], platforms: Sequence[str] = ()
    ) -> Any:
        raise BackendUnavailable(f"the {self.name} backend runs torch ops: no program to lower")

    def train_step(
        self, micro_batches: list[Batch], lr: float | list[float], ema_decay: float = 0.0
    ) -> torch.Tensor:
        """Returns [mean loss over ranks, 1.0 if the update was applied else 0.0, *extras]."""
        with self.random.drawing():
            means = self.layout.forward_backward(micro_batches, self.forward_loss, self.core)
        means = self.layout.mean_loss(means)  # [loss, *extras], averaged over the replicas
        clip = self.cfg.step.clip_grad
        applied = self.core.update(lr, means[0], clip, self.layout.grad_norm, ema_decay)
        return torch.cat([means[:1], applied.float()[None], means[1:]])

    def fetch_results(self, handles: list[torch.Tensor]) -> list[StepResult]:
        rows = torch.stack(handles).float().cpu().tolist() if handles else []
        return StepResult.from_rows(rows, self.core.extra_keys)

    @torch.no_grad()
    def forward(self, call: ModelCall) -> Any:
        module = self.layout.inference()
        args, kwargs = call.rebuild([t.to(self.device) for t in call.tensors])
        with modes_kept(module):
            module.eval()
            with self.core.autocast(cache=self.layout.autocast_cache):
                return module(*args, **kwargs)

    def evaluate_sums(
        self, batches: Iterable[Batch], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        layout, core = self.layout, self.core
        forward, metric_fn = layout.evaluation(metric_fn)
        autocast = lambda: core.autocast(cache=layout.autocast_cache)  # noqa: E731
        with core.ema_weights() if ema else contextlib.nullcontext():
            keys, sums = metric_sums(
                layout.module, forward, batches, metric_fn, autocast, self.device
            )
        return dict(zip(keys, layout.sum_over_ranks(sums).cpu().tolist(), strict=True))

    def checkpoint_state(self) -> dict[str, Any]:
        return self.layout.checkpoint_view(named_state(self.core))

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        load_named_state(self.core, state, self.layout.checkpoint_view)

    def live_state(self) -> dict[str, Any]:
        return live_tensors(self.core, self.checkpoint_state())  # DTensors where split

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The step's stream, and the device's global generator (the user's own draws)."""
        if self.device.type != "cuda":
            return self.random.state_dict()
        return {**self.random.state_dict(), "cuda": torch.cuda.get_rng_state(self.device)}

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.random.load_state_dict(state)
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def any_rank(self, flag: bool) -> bool:
        if not dist.is_initialized():
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_bytes(self, data: bytes) -> bytes:
        return broadcast_bytes(data)

    def gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not dist.is_initialized():
            return [tensor.cpu()]
        device = collective_device()
        parts = [torch.empty_like(tensor, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.to(device))
        return [p.cpu() for p in parts]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_compiles(self) -> int:
        return self.compiler.step_compiles() if self.compiler else 0

    def stats(self) -> BackendStats:
        cuda = self.device.type == "cuda"
        return BackendStats(
            **(self.compiler.stats() if self.compiler else {}),
            shard=self.shard,
            state_bytes=self.core.measured,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None,
            details={"tp": self.layout.dims.tp, "tp_head": self.cfg.mesh.tp_head},
        )
