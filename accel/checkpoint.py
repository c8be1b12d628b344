"""Atomic checkpoints: write to a temporary file, flush and fsync, then rename; keep the last K.

An unsharded run writes one file, `step_N.pt`. A sharded run writes a folder, `step_N.dcp`,
through torch.distributed.checkpoint: each rank its own shards, rank 0 the rest of the state
(`meta.pt`); the folder takes its final name once every rank has written.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accel.config import ConfigError

PATTERN = re.compile(r"^step_(\d+)\.(pt|dcp)$")
META = "meta.pt"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def host_rng_state() -> dict[str, Any]:
    """Python, numpy and torch CPU generators (device generators belong to the backend)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_host_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _write(path: Path, state: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _prune(run_dir: Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:08d}.pt"
    tmp = folder / f".{final.name}.tmp"
    _write(tmp, state)
    os.replace(tmp, final)
    _prune(run_dir, keep)
    return final


def save_sharded(
    run_dir: Path, step: int, tensors: dict[str, Any], meta: dict[str, Any], keep: int = 3
) -> Path:
    """Called on every rank: each writes its shards of `tensors`; rank 0 writes `meta`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = checkpoint_dir(run_dir) / f"step_{step:08d}.dcp"
    tmp = final.with_name(f".{final.name}.tmp")
    main = dist.get_rank() == 0
    if main:  # what a crash left behind
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    with warnings.catch_warnings():  # raised inside torch's writer, nothing to act on here
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp))  # fsyncs; ends in a barrier
    if main:
        _write(tmp / META, meta)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(run_dir, keep)
    dist.barrier()
    return final


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir()


def writes_shards(backend: Any) -> bool:
    """FSDP runs save through torch.distributed.checkpoint, each rank its own shards; jax
    gathers its sharded arrays into the usual single file."""
    sharded = getattr(backend, "shard", "none") != "none"
    return sharded and hasattr(backend, "dcp_state_dict")


def allow_other_world_size(mismatches: list[str]) -> list[str]:
    """A sharded checkpoint loads resharded at another world size: warn, drop that mismatch."""
    for m in mismatches:
        if m.startswith("world_size"):
            warnings.warn(
                f"resuming a sharded checkpoint at another {m}: the weights and optimizer "
                "state load resharded; the data order differs from the saved run's",
                stacklevel=3,
            )
    return [m for m in mismatches if not m.startswith("world_size")]


def load_sharded_into(backend: Any, path: Path) -> None:
    if not hasattr(backend, "load_dcp_state_dict"):
        raise ConfigError(f"{path} is a sharded checkpoint: resume it on eager or compile")
    backend.load_dcp_state_dict(load_sharded(path, backend.dcp_state_dict()))


def load_sharded(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (tensors sharded as this run shards them, or whole) from a sharded
    checkpoint written at any world size; works without a process group too."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process, no process group: DCP says it loads whole
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=dcp.FileSystemReader(path))
    return template


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


# Config keys that must match to resume: they change the model or the order of the data.
RESUME_KEYS = (
    "model.name",
    "model.num_classes",
    "model.pool",
    "data.source",
    "batch_size",
    "optim.grad_accum",
    "seed",
    "world_size",
)


def _get(tree: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def resume_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key (checkpoint X, now Y)' for every key of RESUME_KEYS that differs."""
    return [
        f"{k} (checkpoint {_get(saved, k)}, now {_get(current, k)})"
        for k in RESUME_KEYS
        if _get(saved, k) != _get(current, k)
    ]


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The whole state of a `.pt` checkpoint; of a sharded one, all but the tensors."""
    if is_sharded(path):
        path = Path(path) / META
    # Our own files: they hold RNG states and numpy arrays, which weights_only refuses.
    return torch.load(path, map_location="cpu", weights_only=False)
