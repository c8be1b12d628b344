"""Synthetic data can be learned: validation draws the training set's class colours with its own
noise, so a short run's validation top-1 is far above chance (0.1 for 10 classes) on every
backend. Runs in-process, as a user's `launch_single_task` would."""

from __future__ import annotations

import pytest

from accel.cli.launch import main
from tests.helpers import read_summary

CHANCE = 0.1  # 10 synthetic classes


@pytest.mark.slow  # three 40-step runs: the full suite
@pytest.mark.parametrize("backend", ["eager", pytest.param("xla", marks=pytest.mark.xla), "jax"])
def test_a_short_synthetic_run_learns_what_validation_asks(tmp_path, backend):
    argv = ["--backend", backend, "--model", "vit_micro", "--data", "synthetic"]
    argv += ["--batch_size", "32", "--steps", "40", "--workers", "0", "--output", str(tmp_path)]
    assert main(argv) == 0
    summary = read_summary(tmp_path)
    assert summary["eval_acc"] >= 0.5, f"top-1 {summary['eval_acc']} (chance: {CHANCE})"
