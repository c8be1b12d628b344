"""What an engine trained, read out (Engine.weights): host copies under the script's model's names
and dtypes, the backend's own tensors, and the script's model kept current where the backend
trains arrays of its own (jax). The hooks accel puts on the script's model and optimizer
(user_model.py, user_optimizer.py) read and count through it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accel.backends.runner import Runner
from accel.config import AccelError
from accel.parallel.fsdp import full_value


class TrainedWeights:
    """The trained state of one engine's runner, and the script's model beside it.

    `changes` counts what changed the trained weights (steps, loads, an optimizer state
    loaded); `synced` is the count the script's model holds (sync_model); while `reading`, the
    engine reads that model itself and its read hooks stand by."""

    def __init__(self, runner: Runner, model_given: nn.Module | None = None):
        self.runner, self.model_given = runner, model_given
        self.changes = 0
        self.synced = 0
        self.reading = False

    def changed(self) -> None:
        """A step or a load changed the trained weights."""
        self.changes += 1

    def state_dict(self, ema: bool = False) -> dict[str, torch.Tensor]:
        """Host copies of the trained weights (or their EMA) and buffers (Engine.state_dict)."""
        state = self.runner.checkpoint_state()
        if ema and "ema" not in state:
            raise AccelError("no EMA weights kept: prepare(..., ema=DECAY)")
        tensors = {**state["model"], **(state["ema"] if ema else {})}
        dtypes = self.dtypes()
        out = {}
        for name, value in tensors.items():
            whole = full_value(value).detach()
            out[name] = whole.to("cpu", dtype=dtypes.get(name, whole.dtype), copy=True)
        if missing := set(dtypes) - set(out):
            raise AccelError(
                f"this layout keeps {len(missing)} of the model's tensors on other ranks (a "
                "pipeline): engine.save(path) writes all, engine.load in one process reads all"
            )
        return out

    def live_state(self) -> dict[str, Any]:
        """The training state as the backend holds it now (Engine.live_state)."""
        return self.runner.live_state()

    def dtypes(self) -> dict[str, torch.dtype]:
        """The script's model's dtype of each tensor, read past its own read hooks."""
        model = self.model_given
        if model is None:
            return {}
        reading, self.reading = self.reading, True
        try:
            return {n: t.dtype for n, t in model.state_dict(keep_vars=True).items()}
        finally:
            self.reading = reading

    def sync_model(self) -> nn.Module:
        """The script's model, holding the trained weights (Engine.sync_model)."""
        model = self.model_given
        if model is None:
            raise AccelError("this engine was given no model to sync")
        if not self.runner.trains_in_place:
            changes = self.changes
            model.load_state_dict(self.state_dict())
            self.synced = changes
        return model
