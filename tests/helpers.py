"""Shared helpers for the test suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from accel.config import OptimConfig, RunConfig
from data.collate import MixupConfig
from data.loaders import DataConfig
from models.factory import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def micro_config(
    tmp_path: Path, backend: str = "eager", model: str = "vit_micro", **overrides
) -> RunConfig:
    """A small, fast, deterministic run (no workers, no eval unless asked)."""
    mixup = overrides.pop("mixup", MixupConfig())
    data = DataConfig(
        source=overrides.pop("source", "synthetic"),
        workers=0,
        synthetic_length=overrides.pop("synthetic_length", 128),
        mixup=mixup,
        strict=overrides.pop("strict", False),
    )
    optim = OptimConfig(**overrides.pop("optim", {}))
    defaults = dict(
        backend=backend,
        model=ModelConfig(model),
        data=data,
        optim=optim,
        batch_size=8,
        steps=5,
        output=str(tmp_path),
        run_name="t",
        eval=False,
        log_every=100,
    )
    defaults.update(overrides)
    return RunConfig(**defaults)


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "accel.launch_single_task", *args]


def start_cli(*args: str) -> subprocess.Popen:
    """launch_single_task in the background, to signal or kill it while it trains."""
    return subprocess.Popen(
        cli_command(*args),
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        cli_command(*args),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full_env,
        timeout=timeout,
    )


def train_cli(output: Path, *args: str, env: dict | None = None) -> tuple[dict, str]:
    """A launch_single_task run named 'r' that must succeed: its summary.json and stdout."""
    result = run_cli(*args, "--output", str(output), "--run_name", "r", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_summary(output), result.stdout


def run_cli_without(package: str, *args: str) -> subprocess.CompletedProcess:
    """launch_single_task in a process where `package` cannot be imported (as if not installed)."""
    code = (
        f"import sys; sys.modules[{package!r}] = None; "
        "from accel.launch_single_task import main; "
        f"sys.exit(main({list(args)!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def read_summary(output: Path) -> dict:
    found = sorted(Path(output).glob("*/*/*/summary.json"))
    assert found, f"no summary.json under {output}"
    return json.loads(found[-1].read_text())
