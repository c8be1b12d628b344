"""The training loop, the same for every backend: data, schedule, logging, checkpoints, summary."""

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
import torch.distributed as dist
from tqdm import tqdm

from accel import checkpoint as ckpt
from accel.backends import Backend, backend_module, create_backend
from accel.config import ConfigError, RunConfig
from accel.distributed import DistContext
from accel.flops import device_name, mfu, peak_tflops, train_flops_per_image
from accel.metrics import RunLogger
from accel.optim import LRSchedule
from accel.signals import NonFiniteLoss, TrainingStopped, stop_on_signals
from data.loaders import build_eval_loader, build_train_loader, dataset_num_classes
from models.factory import create_model


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # loader batches consumed in the current epoch
    losses: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unreadable images
    nonfinite_steps: list[int] = field(default_factory=list)  # steps whose update was skipped


@dataclass
class Timer:
    start: float
    first_step_s: float = float("nan")
    warm_t: float = float("nan")
    warm_step: int = 0
    data_wait_s: float = 0.0
    loop_s: float = 0.0
    startup_s: dict[str, float] = field(default_factory=dict)  # where time to first step goes

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.startup_s[name] = time.perf_counter() - t


class SkipTracker:
    """Collects the unreadable files that workers skipped; warns once per file."""

    def __init__(self, state: LoopState, logger: RunLogger):
        self.seen = set(state.skipped)
        self.state = state
        self.logger = logger

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


def host_batches(loader: Iterable[dict], tracker: SkipTracker) -> Iterator[tuple]:
    for batch in tracker.track(loader):
        yield batch["images"], batch["targets"]


