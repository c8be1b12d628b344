"""What a run tells a person while it trains, as timm's train.py does: a line every --log_every
steps (step, epoch, the mean loss since the last line, the learning rate, img/s), a line each
evaluation (top-1, top-5, loss and the best so far), and a closing block; and the progress bar,
whose estimate starts after the first (compiling) step. The lines go to the run's logger (the
terminal and train.log); the bar to a terminal only."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from tqdm import tqdm

# --checkpoint_best's metrics: (evaluation key, True where higher is better, the name said).
BEST_METRICS = {
    "top1": ("eval_acc", True, "top-1"),
    "top5": ("eval_acc5", True, "top-5"),
    "loss": ("eval_loss", False, "eval loss"),
}


@dataclass
class IntervalLines:
    """The training lines: losses gathered at each fetch (no sync of their own), said every
    `every` steps as their mean, with the rate and the images/s of the steps since the last
    line (the first step's compile left out of the speed)."""

    say: Callable[[str], None]
    every: int
    total_steps: int
    steps_per_epoch: int
    losses: list[float] = field(default_factory=list)
    images: float = 0.0
    seconds: float = 0.0

    def fetched(self, losses: list[tuple[int, float, float]], timing: dict[str, float],
                warming: bool) -> None:  # fmt: skip
        """`losses`: (step, loss, lr) of one fetch; `timing`: its group's (Timer.group);
        `warming`: the group's steps are the run's warm-up, whose time is mostly compiles."""
        self.losses += [loss for _, loss, _ in losses]
        if not warming:
            steps = len(losses)
            self.images += timing["images_per_sec"] * timing["step_time_s"] * steps
            self.seconds += timing["step_time_s"] * steps
        step, _, lr = losses[-1]
        if step % self.every == 0 or step == self.total_steps:
            self.say(self.line(step, lr))
            self.losses, self.images, self.seconds = [], 0.0, 0.0

    def line(self, step: int, lr: float) -> str:
        finite = [v for v in self.losses if math.isfinite(v)]
        loss = sum(finite) / len(finite) if finite else float("nan")
        epoch = epochs(step / self.steps_per_epoch)
        speed = f"{self.images / self.seconds:.1f} img/s" if self.seconds else "warming up"
        width = len(str(self.total_steps))
        return (
            f"step {step:>{width}}/{self.total_steps}  epoch {epoch}  loss {loss:.4f}  "
            f"lr {lr:.3e}  {speed}"
        )


def epochs(done: float) -> str:
    """Epochs done, as every line says them (the evaluations' `epoch` too): 0.31, 1.25, 2.

    >>> epochs(10 / 32), epochs(1.25), epochs(2.0)
    ('0.31', '1.25', '2')
    """
    return f"{round(done, 2):g}"


@dataclass
class BestEvaluation:
    """The best evaluation so far by --checkpoint_best's metric (top-1 where none is named)."""

    metric: str = "top1"
    results: dict[str, Any] | None = None

    def offer(self, results: dict[str, Any]) -> bool:
        """Whether `results` are the best so far (the first of equals stays the best)."""
        key, higher, _ = BEST_METRICS[self.metric]
        value = results.get(key)
        if value is None or not math.isfinite(value):
            return False
        if self.results is not None:
            best = self.results[key]
            if (value <= best) if higher else (value >= best):
                return False
        self.results = results
        return True

    def describe(self) -> str:
        """'best top-1 0.4500 (epoch 2, step 20)', or '' before any evaluation."""
        if self.results is None:
            return ""
        key, _, name = BEST_METRICS[self.metric]
        r = self.results
        return f"best {name} {r[key]:.4f} (epoch {epochs(r['epoch'])}, step {r['step']})"


def evaluation_line(results: dict[str, Any], best: BestEvaluation) -> str:
    """One evaluation, with the best so far: its EMA twin's top-1 too where one is kept."""
    ema = f", EMA top-1 {results['eval_acc_ema']:.4f}" if "eval_acc_ema" in results else ""
    return (
        f"epoch {epochs(results['epoch'])}: eval top-1 {results['eval_acc']:.4f}, "
        f"top-5 {results['eval_acc5']:.4f}, loss {results['eval_loss']:.4f}{ema}; "
        f"{best.describe()}"
    )


def closing_block(
    images_per_sec: float, final_loss: float, run_dir: str, best: BestEvaluation,
    checkpoints: list[str],
) -> str:  # fmt: skip
    """The finished run in a few lines: speed and loss, the best evaluation, where it all is."""
    lines = [f"done: {images_per_sec:.1f} img/s, final loss {final_loss:.4f}"]
    if best.results is not None:
        lines.append(best.describe())
    lines.append(f"run folder {run_dir}")
    lines += [f"checkpoint {path}" for path in checkpoints]
    return "\n  ".join(lines)


def on_terminal(main: bool) -> TextIO | None:
    """stderr where the process speaks and stderr is a terminal; else no bar."""
    return sys.stderr if main and sys.stderr.isatty() else None


class Progress:
    """The progress bar on a terminal (none where output goes to a file or a pipe: the
    interval lines say as much there, each a line of its own). Until the first step is done it
    says "compiling"; its estimate of the time left starts after that step, whose compile is
    not a step's time."""

    def __init__(self, backend: str, total: int, start: int, file: TextIO | None):
        """`file`: where the bar is drawn, None for none (use `on_terminal`)."""
        first = "compiling the step" if backend != "eager" else "first step"
        self.backend = backend
        self.bar = tqdm(
            total=total, initial=start, desc=f"{backend} ({first})", dynamic_ncols=True,
            file=file, disable=file is None,
        )  # fmt: skip
        self.first_done = False

    def stepped(self, step: int) -> None:
        if self.first_done:
            self.bar.update(1)
            return
        # The estimate from here: tqdm's rate averages the time between updates, and the
        # first step's (its compile) would dominate it for many steps.
        self.first_done = True
        self.bar.set_description_str(self.backend, refresh=False)
        self.bar.reset(self.bar.total)
        self.bar.n = self.bar.initial = step  # `initial`: the steps the rate does not count
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
