"""Faults a user meets: a crafted checkpoint never runs its code, two runs never share a folder,
a killed run leaves no process behind, a full disk is one line that says what was kept."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers import (
    Launched,
    launch,
    rank_process,
    read_summary,
    start_cli,
    train,
)

JOB = ("--steps", "6", "--batch_size", "8", "--workers", "0", "--no-eval", "--log_every", "1")


class Payload:
    """What a crafted file holds: unpickling it creates `marker` (a stand-in for any code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _one_line(result: Launched, *needles: str) -> str:
    """The one error line of a run that stopped with exit 2."""
    code, _, stderr = result
    assert code == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A finished run whose checkpoint folder the crafted files are planted in."""
    out = tmp_path_factory.mktemp("saved")
    train(out, *JOB, "--steps", "2", "--save_every", "1")
    return out


def test_a_crafted_checkpoint_never_runs_its_code(saved_run, tmp_path):
    marker = tmp_path / "code-ran"
    crafted = tmp_path / "step_00000009.pt"
    torch.save({"format": "accel-checkpoint-2", "meta": Payload(marker)}, crafted)
    result = launch(*JOB, "--output", str(tmp_path / "a"), "--resume", str(crafted))
    _one_line(result, str(crafted), "Python objects")
    # Planted where --resume auto looks: the newest checkpoint of the run.
    checkpoints = saved_run / "vit_micro" / "eager" / "r" / "checkpoints"
    shutil.copy(crafted, checkpoints / crafted.name)
    result = launch(*JOB, "--output", str(saved_run), "--run_name", "r", "--resume", "auto")
    _one_line(result, "step_00000009.pt", "Python objects")
    assert not marker.exists()


def test_a_crafted_checkpoint_folder_never_runs_its_code(saved_run, tmp_path):
    marker = tmp_path / "code-ran"
    folder = tmp_path / "step_00000001.dcp"
    folder.mkdir()
    torch.save(Payload(marker), folder / "meta.pt")
    result = launch(*JOB, "--output", str(tmp_path / "a"), "--resume", str(folder))
    _one_line(result, "meta.pt", "Python objects")
    # Its own meta.pt, but an index (DCP's pickled .metadata) that runs code.
    original = saved_run / "vit_micro" / "eager" / "r" / "checkpoints" / "step_00000002.pt"
    saved = torch.load(original, weights_only=True)
    torch.save({"format": saved["format"], "meta": saved["meta"]}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    result = launch(*JOB, "--output", str(tmp_path / "b"), "--resume", str(folder))
    _one_line(result, "refused")
    assert not marker.exists()


def test_a_second_run_into_a_folder_in_use_stops_and_the_first_is_untouched(tmp_path):
    job = (*JOB, "--steps", "20", "--log_every", "5", "--save_every", "10", "--run_name", "r")
    lone = launch(*job, "--output", str(tmp_path / "lone"))
    assert lone.returncode == 0, lone.stderr[-2000:]
    first = start_cli(*job, "--output", str(tmp_path / "shared"))
    lock = tmp_path / "shared" / "vit_micro" / "eager" / "r" / ".lock"
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text().strip()):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    # The first run is paused (SIGSTOP, as Ctrl-Z pauses a run, which keeps its folder) while
    # the second starts: it cannot finish first however slow the machine, and it must go on
    # untouched once it continues.
    first.send_signal(signal.SIGSTOP)
    try:
        assert first.poll() is None, "the first run ended before the second started"
        second = launch(*job, "--output", str(tmp_path / "shared"))  # refused before any work
    finally:
        first.send_signal(signal.SIGCONT)
    _one_line(second, "in use by pid", str(first.pid))
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-2000:]
    assert read_summary(tmp_path / "shared")["losses"] == read_summary(tmp_path / "lone")["losses"]


def _tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def _alive(processes: list[psutil.Process]) -> list[str]:
    out = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            continue
    return out


def _wait_for_workers(proc: subprocess.Popen, root: int, count: int) -> list[psutil.Process]:
    deadline = time.monotonic() + 180
    while len(_tree(root)) < count + 1:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the loader workers never started"
        time.sleep(0.2)
    time.sleep(1.0)  # well inside training
    return _tree(root)


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_sigkill_of_a_run_leaves_no_process_behind(tmp_path, backend):
    proc = start_cli(
        *("--backend", backend, "--steps", "100000", "--batch_size", "8", "--workers", "2"),
        *("--no-eval", "--log_every", "1", "--output", str(tmp_path)),
    )
    # The trainer, the fork server, two workers (and the resource tracker).
    tree = _wait_for_workers(proc, proc.pid, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(tree) == []


def test_sigkill_of_one_rank_leaves_none_of_its_processes(tmp_path):
    proc = start_cli(
        *("--nproc_per_node", "2", "--steps", "100000", "--batch_size", "8", "--workers", "2"),
        *("--no-eval", "--log_every", "1", "--output", str(tmp_path)),
    )
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 180
    rank = None
    while rank is None or len(_tree(rank.pid)) < 4:
        assert proc.poll() is None and time.monotonic() < deadline
        rank = rank_process(launcher, "1")
        time.sleep(0.2)
    tree = _tree(rank.pid)
    rank.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(tree) == []
    proc.communicate(timeout=120)
    assert proc.returncode != 0


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def test_a_full_disk_is_one_line_naming_the_path_and_what_was_kept(tmp_path):
    disk = tmp_path / "disk"
    if os.geteuid() != 0 or not _tmpfs(disk, "6M"):
        pytest.skip("a small tmpfs cannot be mounted here (needs root)")
    try:
        job = ("--steps", "40", "--save_every", "1", "--keep_checkpoints", "0")
        result = launch(*JOB, *job, "--output", str(disk), "--run_name", "r")
        line = _one_line(result, str(disk))
        assert "kept" in line and ("No space left" in line or "write failed" in line), line
        kept = sorted((disk / "vit_micro" / "eager" / "r" / "checkpoints").glob("step_*.pt"))
        assert kept and str(kept[-1]) in line
        assert torch.load(kept[-1], weights_only=True)["format"] == "accel-checkpoint-2"
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
