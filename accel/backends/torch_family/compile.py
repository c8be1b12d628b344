"""torch.compile (inductor) backend: the eager backend with the training forward and the loss
compiled as one graph, as in a user's own compiled step (the soft-target cross-entropy fuses with
the classifier instead of running eagerly)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from accel.backends.base import SinceStart, Supports
from accel.backends.torch_family import eager
from accel.backends.torch_family.eager import EagerBackend
from accel.config import BackendConfig
from accel.distributed import DistContext, env_context

SUPPORTS = Supports(
    float16=True,
    gradient_hooks=("module", "tensor"),
    shard=("none", "full", "grad_op"),
    tp=True,
    tp_head=True,
    exclusive=(("tp_head", "shard", "the split classifier's rows are not sharded further"),),
    remat=True,
    cuda_batches=True,
    kernel_opt="inductor's max-autotune (without CUDA graphs)",
)


def require() -> None:
    """torch.compile ships with torch; it needs what eager needs (eager.require)."""
    eager.require()


def context(cfg: BackendConfig) -> DistContext:
    return env_context()


def build(cfg: BackendConfig, ctx: DistContext) -> EagerBackend:
    return EagerBackend(cfg, ctx, compiler=Inductor(cfg.step.kernel_opt))


def frames_compiled() -> dict[str, float]:
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"])}


class Inductor:
    """Compiles the step's forward and loss; counts the frames dynamo compiles from here on."""

    def __init__(self, kernel_opt: bool):
        self.mode = "max-autotune-no-cudagraphs" if kernel_opt else None
        self.frames = SinceStart(frames_compiled)  # dynamo counts per process

    def __call__(self, fn: Callable) -> Callable:
        return torch.compile(fn, mode=self.mode)

    def step_compiles(self) -> int:
        return int(self.frames()["frames"])

    def stats(self) -> dict[str, Any]:
        return {"graphs_compiled": self.step_compiles()}
