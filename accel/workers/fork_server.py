"""DataLoader workers forked from a fork server that has already imported what they need.

A worker that a fork server forks needs torch and the script that runs (a dataset or collate
function defined there is pickled by reference). Where the server has not imported them, every
worker of every pass imports them itself: seconds a pass on a small machine. multiprocessing's
own preloading of `__main__` does nothing before Python 3.13.8 (CPython gh-126631: the script's
path never reached the server), so workers/forkserver_main.py imports the script there, as each
worker would. Only a script that keeps its work under `if __name__ == "__main__":` is imported:
any other would run whole in the server, as it would in each worker (`workers_problem` says so
before any worker starts).
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import forkserver, spawn
from pathlib import Path

from torch.utils.data import DataLoader

from accel.workers.lifetime import PARENT

MAIN = "ACCEL_FORKSERVER_MAIN"  # the script the fork server imports, and how (JSON)

importing_main = False  # True in a fork server while it imports the script (forkserver_main)


@dataclass(frozen=True)
class ForkServerUse:
    """What `use_fork_server` changed in this process, put back by `undo`: the start method,
    the fork server's preload list and the two variables its preload reads."""

    environ: dict[str, str | None]

    def undo(self) -> None:
        """Python's default start method again (the next pool or DataLoader chooses it), the
        fork server's default preload (multiprocessing's own: `__main__`) and the variables as
        they were. A fork server already started ends with this process, as Python's does."""
        multiprocessing.set_start_method(None, force=True)
        multiprocessing.set_forkserver_preload(["__main__"])
        for name, value in self.environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def use_fork_server() -> ForkServerUse | None:
    """DataLoader workers started from a fork server that imports torch and the script once
    (`preload`), where the process has not chosen a start method itself; what it changed, for
    `undo`, or None where it changed nothing."""
    if multiprocessing.get_start_method(allow_none=True) is not None:
        return None
    before = {name: os.environ.get(name) for name in (MAIN, PARENT)}
    multiprocessing.set_start_method("forkserver")
    preload()
    return ForkServerUse(before)


def worker_context(*modules: str) -> multiprocessing.context.BaseContext:
    """A start method for a DataLoader's workers (its `multiprocessing_context=`), whatever the
    process's own: a fork server that has imported torch, `modules` (where the dataset and the
    collate function live) and the script (`preload`), so that no worker imports them again
    and none is forked from a process running a runtime's threads (JAX's, torch_xla's). The
    server is started here, by the calling thread (the kernel signals a server's end to its
    children when the thread that started it ends: call this from the main thread), and ends
    with this process.

    >>> worker_context("json").get_start_method()
    'forkserver'
    """
    context = multiprocessing.get_context("forkserver")
    preload(*modules)
    forkserver.ensure_running()
    return context


def preload(*modules: str) -> None:
    """Have the fork server import, before it forks any worker: workers/lifetime.py's preload first
    (the server then ends with this process), torch, `modules`, then the script that runs where
    its work is under its main guard. One fork server serves the whole process, and reads the
    list as it starts: the first start after this call takes it."""
    names = ["accel.workers.forkserver_preload", "torch", *modules]
    script = main_script()
    if script is not None and guarded(script["file"]):
        os.environ[MAIN] = json.dumps(script)
        names.append("accel.workers.forkserver_main")
    else:
        os.environ.pop(MAIN, None)
    multiprocessing.set_forkserver_preload(names)
    os.environ[PARENT] = str(os.getpid())


def main_script() -> dict | None:
    """How a worker imports this process's script (multiprocessing.spawn's preparation data:
    the script's path or, under `python -m`, its module name, with sys.path and sys.argv) and
    its file; None where workers import none (an interactive session, a notebook, a package's
    __main__)."""
    path = getattr(sys.modules["__main__"], "__file__", None)
    if path is None:
        return None
    try:
        data = spawn.get_preparation_data("worker")
    except RuntimeError:  # this process is itself still importing its script
        return None
    name = data.get("init_main_from_name")
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None  # spawn's workers do not import these again
    if name is None and "init_main_from_path" not in data:
        return None
    keep = ("init_main_from_name", "init_main_from_path", "sys_path", "sys_argv")
    return {"file": os.path.abspath(path), **{key: data[key] for key in keep if key in data}}


def guarded(path: str) -> bool | None:
    """Whether the script at `path` has a top-level `if __name__ == "__main__":` (None where its
    source cannot be read or parsed)."""
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    return any(isinstance(node, ast.If) and is_main_test(node.test) for node in tree.body)


def is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    name, main = ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))
    return isinstance(test.ops[0], ast.Eq) and sides == {name, main}


def start_method(loader: DataLoader) -> str | None:
    """How `loader` starts its workers (None where it has none)."""
    if loader.num_workers == 0:
        return None
    context = loader.multiprocessing_context  # a context, or None: the process's start method
    if context is not None:
        return context.get_start_method()
    # Read without fixing the process's start method: the first one listed is the default.
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or multiprocessing.get_all_start_methods()[0]


def workers_problem(batches: Iterable) -> str | None:
    """Before `batches` (a DataLoader, say) is first iterated, perhaps by another thread: what
    stops its workers, in a line (a script without a main guard, which each worker would run
    again), or None, its fork server then started here (a server that preloads
    workers/lifetime.py ends with the thread that started it, and a short-lived one that
    prefetches would leave each pass a new server to start)."""
    if not isinstance(batches, DataLoader):
        return None
    method = start_method(batches)
    if method not in ("forkserver", "spawn"):
        return None
    script = main_script()
    if script is not None and guarded(script["file"]) is False:
        guard = 'if __name__ == "__main__":'
        return (
            f"{Path(script['file']).name} has no `{guard}`: its DataLoader's workers start by "
            f"{method} and each imports the script, which runs it again; put the script's work "
            "under that guard (or give the DataLoader num_workers=0)"
        )
    if method == "forkserver":
        forkserver.ensure_running()
    return None
