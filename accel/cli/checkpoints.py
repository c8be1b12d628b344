"""The command line's checkpoints: one every --save_every steps and at the end, the newest
--keep_checkpoints kept, and --resume's checked against the run's options first. Writing and
reading go through the Engine (`save`/`load`), as in a user's script: one checkpoint path."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from accel.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, prune, read_meta
from accel.cli.config import RunConfig, from_dict, get_path, global_batch, resume_keys
from accel.engine import Engine


def resume_mismatches(saved: RunConfig, current: RunConfig, saved_world: int, world: int) -> list:
    """'key (checkpoint X, now Y)' for every option that shapes the model or orders the data,
    and for the global batch; a world size that differs is listed last (a warning only)."""
    found = [
        f"{k} (checkpoint {get_path(saved, k)}, now {get_path(current, k)})"
        for k in resume_keys()
        if get_path(saved, k) != get_path(current, k)
    ]
    if global_batch(saved) != global_batch(current):
        found.append(
            f"global_batch (checkpoint {global_batch(saved)}, now {global_batch(current)})"
        )
    if saved_world != world:
        found.append(f"world_size (checkpoint {saved_world}, now {world})")
    return found


def saved_config(meta: dict[str, Any]) -> RunConfig:
    return from_dict(RunConfig, json.loads(meta["config"]))


class CheckpointManager:
    """A run's checkpoints, written and read by its Engine."""

    def __init__(self, cfg: RunConfig, engine: Engine):
        self.cfg, self.engine, self.run_dir = cfg, engine, cfg.run_dir()

    def save(self, step: int) -> Path:
        """Called on every rank."""
        suffix = "dcp" if self.engine.sharded_checkpoint else "pt"
        final = checkpoint_dir(self.run_dir) / f"step_{step:08d}.{suffix}"
        self.engine.save(final, meta={"config": self.cfg.to_json()})
        if self.engine.is_main:
            prune(self.run_dir, self.cfg.keep_checkpoints)
        return final

    def load(self, path: Path) -> None:
        """Check the checkpoint fits this run, then load every part."""
        path = Path(path)
        meta = read_meta(path)
        problems = []
        if "config" in meta:  # one the public API saved (Engine.save) holds no options
            problems = resume_mismatches(
                saved_config(meta), self.cfg, meta["world_size"], self.engine.replicas
            )
        other_world = [p for p in problems if p.startswith("world_size")]
        problems = [p for p in problems if p not in other_world]
        if problems:
            raise CheckpointError(f"cannot resume from {path}: {'; '.join(problems)}")
        if other_world:
            warnings.warn(
                f"resuming at another {other_world[0]}: the weights and optimizer state load "
                "resharded; the data order differs from the saved run's",
                stacklevel=2,
            )
        self.engine.load(path, rng=not other_world)

    def resume_path(self) -> Path | None:
        """--resume's checkpoint: a path, the newest of this run ('auto'), or none."""
        if not self.cfg.resume:
            return None
        if self.cfg.resume != "auto":
            return Path(self.cfg.resume)
        return latest_checkpoint(self.run_dir)
