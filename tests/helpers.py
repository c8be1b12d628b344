"""Shared helpers for the test suite."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from accel.config import RunConfig, leaf_fields, replace_path
from accel.data.config import DataConfig
from accel.models.factory import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
# An option by its own name ("shard") or its path ("parallel.shard"); nested configs by theirs.
PATHS = {path.rsplit(".", 1)[-1]: path for path, _, _ in leaf_fields(RunConfig)}
PATHS.update(mixup="data.mixup")


def micro_config(
    tmp_path: Path, backend: str = "eager", model: str = "vit_micro", **overrides
) -> RunConfig:
    """A small, fast, deterministic run as the launcher would settle it (no workers, no eval
    unless asked); `overrides` by option name, e.g. shard="full", lr=1e-2."""
    cfg = RunConfig(
        backend=backend,
        model=ModelConfig(model, num_classes=10),
        data=DataConfig(workers=0, synthetic_length=128),
        batch_size=8,
        steps=5,
        output=str(tmp_path),
        run_name="t",
        eval=False,
        log_every=100,
    )
    for key, value in overrides.items():
        cfg = replace_path(cfg, PATHS.get(key, key), value)
    return cfg


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


def run_python(
    code: str, timeout: int = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -c code` in the project root (with `env` over this process's environment)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_cli_without(package: str, *args: str) -> subprocess.CompletedProcess:
    """launch_single_task in a process where `package` cannot be imported (as if not installed)."""
    code = (
        f"import sys; sys.modules[{package!r}] = None; "
        "from accel.launch_single_task import main; "
        f"sys.exit(main({list(args)!r}))"
    )
    return run_python(code)


def read_summary(output: Path) -> dict:
    found = sorted(Path(output).glob("*/*/*/summary.json"))
    assert found, f"no summary.json under {output}"
    return json.loads(found[-1].read_text())


def flat_tensors(state: dict, prefix: str = "") -> dict:
    """{'model.x': tensor, 'optim.x.exp_avg': tensor, ...} of a nested state."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def checkpoint_tensors(path: Path) -> dict:
    """A checkpoint's model, optimizer and EMA tensors by flattened name; a folder's gathered whole
    with torch.distributed.checkpoint's own converter."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if path.is_dir():
        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(path, Path(scratch) / "whole.pt")
            state = torch.load(Path(scratch) / "whole.pt", weights_only=True)
    else:
        state = torch.load(path, weights_only=True)["state"]
    sections = ("model", "optim", "ema")
    return {k: v for k, v in flat_tensors(state).items() if k.split(".")[0] in sections}


def backend_tensors(backend) -> dict:
    """What a backend would save now, whole, by flattened name."""
    from accel.checkpoint import to_cpu

    return flat_tensors(to_cpu(backend.checkpoint_state()))


def rank_process(launcher: psutil.Process, rank: str) -> psutil.Process | None:
    """The launcher's process of `rank`, once started; children that come and go while it
    looks (the loader's short-lived helpers) are passed over."""
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == rank and "accel.launch_single_task" in " ".join(
                child.cmdline()
            ):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None
