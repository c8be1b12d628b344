"""accel in your own training script: the backend switch as a library.

    import accel

    engine = accel.prepare(model, optimizer, loss_fn, schedule=lr_at, clip_grad=1.0, amp="O1")
    pending = []
    for images, targets in engine.loader(train_loader):
        pending.append(engine.step(images, targets))   # the whole optimizer step, on the device
        if len(pending) == 50:
            print(engine.fetch(pending)); pending.clear()   # one host sync for the group
    print(engine.evaluate(val_loader, metric_fn))
    engine.save("checkpoint.pt")

The backend comes from `backend=`, else ACCEL_BACKEND=eager|compile|xla|jax, else USE_ACCEL=1 (the
XLA compiler: jax on a CUDA GPU, xla elsewhere), else eager: as the command line reads them.

Why a loss function and not `loss.backward()`: the jax backend needs the whole optimizer step
as one pure function (torchax's make_train_step; torch_xla.compile(step, full_graph=True) too),
so accel runs it: accumulation, AMP, the mean over replicas, clipping, the update, the EMA and
the non-finite skip. The command line's Trainer drives the backends through the same calls.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.backends.base import BackendStats, MetricFn, StepResult
from accel.backends.runner import Runner
from accel.batches import BatchTrees
from accel.checkpointing import Checkpointing
from accel.config import AccelError, EmaDecayFn
from accel.distributed import DistContext
from accel.loop import LoopPart, StepCount, check_sharded, check_workers, user_errors
from accel.processes import ProcessCalls
from accel.script_changes import ScriptChanges
from accel.stepping import Stepping
from accel.trained import TrainedWeights
from accel.user_model import EvalModel


class Engine(ProcessCalls):
    """A model, optimizer and loss on one backend, made by `accel.prepare`: steps, fetches,
    evaluation and checkpoints, the same calls on every backend.

    >>> import torch, accel
    >>> model = torch.nn.Linear(4, 2)
    >>> loss_fn = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])
    >>> engine = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
    ...                        backend="eager", quiet=True)
    >>> handle = engine.step(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    >>> engine.fetch([handle])[0].applied
    True
    >>> engine.broadcast({"run": "run-1"})  # rank 0's value, on every rank
    {'run': 'run-1'}
    """

    def __init__(
        self,
        *,
        runner: Runner,
        ctx: DistContext,
        rates: Callable[[int], float | list[float]],
        accum: int = 1,
        ema: float | EmaDecayFn = 0.0,
        state: LoopPart | None = None,
        max_recompiles: int = -1,
        model_given: nn.Module | None = None,
        on_close: Callable[[], None] | None = None,
        trees: BatchTrees | None = None,
        script: ScriptChanges | None = None,
    ):
        """Made by `prepare` (not public). `rates`: the learning rate(s) of a step, by the steps
        done before it; `ema`: the EMA decay (0: none) or a function of the steps done, this one
        included; `state`: the loop state checkpoints carry; `max_recompiles`: graphs compiled
        after warm-up before a step stops (-1: any); `model_given`: the model prepare had;
        `on_close`: undoes prepare's changes to the process; `trees`: the batches' structures;
        `script`: what the script changes between steps (frozen weights, added groups)."""
        self.runner, self._ctx, self.rates, self.on_close = runner, ctx, rates, on_close
        self.trees = trees or BatchTrees()
        self.state = StepCount() if state is None else state
        # Its parts, each a collaborator of its own: what was trained, the steps, the
        # checkpoints (a step or a load tells the trained weights they changed).
        self.weights = TrainedWeights(runner, model_given)
        self.steps = Stepping(
            runner, self.trees, rates, self.state, accum=accum, ema=ema,
            max_recompiles=max_recompiles, on_change=self.weights.changed, script=script,
            is_main=ctx.is_main,
        )  # fmt: skip
        self.checkpoints = Checkpointing(
            runner, self.state, rates, replicas=self.replicas, is_main=ctx.is_main,
            on_change=self.weights.changed,
        )  # fmt: skip

    def close(self) -> None:
        """Puts back what `prepare` changed in the process (DataLoader workers' start method,
        the fork server's preload; docs/api.md lists what stays) and takes accel's hooks off
        your model and optimizer, which keep what was trained. `with accel.prepare(...)`."""
        undo, self.on_close = self.on_close or (lambda: None), None
        undo()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        # After an error in the block, that error is the one to see: closing's is dropped.
        with contextlib.suppress(Exception) if kind else contextlib.nullcontext():
            self.close()

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (skipped non-finite ones included)."""
        return self.state.step

    @property
    def lr(self) -> float | list[float]:
        """The learning rate(s) the last step took (each param group's, where they differ)."""
        return self.steps.lr

    @property
    def backend(self) -> str:
        """The backend's name: eager, compile, xla or jax."""
        return self.runner.name

    @property
    def ctx(self) -> DistContext:
        """This process's place among its peers (rank, local rank, processes), made by prepare."""
        return self._ctx

    @property
    def is_main(self) -> bool:
        """Whether this is the first process (the one that writes files and prints)."""
        return self._ctx.is_main

    @property
    def rank(self) -> int:
        """This process's data-parallel rank (0 with one process)."""
        return self.runner.data_parallel[0]

    @property
    def data_ranks(self) -> int:
        """Processes the data is split over (the ranks of a model-parallel group read the
        same batches): give each its part, e.g. DistributedSampler(num_replicas=data_ranks,
        rank=rank)."""
        return self.runner.data_parallel[1]

    @property
    def local_devices(self) -> int:
        """Devices this process feeds: its loader's batch holds one device batch for each."""
        return self.runner.local_replicas

    @property
    def devices(self) -> int:
        """Devices the step runs on, over every process (data x tensor x pipeline: MFU's)."""
        return self._ctx.world_size * self.runner.step_devices

    @property
    def replicas(self) -> int:
        """How many parts the global batch is split into: processes or devices."""
        return self.data_ranks * self.local_devices

    @property
    def pin_memory(self) -> bool:
        """Whether a DataLoader feeding `loader` should pin its batches (CUDA copies)."""
        return self.runner.pin_memory

    @property
    def sharded_checkpoint(self) -> bool:
        """Whether `save` writes a folder of each rank's part (DCP), not one file from rank 0."""
        return self.runner.sharded_checkpoint

    def loader(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Your loader's batches (tuples, dicts...) on the device, prefetched (MpDeviceLoader on
        xla, a CUDA side stream, sharded puts on jax); each rank's part: a DistributedSampler."""
        check_sharded(batches, self.data_ranks)
        check_workers(batches)
        return self.trees.loader(batches, self.runner.device_batches)

    def step(self, *batch: Any) -> Any:
        """One whole optimizer step on `batch` (what `loss_fn` takes as its batch); returns a
        handle that stays on the device until `fetch`. The batch is split into the `accum`
        micro-batches here; `step_micro_batches` takes them already split."""
        return self.steps.step(batch)

    def step_micro_batches(self, micro_batches: list[Any]) -> Any:
        """One optimizer step over `accum` device batches from `loader` (split for gradient
        accumulation), each as the loader gave it (a tuple, a dict...); a handle, as `step`.
        A group of k < `accum` weighs k/accum of a whole one, as the plain loop's. An op the
        backend cannot lower: BackendUnavailable (the command line's loop reads it)."""
        return self.steps.step_micro_batches(micro_batches)

    def lowered_step(self, *batch: Any, platforms: Sequence[str] = ()) -> Any:
        """The whole training step for a batch of these shapes, lowered and run nowhere, where
        one program compiles it: jax's `jax.stages.Lowered` (`.as_text()`, `.compile()`); for
        other `platforms` ('cuda' on a CPU), a `jax.export.Exported`. Others refuse in a line."""
        return self.steps.lowered_step(batch, platforms)

    def fetch(self, handles: Sequence[Any]) -> list[StepResult]:
        """The steps' (loss, applied) on the host: one sync for the whole group. `loss` is the
        mean over replicas; `applied` is False where a non-finite loss or gradient skipped the
        update."""
        return self.steps.fetch(handles)

    def evaluate(
        self, batches: Iterable[Any], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        """Sums of `metric_fn(model, batch)` ({name: tensor}) over the batches and the ranks,
        on the host; with `ema`, of the EMA weights. Divide the sums yourself (a count is one
        of them)."""
        check_sharded(batches, self.data_ranks)
        check_workers(batches)
        with user_errors("evaluation"):
            return self.runner.evaluate_sums(*self.trees.evaluation(batches, metric_fn), ema)

    @property
    def model(self) -> EvalModel:
        """The trained model for your own evaluation loop: `engine.model(images)` runs it in
        eval mode without gradients on the backend and returns torch tensors on the inputs'
        device (the host for jax's), whatever the backend."""
        return EvalModel(self.runner.forward, self.state_dict, self)

    # --- what was trained -----------------------------------------------------------------------
    def state_dict(self, ema: bool = False) -> dict[str, torch.Tensor]:
        """The trained weights (with `ema`, their moving average) and the model's buffers, on
        the host, under your model's own names and dtypes: `model.load_state_dict(
        engine.state_dict())` gives a model that evaluates as `evaluate` does, whatever the
        backend. Call it on every rank: split weights (shard="full") are gathered tensor by
        tensor. A pipeline keeps stages on different ranks: `save` a checkpoint instead, which
        holds the whole state and loads whole into one process."""
        return self.weights.state_dict(ema)

    def live_state(self) -> dict[str, Any]:
        """The training state as the backend holds it now, nothing copied or gathered:
        {"model": {name: tensor}, "optim": {name: {moment: tensor}}, and "ema" where one is
        kept}, in the backend's own tensors (DTensors on eager and compile, XLA tensors on xla,
        jax arrays with their shardings on jax). To see how a layout placed and split each
        tensor; `state_dict()` gives host copies."""
        return self.weights.live_state()

    def sync_model(self) -> nn.Module:
        """Your model, holding the trained weights; returns it. On eager, compile and xla it is
        the module trained, so this changes nothing; jax copies its arrays in here, and whenever
        the script reads that model (state_dict(), forward: TrainedOnRead). On every rank."""
        return self.weights.sync_model()

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank, the same answer on every rank (a collective)."""
        return self.runner.any_rank(flag)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` (anything JSON writes: a folder's name) on every rank, sent as
        JSON, never pickled; a collective, as `any_rank` (example: the class's)."""
        return json.loads(self.runner.broadcast_bytes(json.dumps(value).encode()))

    # --- timing and accounting ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device work queued so far (to time steps from the host)."""
        self.runner.synchronize()

    def mark_warmup_done(self) -> None:
        """Count compiles from here on (recompiles; past `max_recompiles` a step raises)."""
        self.steps.compiles.mark_warmup_done()

    def compiles_after_warmup(self) -> int:
        """Graphs of the step compiled since `mark_warmup_done` (0 before it)."""
        return self.steps.compiles.after_warmup()

    def stats(self) -> BackendStats:
        """What the backend tells of the run so far: graphs compiled (after warm-up too), compile
        time, cache hits, ops off the compiler, the state a rank holds, the peak memory."""
        return replace(self.runner.stats(), compiles_after_warmup=self.compiles_after_warmup())

    # --- checkpoints: the command line's format, tensors only ------------------------------------
    def save(
        self,
        path: str | Path,
        extra: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Weights, optimizer state (by parameter name), EMA, loop and random states in the
        command line's format, loadable on any backend and layout. Call it on every rank; it
        returns once the checkpoint is whole on disk: one file from rank 0, atomically, or where
        `sharded_checkpoint` a folder (torch.distributed.checkpoint) of each rank's shards.
        `extra`: your script's small state (epoch, best accuracy, a scheduler's state_dict():
        numbers, strings, lists, dicts, tensors), which `load` returns. `meta`: values kept
        beside them (accel.checkpoint.read_meta)."""
        return self.checkpoints.save(Path(path), extra, meta)

    def load(self, path: str | Path, rng: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of `save` or the command line (any backend and layout), unpickling
        nothing but tensors; returns its `extra` ({} where none). `rng`: restore the random
        generators too (default: where the saved run had as many replicas). The optimizer given
        to `prepare` takes back its groups' saved rates (a scheduler restored from `extra` goes
        on from them); a scheduler given as `schedule` is stepped to the saved step."""
        return self.checkpoints.load(Path(path), rng)


__all__ = ["AccelError", "Engine", "StepResult"]
