"""Commands as users type them: the seed's own launch lines and the README's quick start verbatim,
jax with loader workers, and a second launch of a jax job that reuses the first one's compiled
step. The installed console script itself runs the first seed command; the others run
`python -m accel.launch_single_task` with the same arguments, environment and working folder."""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, Command, read_summary, run_cli, run_command, train

SCRIPT = Path(sys.executable).with_name("launch_single_task")  # the installed console script
SEED_COMMANDS = [
    ("launch_single_task --amp_level=O1 --batch_size=32 --nproc_per_node=1", {}, "eager", "O1"),
    (
        "USE_ACCEL=1 launch_single_task --nproc_per_node=1 --amp_level=O2 --kernel-opt "
        "--batch_size=32 --nproc_per_node=1",
        {"USE_ACCEL": "1"},
        "xla",  # no CUDA GPU here: the XLA path is torch_xla
        "O2",
    ),
]


def typed(command: str, env: dict, cwd: Path, console_script: bool = False):
    """`command` (`launch_single_task ARGS` after any VAR=value) run in `cwd`, where the default
    --output, runs/, lands; through the installed console script where asked."""
    words = shlex.split(command.split("#")[0])
    args = words[words.index("launch_single_task") + 1 :]
    if not console_script:
        return run_command(Command(args, env, cwd=cwd), timeout=600)
    env = {**os.environ, **env}
    argv = [str(SCRIPT), *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("command", "env", "backend", "level"),
    [pytest.param(*c, marks=[pytest.mark.xla] if c[2] == "xla" else []) for c in SEED_COMMANDS],
)
def test_seed_commands_train_a_default_length(tmp_path, command, env, backend, level):
    result = typed(command, env, tmp_path, console_script=command == SEED_COMMANDS[0][0])
    assert result.returncode == 0, result.stderr[-3000:]
    first_lines = result.stdout.splitlines()[:3]
    assert any("no --steps or --epochs given: training 1 epoch" in line for line in first_lines)
    summary = read_summary(tmp_path / "runs")
    assert (summary["backend"], summary["amp_level"]) == (backend, level)
    # 1024 synthetic images in batches of 32: one epoch is 32 steps.
    assert summary["steps"] == 32 and summary["global_batch_size"] == 32
    assert all(math.isfinite(x) for x in summary["losses"])


def readme_quick_start() -> list[str]:
    """The launch_single_task lines of the README's quick start, as written there (the README's
    other sections, and the examples' commands, are tested where their code is)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if "launch_single_task" in line.split("#")[0]]


QUICK_START = readme_quick_start()


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.xla] if "USE_ACCEL=1" in c else []) for c in QUICK_START],
)
def test_the_readme_quick_start_runs_as_written_and_learns(tmp_path, command):
    words = shlex.split(command.split("#")[0])
    env = dict(a.split("=", 1) for a in words[: words.index("launch_single_task")])
    result = typed(command, env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("accel: backend ")
    assert result.stdout.splitlines()[-1].startswith("accel: ")  # the README's last line
    summary = read_summary(tmp_path / "runs")
    assert summary["eval_acc"] >= 0.5  # the README says about 0.9; chance is 0.1
    # The README's console lines, with summary.json's values: each --log_every (10) steps' mean
    # loss, the evaluation and its best, the closing block.
    said = re.findall(r"step (\d+)/40  epoch [\d.]+  loss ([\d.]+)  lr ", result.stdout)
    losses = summary["losses"]
    assert [(int(s), float(v)) for s, v in said] == [
        (s, round(sum(losses[s - 10 : s]) / 10, 4)) for s in (10, 20, 30, 40)
    ]
    evaluation = f"eval top-1 {summary['eval_acc']:.4f}, top-5 {summary['eval_acc5']:.4f}"
    assert evaluation in result.stdout and f"best top-1 {summary['eval_acc']:.4f}" in result.stdout
    assert f"done: {summary['images_per_sec']:.1f} img/s" in result.stdout


def test_the_quick_start_has_an_eager_and_an_accelerated_command():
    assert len(QUICK_START) == 2 and "USE_ACCEL=1" in QUICK_START[1]


JAX_JOB = ("--backend", "jax", "--steps", "4", "--batch_size", "8", "--no-eval")
JAX_JOB += ("--mixup", "0.8", "--cutmix", "1.0", "--synthetic_length", "64")


def test_jax_with_loader_workers_forks_no_threaded_process(tmp_path):
    result = run_cli(*JAX_JOB, "--workers", "2", "--output", str(tmp_path / "workers"))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "deadlock" not in printed and "os.fork()" not in printed
    without, _ = train(tmp_path / "main", *JAX_JOB, "--workers", "0")  # the reference, here
    assert read_summary(tmp_path / "workers")["losses"] == without["losses"]  # bit for bit


def _first_step_launch(output: Path) -> dict:
    result = run_cli(
        *("--backend", "jax", "--model", "swin_micro", "--steps", "2", "--batch_size", "8"),
        *("--workers", "0", "--no-eval", "--output", str(output)),
        env={"ACCEL_COMPILE_CACHE": ""},  # the default folder, as a user has it: not the suite's
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_summary(output)


def test_second_jax_launch_hits_the_compilation_cache(tmp_path):
    first = _first_step_launch(tmp_path)
    second = _first_step_launch(tmp_path)  # same --output: same cache folder
    assert first["persistent_cache"] and second["persistent_cache"]
    assert first["persistent_cache_hits"] == 0 and second["persistent_cache_hits"] >= 1
    assert any((tmp_path / ".compile_cache" / "jax").iterdir())
