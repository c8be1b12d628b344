"""An engine's optimizer steps (Engine.steps): each step's learning rate(s) and EMA decay by the
steps done, the batch split into its accumulation micro-batches, the script's changes followed
before it, and its compiles and non-finite skips watched. The Engine's step, fetch and
lowered_step are these."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from accel.backends.base import BackendUnavailable, StepResult
from accel.backends.runner import Runner
from accel.batches import BatchTrees
from accel.config import AccelError, EmaDecayFn
from accel.loop import CompileWatch, LoopPart, SkipWatch, user_errors
from accel.script_changes import ScriptChanges


class Stepping:
    """The steps of one engine, over its runner.

    `rates`: the learning rate(s) of a step, by the steps done before it; `accum`: the
    micro-batches a step's batch is split into; `ema`: the EMA decay (0: none) or a function of
    the steps done, this one included; `state`: the loop state, whose `step` counts the steps;
    `on_change`: called after each step (the trained weights changed); `script`: what the
    script changes between steps (frozen weights, added groups)."""

    def __init__(
        self,
        runner: Runner,
        trees: BatchTrees,
        rates: Callable[[int], float | list[float]],
        state: LoopPart,
        *,
        accum: int = 1,
        ema: float | EmaDecayFn = 0.0,
        max_recompiles: int = -1,
        on_change: Callable[[], None] = lambda: None,
        script: ScriptChanges | None = None,
        is_main: bool = True,
    ):
        self.runner, self.trees, self.rates, self.state = runner, trees, rates, state
        self.accum, self.ema, self.on_change, self.script = accum, ema, on_change, script
        self.is_main = is_main
        self.lr: float | list[float] = 0.0  # the rate(s) the last step took
        self.compiles = CompileWatch(runner, max_recompiles)
        self.skips = SkipWatch()

    def step(self, batch: tuple) -> Any:
        """The step on one batch as the script gave it (a tuple of `step(x, y)`'s arguments)."""
        try:
            return self.step_leaves(self.micro_batches(self.trees.step_batch(batch)))
        except BackendUnavailable as err:  # an op the backend cannot lower: one line
            raise AccelError(str(err)) from None

    def step_micro_batches(self, micro_batches: list[Any]) -> Any:
        """The step on micro-batches the loader gave, already split (a group of k < accum
        weighs k/accum of a whole one, as the plain loop's)."""
        if not micro_batches:
            raise AccelError("engine.step_micro_batches() got no micro-batch")
        return self.step_leaves([self.trees.step_batch((batch,)) for batch in micro_batches])

    def step_leaves(self, micro_batches: list[tuple]) -> Any:
        """The step over micro-batches given as their tensors."""
        if self.script:  # weights frozen or groups added since the last step: followed, or one line
            self.script.before_step(self.runner)
        done = self.state.step
        self.lr = self.rates(done)
        decay = self.ema(done + 1) if callable(self.ema) else self.ema
        started = time.perf_counter()
        with user_errors("step"):
            handle = self.runner.train_step(micro_batches, self.lr, decay)
        self.state.step = done + 1
        self.on_change()
        self.compiles.stepped(micro_batches, time.perf_counter() - started, self.is_main)
        return handle

    def lowered_step(self, batch: tuple, platforms: Sequence[str]) -> Any:
        """The step on a batch of these shapes, lowered and run nowhere (Engine.lowered_step)."""
        leaves, rates = self.trees.step_batch(batch), self.rates(self.state.step)
        try:
            return self.runner.lowered_step(self.micro_batches(leaves), rates, tuple(platforms))
        except BackendUnavailable as err:
            raise AccelError(str(err)) from None

    def micro_batches(self, batch: tuple) -> list[tuple]:
        """A step's batch (its tensors) split into its `accum` micro-batches."""
        size = batch[0].shape[0]
        if size % self.accum:
            raise AccelError(f"a batch of {size} does not split into accum={self.accum} parts")
        return self.runner.split(batch, self.accum)

    def fetch(self, handles: Sequence[Any]) -> list[StepResult]:
        """The steps' results on the host, one sync for them all, their skips watched."""
        results = self.runner.fetch_results(list(handles))
        self.skips.watch(results, self.is_main)
        return results