def timed_groups(stream: Iterator[Any], size: int, timer: Timer) -> Iterator[list[Any]]:
    """Groups of `size` micro-batches, adding the time spent waiting for them to the timer."""
    while True:
        t = time.perf_counter()
        group = []
        for item in stream:
            group.append(item)
            if len(group) == size:
                break
        timer.data_wait_s += time.perf_counter() - t
        if len(group) < size:
            return
        yield group


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, start_time: float | None = None):
        self.cfg = cfg
        self.ctx = ctx
        self.timer = timer = Timer(start_time if start_time is not None else time.perf_counter())
        timer.startup_s["imports"] = time.perf_counter() - timer.start
        seed_everything(cfg.seed)
        cfg.model.num_classes = dataset_num_classes(cfg.data)
        with timer.phase("backend"):
            self.backend: Backend = create_backend(cfg, ctx)
        with timer.phase("model"):
            self.model = create_model(cfg.model)
        self.image_size = self.model.input_size[-1]
        with timer.phase("flops"):
            self.flops_per_image = train_flops_per_image(cfg.model)
        with timer.phase("setup"):
            self.backend.setup(self.model)
        # Data-parallel position: the ranks of a tensor-parallel group train on the same batch.
        self.data_rank, self.data_ranks = getattr(
            self.backend, "data_parallel", (ctx.rank, ctx.world_size)
        )
        # The same initial weights on every rank (above), then each data-parallel rank its own
        # random stream (a tp group's ranks draw alike: their replicated layers stay equal).
        seed_everything(cfg.seed + self.data_rank)
        # A backend driving several local devices from one process (jax) loads a batch for each.
        self.host_batch = cfg.batch_size * self.backend.local_replicas
        with timer.phase("loader"):
            self.loader = build_train_loader(
                cfg.data,
                self.image_size,
                self.host_batch,
                self.data_rank,
                self.data_ranks,
                cfg.seed,
                pin_memory=self.backend.pin_memory,
            )
        self.steps_per_epoch = len(self.loader.batch_sampler) // cfg.optim.grad_accum
        if self.steps_per_epoch < 1:
            raise ConfigError("an epoch holds fewer batches than --grad_accum")
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        if self.total_steps < 1:
            raise ConfigError("nothing to train: give --steps or --epochs")
        self.schedule = LRSchedule(cfg.optim, self.total_steps)
        self.state = LoopState()
        with timer.phase("logger"):
            self.logger = RunLogger(cfg.run_dir(), ctx)
        if ctx.is_main:
            (cfg.run_dir() / "config.json").write_text(cfg.to_json())
        self.tracker = SkipTracker(self.state, self.logger)
        self.pending: list[tuple[int, Any, float]] = []
        self.start_step = 0
        self.stopping = False  # a signal asked to stop, and the ranks agreed
        self.nonfinite_stop: int | None = None  # the step that stops the run (--nan_policy stop)

    @property
    def replicas(self) -> int:
        """Devices training data-parallel: processes times the devices each one drives."""
        return self.ctx.world_size * self.backend.local_replicas

    @property
    def global_batch(self) -> int:
        return self.host_batch * self.data_ranks * self.cfg.optim.grad_accum

    # --- checkpoints --------------------------------------------------------------------------
    def resume(self) -> None:
        path = self._resume_path()
        if path is None:
            return
        saved = ckpt.load_checkpoint(path)
        mismatches = ckpt.resume_mismatches(saved["config"], self._resume_identity())
        sharded = ckpt.is_sharded(path)
        if sharded:  # resharded on load: another world size is allowed
            mismatches = ckpt.allow_other_world_size(mismatches)
        if mismatches:
            raise ConfigError(f"cannot resume from {path}: {'; '.join(mismatches)}")
        if sharded:
            ckpt.load_sharded_into(self.backend, path)
        else:
            self.backend.load_state_dict(saved["backend"])
        self.state = LoopState(**saved["loop"])
        self.tracker = SkipTracker(self.state, self.logger)
        self._load_rng_states(saved["rng"])
        self.logger.info(f"resumed from {path} at step {self.state.step}")

    def _resume_identity(self) -> dict[str, Any]:
        # The data order follows the data-parallel replicas (a tp group counts once).
        return {
            **dataclasses.asdict(self.cfg),
            "world_size": self.data_ranks * self.backend.local_replicas,
        }

    def _resume_path(self):
        if not self.cfg.resume:
            return None
        if self.cfg.resume != "auto":
            return self.cfg.resume
        latest = ckpt.latest_checkpoint(self.cfg.run_dir())
        if latest is None:
            self.logger.info("--resume auto: no checkpoint yet, starting fresh")
        return latest

    def save(self) -> None:
        self.flush()
        meta = {
            "loop": dataclasses.asdict(self.state),
            "rng": self._rng_states(),
            "config": self._resume_identity(),
        }
        run_dir, step, keep = self.cfg.run_dir(), self.state.step, self.cfg.keep_checkpoints
        if ckpt.writes_shards(self.backend):
            tensors = self.backend.dcp_state_dict()
            path = ckpt.save_sharded(run_dir, step, tensors, meta, keep)
        elif self.ctx.is_main or getattr(self.backend, "gathers_state", False):
            state = {"backend": self.backend.state_dict(), **meta}
            if self.ctx.is_main:
                path = ckpt.save_checkpoint(run_dir, step, state, keep)
        if self.ctx.is_main:
            self.logger.info(f"checkpoint {path}")

    def _rng_states(self) -> list[dict[str, Any]]:
        """Every rank's random generator states, in rank order."""
        mine = {**ckpt.host_rng_state(), "device": self.backend.rng_state()}
        if not dist.is_initialized():
            return [mine]
        states: list = [None] * self.ctx.world_size
        dist.all_gather_object(states, mine)
        return states

    def _load_rng_states(self, states: list[dict[str, Any]]) -> None:
        # Replicas outside torch.distributed (xla on TPU, jax multi-host) save the first one's
        # states only, and all resume from them (jax's step keys need no saved state).
        mine = states[self.ctx.rank] if self.ctx.rank < len(states) else states[0]
        ckpt.set_host_rng_state(mine)
        self.backend.load_rng_state(mine["device"])

    # --- logging ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Fetch the pending losses in one host sync and log them."""
        if not self.pending:
            return
        results = self.backend.fetch_results([handle for _, handle, _ in self.pending])
        for (step, _, lr), (loss, applied) in zip(self.pending, results, strict=True):
            self.state.losses.append(loss)
            self.logger.record("step", step=step, loss=loss, lr=lr, applied=applied)
            self.logger.scalars(step, loss=loss, lr=lr)
            if not applied:
                self._non_finite(step, loss)
        self.pending.clear()

    def _non_finite(self, step: int, loss: float) -> None:
        """Every rank sees the same (all-reduced) results, so all of them decide alike."""
        self.state.nonfinite_steps.append(step)
        self.logger.record("nonfinite_step", step=step, loss=loss)
        if self.cfg.nan_policy == "stop":
            if self.nonfinite_stop is None:
                self.nonfinite_stop = step
        else:
            warnings.warn(
                f"step {step}: non-finite loss ({loss}) or gradients, update skipped", stacklevel=2
            )

    # --- the loop -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        self.resume()
        self.start_step = self.state.step
        # Steady-state timing starts after a few steps (compiles, caches), but never at the end.
        warm = self.start_step + max(1, self.cfg.timing_warmup_steps)
        self.timer.warm_step = min(warm, max(self.start_step + 1, self.total_steps - 1))
        self.logger.info(
            f"training {self.cfg.model.name} on {self.backend.name}: "
            f"{self.total_steps} steps, global batch {self.global_batch}"
        )
        bar = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            desc=self.backend.name,
            disable=not self.ctx.is_main,
            dynamic_ncols=True,
        )
        # The bar is closed (its line ended) on errors too, so error messages start a line.
        with bar, stop_on_signals() as self.stop:
            loop_start = time.perf_counter()
            while self.state.step < self.total_steps and not self._halted():
                self._run_epoch(bar)
            self.flush()
            self.backend.synchronize()
            self.timer.loop_s = time.perf_counter() - loop_start
            end = time.perf_counter()
        self.save()
        if self._halted():
            self.logger.close()
        if self.nonfinite_stop is not None:
            raise NonFiniteLoss(self.nonfinite_stop, self.state.step)
        if self.stopping:
            raise TrainingStopped(self.stop.signal_name, self.state.step)
        return self._finish(end)

    def _halted(self) -> bool:
        return self.stopping or self.nonfinite_stop is not None

    def _stop_now(self) -> bool:
        """Whether to stop after this step; ranks agree on it at logging boundaries, so that
        all of them stop after the same step."""
        if self.nonfinite_stop is not None:  # found in all-reduced losses: the same on all ranks
            return True
        if not dist.is_initialized():
            self.stopping = self.stop.requested
        elif self.state.step % self.cfg.log_every == 0:
            flag = torch.tensor([float(self.stop.requested)], device=self.backend.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.stopping = bool(flag.item())
        return self.stopping

    def _run_epoch(self, bar: tqdm) -> None:
        accum = self.cfg.optim.grad_accum
        self.loader.batch_sampler.set_epoch(self.state.epoch, self.state.batch_in_epoch)
        stream = self.backend.device_batches(host_batches(self.loader, self.tracker))
        for micro in timed_groups(stream, accum, self.timer):
            lr = self.schedule(self.state.step)
            loss = self.backend.train_step(micro, lr)
            self.state.step += 1
            self.state.batch_in_epoch += accum
            self.pending.append((self.state.step, loss, lr))
            self._after_step()
            bar.update(1)
            if self.state.step >= self.total_steps or self._stop_now():
                return
        self.state.epoch += 1
        self.state.batch_in_epoch = 0

    def _after_step(self) -> None:
        step, cfg = self.state.step, self.cfg
        if step == self.timer.warm_step:
            self.flush()  # host values mark the end of warm-up (and, first, of step one)
            self.backend.synchronize()
            self.backend.mark_warmup_done()
            self.timer.warm_t = time.perf_counter()
        if step == self.start_step + 1:
            self.flush()
            self.timer.first_step_s = time.perf_counter() - self.timer.start
            # The rest of time to first step: the first batches, tracing and compiling the step.
            done = sum(v for k, v in self.timer.startup_s.items() if k != "first_step")
            self.timer.startup_s["first_step"] = self.timer.first_step_s - done
            phases = ", ".join(f"{k} {v:.1f}" for k, v in self.timer.startup_s.items())
            self.logger.info(f"first step after {self.timer.first_step_s:.1f} s: {phases}")
        if len(self.pending) >= cfg.log_every:
            self.flush()
        if cfg.save_every and step % cfg.save_every == 0 and step < self.total_steps:
            self.save()

    def _finish(self, end: float) -> dict[str, Any]:
        timed_steps = self.state.step - self.timer.warm_step
        elapsed = end - self.timer.warm_t
        ips = self.global_batch * timed_steps / elapsed if timed_steps > 0 and elapsed > 0 else 0.0
        summary = {
            "backend": self.backend.name,
            "model": self.cfg.model.name,
            "world_size": self.replicas,
            "amp_level": self.cfg.amp_level,
            "global_batch_size": self.global_batch,
            "steps": self.state.step,
            "losses": self.state.losses,
            "images_per_sec": ips,
            "time_to_first_step_s": self.timer.first_step_s,
            "startup_s": self.timer.startup_s,
            "data_wait_fraction": self.timer.data_wait_s / max(self.timer.loop_s, 1e-9),
            "skipped_images": len(self.state.skipped),
            "nonfinite_steps": self.state.nonfinite_steps,
            "seed": self.cfg.seed,
            "kernel_opt": self.cfg.kernel_opt,
            **self._utilisation(ips),
            "run_dir": str(self.cfg.run_dir()),
            **self.backend.stats(),
        }
        if self.cfg.eval:
            summary.update(self.evaluate())
        if self.ctx.is_main:
            self.logger.write_summary(summary)
            self.logger.info(f"{ips:.1f} img/s, final loss {self.state.losses[-1]:.4f}")
        self.logger.close()
        return summary

    def _utilisation(self, ips: float) -> dict[str, Any]:
        name = device_name()
        peak = peak_tflops(name, self.cfg.peak_tflops or None)
        return {
            "flops_per_image": self.flops_per_image,
            "device_name": name,
            "peak_tflops": peak,
            "mfu": mfu(ips, self.flops_per_image, peak, self.replicas),
        }

    def evaluate(self) -> dict[str, float]:
        loader = build_eval_loader(
            self.cfg.data,
            self.image_size,
            self.host_batch,
            self.data_rank,
            self.data_ranks,
            self.cfg.seed,
        )
        return self.backend.evaluate(self.tracker.track(loader))


def run_replica(index: int, cfg: RunConfig) -> None:
    """Entry point for a backend's own multi-replica launcher (one call per replica)."""
    ctx = backend_module(cfg.backend).replica_context()
    Trainer(cfg, ctx).train()
