"""What a run shows while it trains (accel/cli/console.py): the interval lines' means and speed,
the best evaluation, and a progress bar whose estimate leaves the first step's compile out."""

from __future__ import annotations

import io
import time

import pytest

from accel.cli.console import BestEvaluation, IntervalLines, Progress, evaluation_line


def test_an_interval_line_says_the_mean_loss_since_the_last_line_and_the_steady_speed():
    said: list[str] = []
    lines = IntervalLines(said.append, every=4, total_steps=10, steps_per_epoch=4)
    timing = {"images_per_sec": 100.0, "step_time_s": 0.08}  # 8 images a step
    lines.fetched([(1, 9.0, 1e-3)], {"images_per_sec": 1.0, "step_time_s": 8.0}, warming=True)
    lines.fetched([(2, 1.0, 1e-3), (3, 2.0, 1e-3), (4, 3.0, 5e-4)], timing, warming=False)
    assert said == ["step  4/10  epoch 1  loss 3.7500  lr 5.000e-04  100.0 img/s"]
    lines.fetched([(5, 1.0, 4e-4)], {"images_per_sec": 50.0, "step_time_s": 0.16}, False)
    lines.fetched([(6, 2.0, 3e-4), (7, 3.0, 2e-4), (8, float("nan"), 1e-4)], timing, False)
    # (8 images x 4 steps) over (0.16 + 3 x 0.08) s; a non-finite loss left out of the mean
    assert said[1] == "step  8/10  epoch 2  loss 2.0000  lr 1.000e-04  80.0 img/s"
    lines.fetched([(9, 1.0, 1e-5), (10, 1.0, 0.0)], timing, False)  # the last step: a line
    assert said[2].startswith("step 10/10  epoch 2.5  loss 1.0000")  # epochs done


def test_only_warm_up_steps_said_say_so_instead_of_a_speed():
    said: list[str] = []
    lines = IntervalLines(said.append, every=1, total_steps=3, steps_per_epoch=3)
    lines.fetched([(1, 2.0, 1e-3)], {"images_per_sec": 1.0, "step_time_s": 9.0}, warming=True)
    assert said == ["step 1/3  epoch 0.33  loss 2.0000  lr 1.000e-03  warming up"]


@pytest.mark.parametrize(
    ("metric", "values", "better"),
    [
        ("top1", [0.5, 0.7, 0.7, 0.6], [True, True, False, False]),  # the first of equals
        ("loss", [1.0, 0.8, 0.9, 0.8], [True, True, False, False]),  # lower is better
        ("top5", [0.9, 0.9, 1.0, 1.0], [True, False, True, False]),
    ],
)
def test_the_best_evaluation_is_the_first_of_the_best_by_its_metric(metric, values, better):
    key = {"top1": "eval_acc", "top5": "eval_acc5", "loss": "eval_loss"}[metric]
    best = BestEvaluation(metric)
    offered = []
    for step, value in enumerate(values, start=1):
        results = {"eval_acc": 0.1, "eval_acc5": 0.2, "eval_loss": 3.0, key: value}
        offered.append(best.offer({**results, "epoch": step, "step": step}))
    assert offered == better
    best_step = max(i for i, b in enumerate(better, start=1) if b)
    assert best.describe().endswith(f"(epoch {best_step}, step {best_step})")


def test_an_evaluation_line_holds_top1_top5_loss_and_the_best():
    best = BestEvaluation("top1")
    first = {"epoch": 1.0, "step": 4, "eval_acc": 0.25, "eval_acc5": 0.75, "eval_loss": 1.5}
    best.offer(first)
    second = {**first, "epoch": 2.0, "step": 8, "eval_acc": 0.125, "eval_acc_ema": 0.5}
    best.offer(second)
    assert evaluation_line(second, best) == (
        "epoch 2: eval top-1 0.1250, top-5 0.7500, loss 1.5000, EMA top-1 0.5000; "
        "best top-1 0.2500 (epoch 1, step 4)"
    )


def test_the_bar_says_compiling_and_its_estimate_starts_after_the_first_step():
    """tqdm's rate averages the time between updates: counted from the bar's start, the first
    step's compile (here 0.6 s against 0.01 s steps) would dominate the time left."""
    screen = io.StringIO()
    progress = Progress("xla", total=20, start=0, file=screen)
    progress.bar.mininterval = 0  # every update drawn
    time.sleep(0.6)  # the first step's compile
    assert "xla (compiling the step)" in screen.getvalue()
    progress.stepped(1)
    for step in range(2, 6):
        time.sleep(0.01)
        progress.stepped(step)
    shown = progress.bar.format_dict
    assert shown["n"] == 5 and shown["initial"] == 1  # the rate counts steps 2 to 5
    assert shown["elapsed"] < 0.5  # from the first step's end
    assert "xla:" in screen.getvalue().rsplit("\r", 1)[-1]  # "compiling" no longer said
    progress.close()


def test_no_bar_where_there_is_no_terminal():
    progress = Progress("eager", total=3, start=0, file=None)
    progress.stepped(1)
    assert progress.bar.disable
    progress.close()
