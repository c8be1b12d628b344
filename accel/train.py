"""The training loop, the same for every backend: data, schedule, steps and logging. Checkpoints
are the CheckpointManager's (checkpoint.py), the summary and MFU metrics.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from accel.backends import Backend, create_backend
from accel.checkpoint import CheckpointManager, remove_stale_temporaries, storage_error
from accel.config import ConfigError, RunConfig
from accel.data.loaders import build_train_loader
from accel.distributed import DistContext, all_gather_ints
from accel.engine import Engine
from accel.evaluation import Evaluator
from accel.flops import train_flops_per_image
from accel.metrics import (
    RunLogger,
    describe_device,
    host_bytes_now,
    peak_host_bytes,
    steady_images_per_sec,
    utilisation,
)
from accel.models.factory import input_size
from accel.optim import EmaDecay, LRSchedule
from accel.runs import RunLock
from accel.signals import NonFiniteLoss, TrainingStopped, stop_on_signals
from accel.summary import RunSummary
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


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, start_time: float | None = None):
        self.cfg, self.ctx = cfg, ctx
        self.timer = timer = Timer(start_time if start_time is not None else time.perf_counter())
        timer.startup_s["imports"] = time.perf_counter() - timer.start
        self.host_bytes_at_start = host_bytes_now()  # imports done, nothing of the model built
        seed_everything(cfg.seed)
        with timer.phase("backend"):
            self.backend: Backend = create_backend(cfg, ctx)
        with timer.phase("setup"):
            self.backend.setup(cfg.model)
        with timer.phase("flops"):
            self.flops_per_image = train_flops_per_image(cfg.model)
        # The ranks of a model-parallel group train on the same batch, and draw alike.
        self.data_rank, self.data_ranks = self.backend.data_parallel
        seed_everything(cfg.seed + self.data_rank)
        # A backend driving several local devices from one process (jax) loads a batch for each.
        self.host_batch = cfg.batch_size * self.backend.local_replicas
        with timer.phase("loader"):
            self.loader = build_train_loader(
                cfg.data,
                self.image_size,
                self.host_batch,
                (self.data_rank, self.data_ranks),
                cfg.seed,
                cfg.model.num_classes,
                pin_memory=self.backend.pin_memory,
            )
        self.steps_per_epoch = len(self.loader.batch_sampler) // cfg.optim.grad_accum
        if self.steps_per_epoch < 1:
            raise ConfigError("an epoch holds fewer batches than --grad_accum")
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.state = LoopState()
        # The backend as the public API drives it: steps, fetches, evaluation and checkpoint
        # parts go through the engine, at timm's cosine rate and EMA decay of each step.
        schedule = LRSchedule(cfg.optim, self.total_steps, self.steps_per_epoch)
        ema = EmaDecay(cfg.optim) if cfg.optim.model_ema else 0.0
        accum = cfg.optim.grad_accum
        self.engine = Engine(self.backend, ctx, schedule, accum, ema, self.state)
        parts, sharded = self.engine.checkpoint_parts(), self.backend.sharded_checkpoint
        self.checkpoints = CheckpointManager(
            cfg, ctx.is_main, ctx.rank, parts, sharded, self.engine.replicas
        )
        self.pending: list[tuple[int, Any, float]] = []
        self.stopping = False  # a signal asked to stop, and the ranks agreed
        self.nonfinite_stop: int | None = None  # the step that stops the run (--nan_policy stop)

    @property
    def image_size(self) -> int:
        return input_size(self.cfg.model)[-1]

    @property
    def global_batch(self) -> int:
        return self.host_batch * self.data_ranks * self.cfg.optim.grad_accum

    def resume(self) -> None:
        path = self.checkpoints.resume_path()
        if path is None:
            if self.cfg.resume == "auto":
                self.logger.info("--resume auto: no checkpoint yet, starting fresh")
            return
        self.checkpoints.load(path)  # the loop state in place, for those who hold it
        self.tracker.restore(self.state)
        self.logger.info(f"resumed from {path} at step {self.state.step}")

    def save(self) -> None:
        self.flush()
        path = self.checkpoints.save(self.state.step)
        if self.ctx.is_main:
            self.logger.info(f"checkpoint {path}")
        self.timer.restart_group()  # the write is not a step's time

    def flush(self) -> None:
        """Fetch the pending losses in one host sync and log them, with their steps' timing."""
        if not self.pending:
            return
        results = self.engine.fetch([handle for _, handle, _ in self.pending])
        timing = self.timer.group(len(self.pending), self.global_batch)
        for (step, _, lr), (loss, applied) in zip(self.pending, results, strict=True):
            self.state.losses.append(loss)
            self.logger.record("step", step=step, loss=loss, lr=lr, applied=applied, **timing)
            self.logger.scalars(step, loss=loss, lr=lr, **timing)
            if not applied:
                self._non_finite(step, loss)
        self.pending.clear()
        self.timer.restart_group()

    def _non_finite(self, step: int, loss: float) -> None:
        """Every rank sees the same (all-reduced) results, so all of them decide alike."""
        self.state.nonfinite_steps.append(step)
        self.logger.record("nonfinite_step", step=step, loss=loss)
        if self.cfg.nan_policy == "skip":
            warnings.warn(
                f"step {step}: non-finite loss ({loss}) or gradients, update skipped", stacklevel=2
            )
        elif self.nonfinite_stop is None:
            self.nonfinite_stop = step

    def train(self) -> dict[str, Any]:
        """Train in the run folder, which this run holds (its lock) until it returns."""
        lock = RunLock(self.cfg.run_dir()) if self.ctx.is_main else None
        try:
            if lock:
                remove_stale_temporaries(self.cfg.run_dir())
                (self.cfg.run_dir() / "config.json").write_text(self.cfg.to_json())
            with self.timer.phase("logger"):
                self.logger = RunLogger(self.cfg.run_dir(), self.ctx)
            self.tracker = SkipTracker(self.state, self.logger)
            shard = (self.data_rank, self.data_ranks)
            self.evaluate = Evaluator(
                self.cfg, self.engine, self.image_size, self.host_batch, shard, self.tracker.track
            )
            try:
                return self._train()
            finally:
                self.logger.close()
        except OSError as err:  # no space, no permission, not a directory
            raise storage_error(err, self.cfg.run_dir()) from None
        finally:
            if lock:
                lock.release()

    def _train(self) -> dict[str, Any]:
        self.resume()
        if self.cfg.eval_only:
            return self._evaluate_only()
        start = self.state.step
        # Steady-state timing starts after a few steps (compiles, caches), but never at the end.
        warm = start + max(1, self.cfg.timing_warmup_steps)
        self.timer.warm_step = min(warm, max(start + 1, self.total_steps - 1))
        self.logger.info(
            f"training {self.cfg.model.name} on {self.backend.name}: "
            f"{self.total_steps} steps, global batch {self.global_batch}"
        )
        bar = tqdm(
            total=self.total_steps,
            initial=start,
            desc=self.backend.name,
            disable=not self.ctx.is_main,
            dynamic_ncols=True,
        )
        # The bar is closed (its line ended) on errors too, so error messages start a line.
        with bar, stop_on_signals() as self.stop:
            loop_start = time.perf_counter()
            self.timer.restart_group()
            while self.state.step < self.total_steps and not self._halted():
                self._run_epoch(bar, start)
            self.flush()
            self.backend.synchronize()
            end = time.perf_counter()
            self.timer.loop_s = end - loop_start
        self.save()
        if self.nonfinite_stop is not None:
            raise NonFiniteLoss(self.nonfinite_stop, self.state.step)
        if self.stopping:
            raise TrainingStopped(self.stop.signal_name, self.state.step)
        return self._finish(end)

    def _halted(self) -> bool:
        return self.stopping or self.nonfinite_stop is not None

    def _stop_now(self) -> bool:
        """Whether to stop after this step; ranks agree at logging boundaries, so that all of
        them stop after the same step."""
        if self.nonfinite_stop is not None:  # found in all-reduced losses: the same on all ranks
            return True
        if self.state.step % self.cfg.log_every == 0:
            self.stopping = self.engine.any_rank(self.stop.requested)
        return self.stopping

    def _run_epoch(self, bar: tqdm, start: int) -> None:
        accum = self.cfg.optim.grad_accum
        self.loader.batch_sampler.set_epoch(self.state.epoch, self.state.batch_in_epoch)
        host = (host_tuple(b) for b in self.tracker.track(self.loader))
        for micro in timed_groups(self.engine.loader(host), accum, self.timer):
            handle = self.engine.step_micro_batches(micro)  # counts the step in self.state
            self.pending.append((self.state.step, handle, self.engine.lr))
            self.state.batch_in_epoch += accum
            self._after_step(start)
            bar.update(1)
            if self.state.step >= self.total_steps or self._stop_now():
                return
        self.state.epoch += 1
        self.state.batch_in_epoch = 0
        every = self.cfg.eval_every
        if every and self.state.epoch % every == 0 and self.state.step < self.total_steps:
            self._evaluate_epoch()

    def epochs_done(self) -> float:
        """Epochs trained so far, the current one's share included."""
        batches = len(self.loader.batch_sampler)
        return round(self.state.epoch + self.state.batch_in_epoch / batches, 3)

    def _eval_record(self, results: dict[str, float]) -> dict[str, Any]:
        """An evaluation's results with where in training they were taken."""
        return {"epoch": self.epochs_done(), "step": self.state.step, **results}

    def _evaluate_epoch(self) -> None:
        """--eval_every: an evaluation between epochs, logged and kept for the summary."""
        self.flush()
        t = time.perf_counter()
        results = self._eval_record(self.evaluate())
        if self.state.step > self.timer.warm_step:
            self.timer.eval_s += time.perf_counter() - t
        self.state.evals.append(results)
        self.logger.record("eval", **results)
        self.logger.scalars(self.state.step, **{k: v for k, v in results.items() if "eval_" in k})
        self.logger.info(
            f"epoch {self.state.epoch}: eval top-1 {results['eval_acc']:.4f}, "
            f"loss {results['eval_loss']:.4f}"
        )
        self.timer.restart_group()

    def _after_step(self, start: int) -> None:
        step, cfg = self.state.step, self.cfg
        if step == self.timer.warm_step:
            self.flush()  # host values mark the end of warm-up (and, first, of step one)
            self.backend.synchronize()
            self.backend.mark_warmup_done()
            self.timer.warm_t = time.perf_counter()
        if step == start + 1:
            self.flush()
            self.logger.info(self.timer.first_step_done())
        if len(self.pending) >= cfg.log_every:
            self.flush()
        if cfg.save_every and step % cfg.save_every == 0 and step < self.total_steps:
            self.save()

    def _finish(self, end: float) -> dict[str, Any]:
        timed = self.state.step - self.timer.warm_step
        steady_s = end - self.timer.warm_t - self.timer.eval_s
        ips = steady_images_per_sec(self.global_batch, timed, steady_s)
        replicas = self.ctx.world_size * self.backend.local_replicas
        mfu = utilisation(ips, self.flops_per_image, self.cfg.peak_tflops, replicas)
        summary = RunSummary(
            backend=self.backend.name,
            model=self.cfg.model.name,
            run_dir=str(self.cfg.run_dir()),
            world_size=replicas,
            amp_level=self.cfg.amp_level,
            global_batch_size=self.global_batch,
            steps=self.state.step,
            seed=self.cfg.seed,
            kernel_opt=self.cfg.kernel_opt,
            losses=self.state.losses,
            nonfinite_steps=self.state.nonfinite_steps,
            images_per_sec=ips,
            warm_step=self.timer.warm_step,
            time_to_first_step_s=self.timer.first_step_s,
            startup_s=self.timer.startup_s,
            data_wait_fraction=self.timer.data_wait_s / max(self.timer.loop_s, 1e-9),
            **mfu,
            device=describe_device(mfu["device_name"]),
            versions=stack(),
            backend_stats=self.backend.stats(),
        )
        if self.cfg.eval:
            summary.evaluation = self.evaluate()
            self.state.evals.append(self._eval_record(summary.evaluation))
        summary.evals = self.state.evals
        summary.skipped_images = len(self.state.skipped)  # after evaluation's skips too
        # Every rank's memory, construction, training, checkpoints and evaluation included.
        summary.peak_host_bytes = all_gather_ints(peak_host_bytes())
        summary.host_bytes_at_start = all_gather_ints(self.host_bytes_at_start)
        record = summary.to_dict()
        if self.ctx.is_main:
            self.logger.write_summary(record)
            self.logger.info(f"{ips:.1f} img/s, final loss {self.state.losses[-1]:.4f}")
        return record

    def _evaluate_only(self) -> dict[str, Any]:
        """--eval_only: the weights as loaded, evaluated; nothing trained or saved."""
        results = self.evaluate()
        summary = {
            "backend": self.backend.name,
            "model": self.cfg.model.name,
            "eval_only": True,
            "step": self.state.step,
            "run_dir": str(self.cfg.run_dir()),
            **results,
            "skipped_images": len(self.state.skipped),
        }
        if self.ctx.is_main:
            self.logger.write_summary(summary)
            line = ", ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "eval_images")
            self.logger.info(f"evaluated {results['eval_images']} images: {line}")
        return summary
