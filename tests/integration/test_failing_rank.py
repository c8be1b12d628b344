"""A rank that dies or raises takes the whole job down quickly, named, without a hang (gloo on
CPU)."""

import re
import signal
import time

import psutil
import pytest

from accel.cli.data.prepare import prepare_mock_imagenet
from tests.helpers import rank_process, run_cli, start_cli

pytestmark = pytest.mark.slow  # ranks in processes


def test_killing_one_rank_ends_the_job_naming_it(tmp_path):
    proc = start_cli(
        "--nproc_per_node",
        "2",
        "--steps",
        "100000",
        "--batch_size",
        "8",
        "--workers",
        "0",
        "--no-eval",
        "--log_every",
        "1",
        "--output",
        str(tmp_path),
    )
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("**/metrics.rank1.jsonl")) or rank_process(launcher, "1") is None:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # well inside training
    rank_process(launcher, "1").send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)  # it ends, without a hang
    assert proc.returncode != 0
    assert "training failed on rank 1" in stderr


def test_a_rank_raising_ends_the_job_naming_it(tmp_path):
    """--strict-data: the rank whose shard holds an unreadable file raises; the other one is
    left waiting in an all-reduce that will never complete."""
    root = prepare_mock_imagenet(
        tmp_path / "imagenet", classes=2, per_class=16, val_per_class=1, size=40, progress=False
    )
    bad = next((root / "train").iterdir()) / "truncated.jpg"
    good = next(bad.parent.glob("*.JPEG")).read_bytes()
    bad.write_bytes(good[: len(good) // 2])
    result = run_cli(
        "--nproc_per_node",
        "2",
        "--data",
        str(root),
        "--strict-data",
        "--epochs",
        "4",
        "--batch_size",
        "4",
        "--workers",
        "0",
        "--no-eval",
        "--output",
        str(tmp_path / "runs"),
        timeout=120,  # it ends, without a hang
    )
    assert result.returncode == 2  # the rank's own exit code: a user error
    raised = re.search(r"error \(rank (\d)\): unreadable image (\S+):", result.stderr)
    assert raised and raised.group(2) == str(bad)
    assert f"training failed on rank {raised.group(1)} (exit 2)" in result.stderr
