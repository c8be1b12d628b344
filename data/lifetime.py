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


def exit_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (a no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)


def worker_init(_worker_id: int) -> None:
    """DataLoader worker_init_fn: a worker ends with the process that forked it."""
    exit_with_parent()
