"""An engine's checkpoints (Engine.checkpoints): its parts (the backend's tensors, the loop state,
the random states) written and read in the command line's format, with the rates of the
script's optimizer and the script's own small state beside them (accel/checkpoint.py writes and
reads the files)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from accel.backends.runner import Runner
from accel.checkpoint import (
    BackendTensors,
    CheckpointParts,
    RandomStates,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from accel.loop import LoopPart
from accel.optim import LearningRates


class Checkpointing:
    """Save and load for one engine. `replicas`: how many the global batch is split into (a
    checkpoint's random states load where the saved run had as many); `on_change`: called
    after a load (the trained weights changed)."""

    def __init__(
        self,
        runner: Runner,
        state: LoopPart,
        rates: Any,
        *,
        replicas: int,
        is_main: bool,
        on_change: Callable[[], None] = lambda: None,
    ):
        self.runner, self.state, self.rates, self.on_change = runner, state, rates, on_change
        self.replicas, self.is_main = replicas, is_main

    def parts(self) -> CheckpointParts:
        """What save and load write and read: the backend's tensors, the loop state (the step
        count) and the random states."""
        return CheckpointParts(BackendTensors(self.runner), self.state, RandomStates(self.runner))

    def save(self, path: Path, extra: dict[str, Any] | None, meta: dict[str, Any] | None) -> Path:
        """On every rank; returns once the checkpoint is whole on disk (Engine.save)."""
        meta = {**(meta or {}), "world_size": self.replicas}
        rates = self.rates.saved() if isinstance(self.rates, LearningRates) else None
        if rates is not None:  # the user's optimizer's, which `load` puts back
            meta["optimizer_lr"] = rates
        if extra is not None:
            meta["extra"] = extra
        sharded, rank = self.runner.sharded_checkpoint, self.runner.data_parallel[0]
        save_checkpoint(path, self.parts(), meta, self.is_main, rank, sharded)
        self.runner.any_rank(False)  # every rank waits for the writer: a load may follow at once
        return path

    def load(self, path: Path, rng: bool | None) -> dict[str, Any]:
        """Every part loaded, into any layout; the script's `extra` back (Engine.load)."""
        meta = read_meta(path)
        if rng is None:
            rng = meta.get("world_size") == self.replicas
        load_checkpoint(path, self.parts(), meta, self.runner.data_parallel[0], rng=rng)
        self.on_change()
        if isinstance(self.rates, LearningRates):
            self.rates.restore(meta.get("optimizer_lr"), self.state.step)
        return dict(meta.get("extra", {}))
