"""The process mesh a run asks for: data parallel times one model-parallel dimension (--tp_head
or --pp), checked before any process starts and described in the launcher's first lines."""

from __future__ import annotations

import torch

from accel.config import ConfigError, RunConfig
from data.loaders import dataset_num_classes
from models.factory import create_model


def model_parallel(cfg: RunConfig) -> tuple[str, int]:
    """('tp', N), ('pp', N) or ('', 1)."""
    if cfg.tp_head > 1:
        return "tp", cfg.tp_head
    if cfg.pp > 1:
        return "pp", cfg.pp
    return "", 1


def check_mesh(cfg: RunConfig) -> None:
    """One line naming the numbers for a mesh or combination that cannot work."""
    procs = cfg.nproc_per_node
    if cfg.tp_head < 1 or cfg.pp < 1 or cfg.pp_microbatches < 1:
        raise ConfigError("--tp_head, --pp and --pp_microbatches must be >= 1")
    if cfg.tp_head > 1 and cfg.pp > 1:
        raise ConfigError("--tp_head and --pp cannot be combined")
    kind, size = model_parallel(cfg)
    if not kind:
        return
    flag = "--tp_head" if kind == "tp" else "--pp"
    backends = ("eager", "compile") if kind == "tp" else ("eager",)
    if cfg.backend not in backends:
        raise ConfigError(f"{flag} runs on {' or '.join(backends)}, not {cfg.backend}")
    if cfg.shard != "none":
        raise ConfigError(f"{flag} and --shard cannot be combined")
    if procs % size:
        raise ConfigError(f"--nproc_per_node {procs} is not divisible by {flag} {size}")
    if kind == "pp":
        _check_pipeline(cfg)


def _check_pipeline(cfg: RunConfig) -> None:
    stages = cfg.pp * (2 if cfg.pp_schedule == "interleaved" else 1)
    with torch.device("meta"):
        vit = create_model(cfg.model).model
    blocks = getattr(vit, "blocks", None)
    if blocks is None or not hasattr(vit, "patch_embed") or hasattr(vit, "layers"):
        raise ConfigError(f"--pp cuts ViT-style models by blocks; {cfg.model.name} is not one")
    if stages > len(blocks):
        raise ConfigError(
            f"--pp {cfg.pp} ({cfg.pp_schedule}) needs {stages} stages, "
            f"{cfg.model.name} has {len(blocks)} blocks"
        )
    if cfg.batch_size % cfg.pp_microbatches:
        raise ConfigError(
            f"--batch_size {cfg.batch_size} is not divisible by --pp_microbatches "
            f"{cfg.pp_microbatches}"
        )
    if cfg.amp_level != "O0" and cfg.amp_dtype == "float16":
        raise ConfigError("--pp trains in bfloat16 or fp32 (--amp_dtype bfloat16)")
    if cfg.remat:
        raise ConfigError("--pp does not recompute activations (--remat)")


def mesh_lines(cfg: RunConfig) -> list[str]:
    """What the launcher says about the mesh, and the padding of a split classifier."""
    kind, size = model_parallel(cfg)
    if not kind:
        return []
    procs = cfg.nproc_per_node
    lines = [f"mesh dp {procs // size} x {kind} {size} ({procs} processes)"]
    if kind == "pp":
        lines[0] += f", {cfg.pp_schedule} schedule, {cfg.pp_microbatches} micro-batches"
        return lines
    classes = dataset_num_classes(cfg.data)
    padded = -(-classes // size) * size
    if padded != classes:
        lines.append(
            f"{classes} classes over tp {size}: the classifier is padded to {padded} rows, "
            f"the {padded - classes} padded classes masked out of the softmax"
        )
    return lines
