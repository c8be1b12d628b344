"""One run, one folder: a run holds an OS lock (flock) on its folder for its whole life, so a
second run into the same folder stops at once instead of mixing its files with the first's. The
OS drops the lock when the holder exits in any way, SIGKILL included: a dead run never blocks."""

from __future__ import annotations

import fcntl
import os
from datetime import datetime
from pathlib import Path

from accel.config import AccelError

LOCK = ".lock"


class RunInUse(AccelError):
    """Another live run writes into this folder: one line, exit 2."""


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid else "another process"


class RunLock:
    """An exclusive lock on `run_dir`, held until release() or the process ends."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RunInUse(
                f"run folder {run_dir} is in use by {_holder(self.path)}: give another "
                "--run_name, or wait for that run to end"
            ) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = -1


def in_use(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock (None: no live run does), without taking it."""
    path = run_dir / LOCK
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(path)
    finally:
        os.close(fd)  # drops the shared lock taken to test
    return None


def check_free(run_dir: Path) -> None:
    holder = in_use(run_dir)
    if holder:
        raise RunInUse(
            f"run folder {run_dir} is in use by {holder}: give another --run_name, or wait "
            "for that run to end"
        )


def latest_resumable(parent: Path) -> Path | None:
    """The newest run folder under `parent` that has a checkpoint and no live run."""
    if not parent.is_dir():
        return None
    runs = [
        p
        for p in parent.iterdir()
        if p.is_dir() and any((p / "checkpoints").glob("step_*")) and in_use(p) is None
    ]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def new_run_name() -> str:
    return datetime.now().strftime("run-%Y%m%d-%H%M%S-%f")
