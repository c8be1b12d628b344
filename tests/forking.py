"""Whether a process may be forked: only one that runs no thread but the forking one.

A fork copies the calling thread alone. A lock another thread held at that moment (malloc's,
OpenMP's, a runtime's) stays held in the child, and what that thread was writing stays half
written: POSIX leaves the child's behaviour undefined (a rank forked so can abort in malloc). The
suite forks from its fork server (helpers.fork_processes), which imports only what starts no
thread (tests/rank_server.py); its forked processes and conftest's audit hook refuse any other
fork, naming the threads. Imported by the fork server before anything else: the standard
library only.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

EXIT_UNSAFE_FORK = 70  # a forked process's exit code where its parent ran threads (EX_SOFTWARE)


def thread_names(pid: int | str = "self") -> list[str]:
    """The names of the threads process `pid` runs now (the kernel's, /proc/PID/task/*/comm:
    native threads as well as Python's), in thread-id order; [] where the process is gone."""
    names = []
    try:
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda task: int(task.name))
    except (FileNotFoundError, ProcessLookupError):
        return []
    for task in tasks:
        try:
            names.append((task / "comm").read_text().strip())
        except (FileNotFoundError, ProcessLookupError):  # ended while listed
            continue
    return names


def described(names: list[str]) -> str:
    """Thread names as 'N threads (python, 2 x pt_tcpstore_uv, ...)'.

    >>> described(["python", "gloo", "gloo"])
    '3 threads (python, 2 x gloo)'
    """
    counts = collections.Counter(names)
    parts = [name if n == 1 else f"{n} x {name}" for name, n in counts.items()]
    return f"{len(names)} threads ({', '.join(parts)})"


def python_threads() -> str:
    """This process's Python threads other than the main one, by name (Python's default name
    holds the function the thread runs: 'Thread-1 (serve)'), or ''."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return f"Python threads {', '.join(others)}" if others else ""


def fork_refusal(names: list[str], what: str, cause: str = "") -> str | None:
    """The one line that refuses a fork of `what`, a process running the threads `names`; None
    where it runs one thread (the forking one) and the fork is safe."""
    if len(names) <= 1:
        return None
    why = f": {cause}" if cause else ""
    return (
        f"refusing to fork {what}, which runs {described(names)}{why}; a forked child of a "
        "threaded process can deadlock or corrupt its heap. Fork from the suite's fork server "
        "(tests/helpers.py: fork_processes), whose imports start no thread, or start the "
        "process with spawn"
    )


def check_parent(cause: str = "") -> str | None:
    """In a process just forked: the refusal where its parent (a fork server, which does
    nothing else between forks) runs threads now, and so ran them at the fork."""
    parent = os.getppid()
    return fork_refusal(thread_names(parent), f"pid {parent}", cause)


def own_fork_refusal() -> str | None:
    """The refusal of an os.fork() of this process, where it runs threads."""
    cause = python_threads()
    return fork_refusal(thread_names(), f"this process (pid {os.getpid()})", cause)


if __name__ == "__main__":  # a forked process's view of the fork: the suite's own check of it
    import json
    import sys

    runtimes = ("torch_xla", "jax", "jaxlib", "torchax")
    print(
        json.dumps(
            {
                "parent_threads": thread_names(os.getppid()),
                "runtimes_imported": [name for name in runtimes if name in sys.modules],
            }
        )
    )
