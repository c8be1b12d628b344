"""Run configuration: small dataclasses filled by the CLI and saved in the run folder."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from data.collate import MixupConfig
from data.loaders import DataConfig
from models.factory import ModelConfig

BACKENDS = ("eager", "compile", "xla", "jax")
AMP_LEVELS = ("O0", "O1", "O2", "O3")
NAN_POLICIES = ("skip", "stop")
SHARD_MODES = ("none", "full", "grad_op")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ConfigError(ValueError):
    """Bad user input: reported as one line with exit code 2."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    min_lr: float = 1e-6
    clip_grad: float = 1.0  # max gradient norm; 0 turns clipping off
    grad_accum: int = 1


@dataclass
class RunConfig:
    backend: str = "eager"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch_size: int = 32  # per device and micro-step
    steps: int = 0  # optimizer steps; 0 means use epochs
    epochs: int = 0
    amp_level: str = "O0"
    amp_dtype: str = "bfloat16"
    kernel_opt: bool = False
    remat: bool = False  # recompute activations in the backward (less memory, more compute)
    shard: str = "none"  # split weights, gradients and optimizer state over the replicas
    tp_head: int = 1  # ranks the classifier's classes are split over (tensor parallel)
    pp: int = 1  # pipeline stages the model is cut into
    pp_schedule: str = "1f1b"  # gpipe, 1f1b or interleaved (two stages a rank)
    pp_microbatches: int = 4  # micro-batches a batch streams through the pipeline in
    seed: int = 0
    output: str = "runs"
    run_name: str = ""
    save_every: int = 0  # steps between checkpoints; 0 saves only at the end
    keep_checkpoints: int = 3
    resume: str = ""  # "", "auto" or a checkpoint path
    log_every: int = 10
    eval: bool = True
    timing_warmup_steps: int = 2  # steps left out of images_per_sec
    nproc_per_node: int = 1
    peak_tflops: float = 0.0  # accelerator bf16 peak for MFU; 0 looks the device up
    nan_policy: str = "stop"  # non-finite loss or gradients: "skip" the update, or "stop"
    # XLA compiler backends (xla, jax)
    max_recompiles: int = -1  # stop when more compiles than this follow warm-up; -1 = no limit
    compile_cache: str = ""  # persistent compilation cache; "" = OUTPUT/.compile_cache/<backend>
    loader_prefetch: int = 8  # host batches queued ahead of the device transfer
    device_prefetch: int = 4  # batches already on the device ahead of the step
    grad_reduce: str = "all_reduce"  # xla: explicit xm.all_reduce, or xm.reduce_gradients

    def compile_cache_dir(self) -> Path:
        return Path(self.compile_cache or Path(self.output) / ".compile_cache" / self.backend)

    def run_dir(self) -> Path:
        return Path(self.output) / self.model.name / self.backend / self.run_name

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def config_from_dict(raw: dict) -> RunConfig:
    """Inverse of dataclasses.asdict for RunConfig (used when reading a saved config)."""
    raw = dict(raw)
    data = dict(raw.pop("data"))
    data["mixup"] = MixupConfig(**data["mixup"])
    optim = dict(raw.pop("optim"))
    optim["betas"] = tuple(optim["betas"])
    return RunConfig(
        model=ModelConfig(**raw.pop("model")),
        data=DataConfig(**data),
        optim=OptimConfig(**optim),
        **raw,
    )
