"""The library's own small configs: what a backend needs to run the optimizer step, typed, and
nothing of the command line (its options live in accel/cli/config.py and are turned into these).

    from accel.config import BackendConfig, StepConfig

    cfg = BackendConfig("eager", step=StepConfig(amp="O1", clip_grad=1.0))
    assert cfg.step.accum == 1 and cfg.mesh.tp == 1
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

BackendName = Literal["eager", "compile", "xla", "jax"]
AmpLevel = Literal["O0", "O1", "O2", "O3"]
AmpDtype = Literal["bfloat16", "float16"]
ShardMode = Literal["none", "full", "grad_op"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]
GradReduce = Literal["all_reduce", "optimizer_step"]
AttentionChoice = Literal["auto", "cudnn", "pallas", "xla"]
RematChoice = Literal["none", "dots", "full"]

BACKENDS: tuple[str, ...] = get_args(BackendName)
AMP_LEVELS: tuple[str, ...] = get_args(AmpLevel)
SHARD_MODES: tuple[str, ...] = get_args(ShardMode)
PP_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
ATTENTION_CHOICES: tuple[str, ...] = get_args(AttentionChoice)
REMAT_CHOICES: tuple[str, ...] = get_args(RematChoice)

EmaDecayFn = Callable[[int], float]  # the EMA decay by the optimizer steps done, this one included


class AccelError(ValueError):
    """Every refusal of bad input, in one line, before any weight changes (`accel.AccelError`;
    the command line's exit code 2)."""


@dataclass(frozen=True)
class StepConfig:
    """What one optimizer step needs.

    amp: O0 fp32; O1 autocast; O2 low-precision weights with fp32 masters; O3 all low precision.
    clip_grad: the gradients' global norm limit (0: none). accum: micro-batches a step's batch
    is split into. ema: the decay of an exponential moving average of the weights kept beside
    them (0: none; timm's default is 0.9998), or a function of the optimizer steps done, this
    one included, giving it. seed: the random
    draws inside a step, a stream per data replica (accel.prepare). remat: recompute each
    block's activations in the backward ("none"; "dots": keep its matmuls' outputs, recompute
    the rest; "full": recompute all of it; accel/parallel/remat.py). kernel_opt: the backend's
    extra fused paths (accel.backends.support_matrix() lists them). attention: the jax
    backend's attention kernels: "xla" (XLA's own ops), "cudnn" (cuDNN flash attention wherever
    it takes the shape) or "auto" (by shape, accel/backends/jax/attention.py); on a CPU all
    run on XLA, and the other backends run torch's own attention whatever it says.
    """

    amp: AmpLevel = "O0"
    amp_dtype: AmpDtype = "bfloat16"
    clip_grad: float = 0.0
    accum: int = 1
    ema: float | EmaDecayFn = 0.0
    seed: int = 0
    remat: RematChoice = "none"
    kernel_opt: bool = False
    attention: AttentionChoice = "auto"


@dataclass(frozen=True)
class MeshConfig:
    """How replicas and the model's parts are laid out.

    devices: devices one process drives (xla's SPMD mesh, jax's local devices; 0: ACCEL_DEVICES,
    else 1, settled by accel.settings.settle); under torchrun each process is one replica.
    shard: none, full (weights, gradients and optimizer state split over the data replicas) or
    grad_op (gradients and optimizer state only). tp: ranks
    each transformer block's linear layers are split over (Megatron's columns and rows); tp_plan:
    which layers, {module name pattern: style} (accel.parallel.tensor_parallel; default: found
    by module type in timm's and torchvision's ViT and Swin). tp_head: ranks the classifier's
    classes are split over (the tensor-parallel ranks). pp: pipeline stages.
    """

    devices: int = 0
    shard: ShardMode = "none"
    tp: int = 1
    tp_plan: Mapping[str, str] | None = None
    tp_head: int = 1
    pp: int = 1
    pp_schedule: PipelineSchedule = "1f1b"
    pp_microbatches: int = 4
    rdzv_timeout: int = 300  # seconds jax's processes wait for each other


def shared_compile_cache(backend: str) -> Path | None:
    """ACCEL_COMPILE_CACHE/BACKEND, where that variable names one folder for many runs' compiled
    programs (a test suite, a sweep); None where it is unset."""
    shared = os.environ.get("ACCEL_COMPILE_CACHE", "").strip()
    return Path(shared) / backend if shared else None


@dataclass(frozen=True)
class CompilerConfig:
    """The compilers' knobs: where compiled programs persist, how many recompiles after warm-up
    are tolerated (-1: any), how far batches are prefetched, and how xla reduces gradients
    across processes."""

    cache_dir: str = ""  # "": accel.settings.cache_dir(backend)
    max_recompiles: int = -1
    loader_prefetch: int = 8
    device_prefetch: int = 4
    grad_reduce: GradReduce = "all_reduce"


@dataclass(frozen=True)
class BackendConfig:
    """Everything a backend is built from: its name and the three component configs."""

    backend: BackendName | None = None  # None: not settled yet (accel.settle chooses it)
    step: StepConfig = field(default_factory=StepConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    compiler: CompilerConfig = field(default_factory=CompilerConfig)
