"""Processes that never outlive the one that started them.

The kernel sends a signal to a process whose parent dies once the process asked for it (Linux
prctl PR_SET_PDEATHSIG). Each link of a chain asks: a trainer's loader fork server (its preload,
data/forkserver_preload.py), the fork server's workers (worker_init_fn), a launcher's ranks.
Then a SIGKILL or an out-of-memory kill of the trainer takes all of them with it; a pipe the
children would poll, or a check of the parent's pid, would leave them running until they next
looked, and the workers are the fork server's children, not the trainer's.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


PARENT = "ACCEL_FORKSERVER_PARENT"  # the pid a loader fork server must find as its parent


def exit_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent dies (a no-op off Linux). A
    parent that died before the request was in place is found by its pid, where it is known,
    or by the process having been handed to init."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    now = os.getppid()
    if now == 1 or (parent is not None and now != parent):
        os.kill(os.getpid(), sig)


def worker_init(_worker_id: int) -> None:
    """DataLoader worker_init_fn: a worker ends with the process that forked it."""
    exit_with_parent()
