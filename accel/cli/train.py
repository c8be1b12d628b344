"""The training loop, the same for every backend: data, steps, timing and logging, over the Engine
`accel.prepare` returns for the run's job (job.py), as a user's script holds one. Checkpoints are
the CheckpointManager's (checkpoints.py), the summary and MFU metrics.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
import warnings
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from accel.cli.checkpoints import CheckpointManager, remove_stale_temporaries, storage_error
from accel.cli.config import RunConfig
from accel.cli.console import (
    BestEvaluation,
    IntervalLines,
    Progress,
    closing_block,
    evaluation_line,
    on_terminal,
)
from accel.cli.data.loaders import build_train_loader
from accel.cli.evaluation import Evaluator
from accel.cli.flops import train_flops_per_image
from accel.cli.job import LRSchedule, build_engine
from accel.cli.metrics import (
    RunLogger,
    describe_device,
    host_bytes_now,
    peak_host_bytes,
    steady_images_per_sec,
    utilisation,
)
from accel.cli.models.factory import input_size
from accel.cli.runs import RunLock
from accel.cli.signals import NonFiniteLoss, TrainingStopped, stop_on_signals
from accel.config import AccelError
from accel.distributed import all_gather_ints
from accel.engine import Engine
from accel.report.summary import RunSummary
from accel.versions import stack


@dataclass
class LoopState:
    """Where training stands: a checkpoint part, loaded in place (the evaluator and the skip
    tracker hold this object)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # loader batches consumed in the current epoch
    losses: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unreadable images
    nonfinite_steps: list[int] = field(default_factory=list)  # steps whose update was skipped
    evals: list[dict] = field(default_factory=list)  # --eval_every's results, by epoch

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's loop state (the public API's holds the step alone)."""
        saved = LoopState(**state)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(saved, f.name))


@dataclass
class Timer:
    start: float
    first_step_s: float = float("nan")
    warm_t: float = float("nan")
    warm_step: int = 0
    data_wait_s: float = 0.0
    eval_s: float = 0.0  # evaluations inside the timed steady state (--eval_every)
    loop_s: float = 0.0
    startup_s: dict[str, float] = field(default_factory=dict)  # where time to first step goes
    group_start: tuple[float, float] = (0.0, 0.0)  # (time, data wait) at the current group's start

    def restart_group(self) -> None:
        """Time the next group of steps from here (after a fetch, a checkpoint, an eval)."""
        self.group_start = (time.perf_counter(), self.data_wait_s)

    def group(self, steps: int, batch: int) -> dict[str, float]:
        """The mean step time, img/s and data-wait fraction of the `steps` just fetched: read
        at the host sync the losses need anyway, so timing adds none."""
        started, waited = self.group_start
        elapsed = max(time.perf_counter() - started, 1e-9)
        return {
            "step_time_s": elapsed / steps,
            "images_per_sec": batch * steps / elapsed,
            "data_wait_fraction": (self.data_wait_s - waited) / elapsed,
        }

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.startup_s[name] = time.perf_counter() - t

    def first_step_done(self) -> str:
        """Record time to first step; the rest of it is the first batches and the compile."""
        self.first_step_s = time.perf_counter() - self.start
        done = sum(v for k, v in self.startup_s.items() if k != "first_step")
        self.startup_s["first_step"] = self.first_step_s - done
        phases = ", ".join(f"{k} {v:.1f}" for k, v in self.startup_s.items())
        return f"first step after {self.first_step_s:.1f} s: {phases}"


class SkipTracker:
    """Collects the unreadable files that workers skipped; warns once per file."""

    def __init__(self, state: LoopState, logger: RunLogger):
        self.logger = logger
        self.restore(state)

    def restore(self, state: LoopState) -> None:
        """Record into `state`, whose skips (a resumed run's, loaded into it) count as seen."""
        self.seen, self.state = set(state.skipped), state

    def add(self, paths: Iterable[str]) -> None:
        for path in paths:
            if path not in self.seen:
                self.seen.add(path)
                self.state.skipped.append(path)
                warnings.warn(f"skipped unreadable image {path}", stacklevel=2)
                self.logger.record("skipped_image", path=path)

    def track(self, loader: Iterable[dict]) -> Iterator[dict]:
        for batch in loader:
            self.add(batch["skipped"])
            yield batch


def timed_groups(stream: Iterator[Any], size: int, timer: Timer) -> Iterator[list[Any]]:
    """Groups of `size` micro-batches, adding the time spent waiting for them to the timer."""
    while True:
        t = time.perf_counter()
        group = [item for _, item in zip(range(size), stream, strict=False)]
        timer.data_wait_s += time.perf_counter() - t
        if len(group) < size:
            return
        yield group


def host_tuple(batch: dict) -> tuple:
    """A collated batch as the backends take it: images, targets (and erasing rectangles)."""
    return (batch["images"], batch["targets"], *((batch["erase"],) if "erase" in batch else ()))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainData:
    """This rank's training data: the ranks of a model-parallel group train on the same batch
    (and draw alike); one process feeding several devices loads a batch for each."""

    loader: Any
    host_batch: int
    steps_per_epoch: int
    total_steps: int

    @classmethod
    def build(cls, cfg: RunConfig, engine: Engine, image_size: int) -> TrainData:
        seed_everything(cfg.seed + engine.rank)
        host_batch = cfg.batch_size * engine.local_devices
        shard = (engine.rank, engine.data_ranks)
        loader = build_train_loader(
            cfg.data, image_size, host_batch, shard, cfg.seed, cast(int, cfg.model.num_classes),
            pin_memory=engine.pin_memory,
        )  # fmt: skip
        per_epoch = len(cast(Sized, loader.batch_sampler)) // cfg.accel.step.accum
        if per_epoch < 1:
            raise AccelError("an epoch holds fewer batches than --grad_accum")
        # resolve() settles --epochs where --steps is not given
        return cls(loader, host_batch, per_epoch, cfg.steps or cast(int, cfg.epochs) * per_epoch)


class StepLog:
    """Step handles waiting for their host values: fetched in one sync a group (--log_every),
    logged with the group's timing, and a non-finite step skipped or stopped at."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.pending: list[tuple[int, Any, float]] = []  # (step, handle, lr)
        self.nonfinite_stop: int | None = None  # the step that stops the run (--nan_policy stop)

    def add(self, step: int, handle: Any, lr: float) -> None:
        self.pending.append((step, handle, lr))

    def flush(self) -> None:
        """Fetch the pending losses in one host sync and log them, with their steps' timing."""
        t = self.t
        if not self.pending:
            return
        results = t.engine.fetch([handle for _, handle, _ in self.pending])
        timing = t.timer.group(len(self.pending), t.global_batch)
        fetched = []
        for (step, _, lr), (loss, applied) in zip(self.pending, results, strict=True):
            t.state.losses.append(float(loss))
            t.logger.record("step", step=step, loss=loss, lr=lr, applied=applied, **timing)
            t.logger.scalars(step, loss=loss, lr=lr, **timing)
            fetched.append((step, float(loss), lr))
            if not applied:
                self.non_finite(step, loss)
        # The steps up to the end of warm-up hold compiles: their time is not a step's.
        warming = self.pending[-1][0] <= t.timer.warm_step
        if t.engine.is_main:
            t.lines.fetched(fetched, timing, warming)
        self.pending.clear()
        t.timer.restart_group()

    def non_finite(self, step: int, loss: float) -> None:
        """Every rank sees the same (all-reduced) results, so all of them decide alike."""
        self.t.state.nonfinite_steps.append(step)
        self.t.logger.record("nonfinite_step", step=step, loss=loss)
        if self.t.cfg.nan_policy == "skip":
            warnings.warn(
                f"step {step}: non-finite loss ({loss}) or gradients, update skipped", stacklevel=2
            )
        elif self.nonfinite_stop is None:
            self.nonfinite_stop = step


class Trainer:
    def __init__(self, cfg: RunConfig, start_time: float | None = None):
        self.cfg = cfg
        self.timer = timer = Timer(start_time if start_time is not None else time.perf_counter())
        timer.startup_s["imports"] = time.perf_counter() - timer.start
        self.host_bytes_at_start = host_bytes_now()  # imports done, nothing of the model built
        seed_everything(cfg.seed)
        with timer.phase("flops"):
            self.flops_per_image = train_flops_per_image(cfg.model)
        self.state = LoopState()
        # The job on its backend as a user's script holds it, at timm's cosine rate (known once
        # the loader is) and EMA decay; the engine counts its steps in self.state.
        with timer.phase("setup"):
            self.engine = build_engine(cfg, lambda step: self.schedule(step), self.state)
        # One run folder for the job: each process named its own where no --run_name was given
        # (a timestamp, or the latest to resume), and the processes take rank 0's.
        self.cfg = cfg = dataclasses.replace(cfg, run_name=self.engine.broadcast(cfg.run_name))
        with timer.phase("loader"):
            self.data = TrainData.build(cfg, self.engine, input_size(cfg.model)[-1])
        self.total_steps = self.data.total_steps
        self.schedule = LRSchedule(cfg.optim, self.total_steps, self.data.steps_per_epoch)
        self.checkpoints = CheckpointManager(cfg, self.engine)
        self.steps = StepLog(self)
        self.best = BestEvaluation(cfg.checkpoint_best or "top1")
        self.stopping = False  # a signal asked to stop, and the ranks agreed

    @property
    def global_batch(self) -> int:
        return self.data.host_batch * self.engine.data_ranks * self.cfg.accel.step.accum

    def save(self) -> None:
        self.steps.flush()
        path = self.checkpoints.save(self.state.step)
        if self.engine.is_main:
            self.logger.info(f"checkpoint {path}")
        self.timer.restart_group()  # the write is not a step's time

    def train(self) -> dict[str, Any]:
        """Train in the run folder, which this run holds (its lock) until it returns."""
        run_dir = self.cfg.run_dir()
        lock = RunLock(run_dir) if self.engine.is_main else None
        try:
            if lock:
                remove_stale_temporaries(run_dir)
                (run_dir / "config.json").write_text(self.cfg.to_json())
            with self.timer.phase("logger"):
                self.logger = RunLogger(run_dir, self.engine.ctx)
            self.tracker = SkipTracker(self.state, self.logger)
            self.lines = IntervalLines(
                self.logger.info, self.cfg.log_every, self.total_steps, self.data.steps_per_epoch
            )
            self.evaluate = Evaluator(self.cfg, self.engine, self.data.host_batch, self.tracker)
            try:
                resume(self)
                return evaluate_only(self) if self.cfg.eval_only else self._train()
            finally:
                self.logger.close()
        except OSError as err:  # no space, no permission, not a directory
            raise storage_error(err, run_dir) from None
        finally:
            if lock:
                lock.release()

    def _train(self) -> dict[str, Any]:
        start = self.state.step
        # Steady-state timing starts after a few steps (compiles, caches), but never at the end.
        warm = start + max(1, self.cfg.timing_warmup_steps)
        self.timer.warm_step = min(warm, max(start + 1, self.total_steps - 1))
        self.logger.info(
            f"training {self.cfg.model.name} on {self.engine.backend}: "
            f"{self.total_steps} steps, global batch {self.global_batch}"
        )
        bar = Progress(
            self.engine.backend, self.total_steps, start, on_terminal(self.engine.is_main)
        )
        # The bar is closed (its line ended) on errors too, so error messages start a line.
        with bar, stop_on_signals() as self.stop:
            loop_start = time.perf_counter()
            self.timer.restart_group()
            while self.state.step < self.total_steps and not self._halted():
                self._run_epoch(bar, start)
            self.steps.flush()
            self.engine.synchronize()
            end = time.perf_counter()
            self.timer.loop_s = end - loop_start
        if self.cfg.save or self._halted():  # a stopped run is resumable
            self.save()
        if self.steps.nonfinite_stop is not None:
            raise NonFiniteLoss(self.steps.nonfinite_stop, self.state.step)
        if self.stopping:
            raise TrainingStopped(self.stop.signal_name, self.state.step)
        return final_summary(self, end)

    def _halted(self) -> bool:
        return self.stopping or self.steps.nonfinite_stop is not None

    def _stop_now(self) -> bool:
        """Whether to stop after this step; ranks agree at logging boundaries, so that all of
        them stop after the same step (a non-finite stop is read from all-reduced losses)."""
        if self.steps.nonfinite_stop is None and self.state.step % self.cfg.log_every == 0:
            self.stopping = self.engine.any_rank(self.stop.requested)
        return self._halted()

    def _run_epoch(self, bar: Progress, start: int) -> None:
        accum, loader = self.cfg.accel.step.accum, self.data.loader
        loader.batch_sampler.set_epoch(self.state.epoch, self.state.batch_in_epoch)
        host = (host_tuple(b) for b in self.tracker.track(loader))
        for micro in timed_groups(self.engine.loader(host), accum, self.timer):
            handle = self.engine.step_micro_batches(micro)  # counts the step in self.state
            self.steps.add(self.state.step, handle, self.schedule(self.state.step - 1))
            self.state.batch_in_epoch += accum
            self._after_step(start)
            bar.stepped(self.state.step)
            if self.state.step >= self.total_steps or self._stop_now():
                return
        self.state.epoch += 1
        self.state.batch_in_epoch = 0
        every = self.cfg.eval_every
        if every and self.state.epoch % every == 0 and self.state.step < self.total_steps:
            evaluate_between_epochs(self)

    def _after_step(self, start: int) -> None:
        step, cfg = self.state.step, self.cfg
        if step == self.timer.warm_step:
            self.steps.flush()  # host values mark the end of warm-up (and, first, of step one)
            self.engine.synchronize()
            self.engine.mark_warmup_done()
            self.timer.warm_t = time.perf_counter()
        if step == start + 1:
            self.steps.flush()
            self.logger.info(self.timer.first_step_done())
        if step % cfg.log_every == 0:  # the interval's line (console.IntervalLines)
            self.steps.flush()
        if cfg.save_every and step % cfg.save_every == 0 and step < self.total_steps:
            self.save()

    def eval_record(self, results: dict[str, float]) -> dict[str, Any]:
        """An evaluation's results with where in training they were taken: the epochs trained
        so far, the current one's share included, and the step."""
        batches = len(self.data.loader.batch_sampler)
        epochs = round(self.state.epoch + self.state.batch_in_epoch / batches, 3)
        return {"epoch": epochs, "step": self.state.step, **results}


def resume(t: Trainer) -> None:
    """--resume's checkpoint loaded into the run (its loop state in place), if there is one."""
    path = t.checkpoints.resume_path()
    if path is None:
        if t.cfg.resume == "auto":
            t.logger.info("--resume auto: no checkpoint yet, starting fresh")
        return
    t.checkpoints.load(path)
    t.tracker.restore(t.state)
    for results in t.state.evals:  # the best so far, as the saved run had it
        t.best.offer(results)
    t.logger.info(f"resumed from {path} at step {t.state.step}")


def evaluate_between_epochs(t: Trainer) -> None:
    """--eval_every: an evaluation between epochs, logged and kept for the summary."""
    t.steps.flush()
    started = time.perf_counter()
    results = t.eval_record(t.evaluate())
    if t.state.step > t.timer.warm_step:
        t.timer.eval_s += time.perf_counter() - started
    t.logger.record("eval", **results)
    t.logger.scalars(t.state.step, **{k: v for k, v in results.items() if "eval_" in k})
    kept(t, results)
    t.timer.restart_group()


def kept(t: Trainer, results: dict[str, Any]) -> None:
    """An evaluation kept for the summary and said with the best so far, whose checkpoint
    --checkpoint_best writes."""
    t.state.evals.append(results)
    better = t.best.offer(results)
    if t.engine.is_main:
        t.logger.info(evaluation_line(results, t.best))
    if better and t.cfg.checkpoint_best:
        path = t.checkpoints.save_best(results)
        if t.engine.is_main:
            t.logger.info(f"best checkpoint {path}")


def final_summary(t: Trainer, end: float) -> dict[str, Any]:
    """The finished run's summary.json (written by rank 0), after the final evaluation."""
    cfg, timer, state = t.cfg, t.timer, t.state
    steady_s = end - timer.warm_t - timer.eval_s
    ips = steady_images_per_sec(t.global_batch, state.step - timer.warm_step, steady_s)
    devices = t.engine.devices  # tensor-parallel and pipeline ranks too: what MFU divides by
    mfu = utilisation(ips, t.flops_per_image, cfg.peak_tflops, devices)
    summary = RunSummary(
        backend=t.engine.backend,
        model=cfg.model.name,
        run_dir=str(cfg.run_dir()),
        world_size=devices,
        amp_level=cfg.accel.step.amp,
        global_batch_size=t.global_batch,
        steps=state.step,
        seed=cfg.seed,
        kernel_opt=cfg.accel.step.kernel_opt,
        losses=state.losses,
        nonfinite_steps=state.nonfinite_steps,
        images_per_sec=ips,
        warm_step=timer.warm_step,
        time_to_first_step_s=timer.first_step_s,
        startup_s=timer.startup_s,
        data_wait_fraction=timer.data_wait_s / max(timer.loop_s, 1e-9),
        **mfu,
        device=describe_device(mfu["device_name"]),
        versions=stack(),
        backend_stats=t.engine.stats(),
    )
    if cfg.eval:
        summary.evaluation = t.evaluate()
        kept(t, t.eval_record(summary.evaluation))
    summary.evals = state.evals
    summary.skipped_images = len(state.skipped)  # after evaluation's skips too
    # Every rank's memory, construction, training, checkpoints and evaluation included.
    summary.peak_host_bytes = all_gather_ints(peak_host_bytes())
    summary.host_bytes_at_start = all_gather_ints(t.host_bytes_at_start)
    record = summary.to_dict()
    if t.engine.is_main:
        t.logger.write_summary(record)
        kept_files = [str(path) for path in t.checkpoints.kept()]
        t.logger.info(closing_block(ips, state.losses[-1], summary.run_dir, t.best, kept_files))
    return record


def evaluate_only(t: Trainer) -> dict[str, Any]:
    """--eval_only: the weights as loaded, evaluated; nothing trained or saved."""
    results = t.evaluate()
    summary = {
        "backend": t.engine.backend,
        "model": t.cfg.model.name,
        "eval_only": True,
        "step": t.state.step,
        "run_dir": str(t.cfg.run_dir()),
        **results,
        "skipped_images": len(t.state.skipped),
    }
    if t.engine.is_main:
        t.logger.write_summary(summary)
        line = ", ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "eval_images")
        t.logger.info(f"evaluated {results['eval_images']} images: {line}")
    return summary
