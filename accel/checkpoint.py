"""Atomic checkpoints: write to a temporary file, flush and fsync, then rename; keep the last K."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

PATTERN = re.compile(r"^step_(\d+)\.pt$")


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


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:08d}.pt"
    tmp = folder / f".{final.name}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


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
    # Our own files: they hold RNG states and numpy arrays, which weights_only refuses.
    return torch.load(path, map_location="cpu", weights_only=False)
