"""The command line's checkpoints: one every --save_every steps and at the end, the newest
--keep_checkpoints kept, and --resume's checked against the run's options first. Writing and
reading go through the Engine (`save`/`load`), as in a user's script: one checkpoint path. The
run folder's policy is the command line's own: its checkpoints are RUN/checkpoints/step_N.pt
(or step_N.dcp where each rank writes its part), the newest N kept, the latest found by its step.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from accel.checkpoint import PARTIAL, CheckpointError, first_line, read_meta
from accel.cli.config import (
    RunConfig,
    from_dict,
    get_path,
    global_batch,
    options,
    resume_keys,
    set_nested,
)
from accel.config import AccelError
from accel.engine import Engine

STEP_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")  # a checkpoint of the run's step N
BEST_NAME = "best"  # --checkpoint_best's checkpoint, RUN/checkpoints/best.pt


class StorageError(AccelError):
    """The run's folder cannot be written (full disk, permissions): one line naming the path and
    what was kept, exit 2."""


def storage_error(err: BaseException, run_dir: Path) -> StorageError:
    """What a failed write says: why, where, and the newest checkpoint still on disk."""
    reason = getattr(err, "strerror", None) or first_line(err)
    where = getattr(err, "filename", None) or run_dir
    latest = latest_checkpoint(run_dir)
    kept = f"kept {latest}" if latest else f"no checkpoint kept in {run_dir}"
    return StorageError(f"{reason}: cannot write {where}; {kept}")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_of(path: Path) -> int | None:
    """The step a checkpoint of the run was saved at (None: not one of its checkpoints)."""
    found = STEP_NAME.match(path.name)
    return int(found.group(1)) if found else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, oldest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune(run_dir: Path, keep: int) -> None:
    """All but the newest `keep` checkpoints removed (0: keep all)."""
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Temporary files and folders a killed writer left (the run folder's lock says no other
    writer is at work)."""
    folder = checkpoint_dir(run_dir)
    for tmp in folder.glob(PARTIAL) if folder.is_dir() else ():
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


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
    """The config a checkpoint was written with (in today's shape: `in_sections`)."""
    return from_dict(RunConfig, in_sections(json.loads(meta["config"])))


# Where a config written before the library's settings had a section of their own ("accel")
# kept them, by their flags' names: at the top (seed, amp_level, ...) and in these sections.
EARLIER_SECTIONS = ("optim", "parallel", "compiler")


def in_sections(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config in today's shape: one written before the library's settings moved under
    "accel" (and the hosts' under "hosts") has each found by its flag's name where it was, so
    that resuming such a run checks them as it checks any other."""
    if "accel" in saved:
        return saved
    earlier = {**saved, **{k: v for s in EARLIER_SECTIONS for k, v in saved.get(s, {}).items()}}
    shaped = dict(saved)
    for option in options():
        name = option.flag.lstrip("-").replace("-", "_")
        moved = option.path.startswith(("accel.", "hosts."))
        if moved and earlier.get(name) is not None:
            set_nested(shaped, option.path, earlier[name])
    return shaped


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

    def best_path(self) -> Path:
        """--checkpoint_best's: RUN/checkpoints/best.pt (or .dcp), never pruned (its name is
        no step's)."""
        suffix = "dcp" if self.engine.sharded_checkpoint else "pt"
        return checkpoint_dir(self.run_dir) / f"{BEST_NAME}.{suffix}"

    def save_best(self, results: dict[str, Any]) -> Path:
        """The weights of the best evaluation so far, replacing the last best; `results` kept in
        its meta (its loop state holds the step)."""
        path = self.best_path()
        self.engine.save(path, meta={"config": self.cfg.to_json(), "best": results})
        return path

    def kept(self) -> list[Path]:
        """The newest of the run's checkpoints, and its best where --checkpoint_best keeps one."""
        newest, best = latest_checkpoint(self.run_dir), self.best_path()
        return [p for p in (newest, best) if p is not None and p.exists()]

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
