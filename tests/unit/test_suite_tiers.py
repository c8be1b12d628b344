"""The suite's own machinery: which tests conftest marks slow, the guard that fails a fast test
starting one of the project's programs, the commands the suite starts behaving as the processes
they are, and the suite itself naming no private attribute of the libraries it runs on."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import psutil
import pytest

from tests import conftest, forking, helpers
from tests.conftest import starts_ours, starts_processes
from tests.helpers import ROOT, micro_config, run_cli, start_cli, train


def _launches(tmp_path):
    return run_cli("--help")


def _calls_a_launcher(tmp_path):
    return _launches(tmp_path)


def _trains_here(tmp_path):
    return train(tmp_path, "--steps", "1"), micro_config(tmp_path)


def test_a_test_that_starts_a_process_directly_or_through_a_helper_is_slow():
    assert starts_processes(_launches)
    assert starts_processes(_calls_a_launcher)
    assert not starts_processes(_trains_here)


def test_the_projects_own_programs_are_told_from_a_librarys_helpers():
    python = sys.executable
    assert starts_ours([python, "-m", "accel.launch_single_task", "--steps", "1"])
    assert starts_ours([str(Path(python).with_name("launch_single_task")), "--steps", "1"])
    assert starts_ours([python, "-c", "import accel; print(accel)"])
    assert starts_ours([python, "bench/gpu_check.py", "--smoke"])
    assert not starts_ours([python, "-c", "import torch"])  # torch.compile's kernel checks
    assert not starts_ours(["/bin/true"])


def test_a_fast_test_that_starts_the_launcher_fails_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(conftest._Guard, "item", types.SimpleNamespace(nodeid="a fast test"))
    with pytest.raises(pytest.fail.Exception, match=r"a fast test starts a process .* slow"):
        subprocess.Popen([sys.executable, "-m", "accel.launch_single_task", "--help"])
    assert conftest._Guard.item is None  # one refusal; pytest's own work goes on unguarded
    monkeypatch.setattr(conftest._Guard, "item", types.SimpleNamespace(nodeid="a fast test"))
    done = subprocess.run(["/bin/true"], timeout=30)  # a library's own helper: let through
    assert done.returncode == 0


@pytest.mark.slow
def test_the_command_line_exits_with_its_code_and_a_killed_one_with_the_signal(tmp_path):
    refused = run_cli("--model", "vit_mcro", "--output", str(tmp_path))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(lines) == 1 and "unknown model 'vit_mcro'" in lines[0]
    running = start_cli("--steps", "100000", "--workers", "0", "--output", str(tmp_path))
    running.send_signal(signal.SIGKILL)
    assert running.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.slow  # two interpreters, and the 8 s they hang
def test_a_command_that_hangs_fails_with_the_stacks_of_it_and_its_children(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "def parent_waits():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\ndef child_sleeps():\\n"
        "    time.sleep(600)\\nchild_sleeps()'])\n"
        "print('started', flush=True)\n"
        "parent_waits()\n"
    )
    command = helpers.Command([], script=str(script))
    with pytest.raises(AssertionError, match="ran past 8 s") as hung:
        helpers.run_command(command, timeout=8)
    message = str(hung.value)
    assert "started" in message  # its output so far
    assert "in child_sleeps" in message and "in parent_waits" in message  # where each one was
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if "child_sleeps" in " ".join(p.info["cmdline"] or [])
    ]  # nothing left running


# --- no fork of a threaded process ----------------------------------------------------------
@contextlib.contextmanager
def a_thread_running():
    """A Python thread running `waits_for_the_test` while the block runs."""
    started, stop = threading.Event(), threading.Event()

    def waits_for_the_test():
        started.set()
        stop.wait(60)

    thread = threading.Thread(target=waits_for_the_test)
    thread.start()
    started.wait(60)
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_fork_of_a_suite_process_running_threads_is_refused_naming_them():
    with a_thread_running(), pytest.raises(RuntimeError, match=r"refusing to fork") as no:
        if os.fork() == 0:  # the audit hook let it through: the copy ends at once
            os.kill(os.getpid(), signal.SIGKILL)
    assert "this process" in str(no.value) and "threads" in str(no.value)
    assert "waits_for_the_test" in str(no.value)  # the Python thread, by its function


THREADS_SEEN = """
import json, threading, time
from tests.forking import thread_names
stop = threading.Event()
thread = threading.Thread(target=stop.wait)
before = thread_names()
thread.start()
during = thread_names()
stop.set()
thread.join()
# join() returns once the thread's Python code is done; the kernel may list its task a moment
# longer (seen on a loaded machine), so the count is read again until it drops, for up to 5 s.
deadline = time.monotonic() + 5
after = thread_names()
while after != before and time.monotonic() < deadline:
    time.sleep(0.01)
    after = thread_names()
print(json.dumps([before, during, after]))
"""


def test_the_threads_of_a_process_are_read_from_the_kernel():
    # In a fresh interpreter of the standard library alone: the suite's own process runs
    # runtimes' pools whose threads start and end as they please.
    done = subprocess.run(
        [sys.executable, "-c", THREADS_SEEN], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    before, during, after = json.loads(done.stdout)
    assert before == after == ["python"] and during == ["python", "python"]
    assert forking.fork_refusal(["python"], "x") is None
    assert "runs 2 threads (python, gloo)" in str(forking.fork_refusal(["python", "gloo"], "x"))


@pytest.mark.slow
def test_the_ranks_fork_server_runs_one_thread_and_no_runtime():
    """What a process forked from the server sees of it: one thread (so the fork was safe),
    and neither torch_xla nor JAX imported (each forked run starts its own)."""
    done = helpers.fork_module("tests.forking")
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen == {"parent_threads": ["python"], "runtimes_imported": []}


@pytest.mark.slow
def test_a_process_forked_from_a_threaded_one_refuses_to_run():
    """The check a forked process makes of its parent, in a process whose parent (this test's,
    running threads) would be unsafe to fork from."""
    code = "from tests.forking import check_parent; print(check_parent())"
    with a_thread_running():
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    assert f"refusing to fork pid {os.getpid()}, which runs" in result.stdout, result.stderr


# --- no private names ---------------------------------------------------------------------
# The libraries whose `_`-prefixed names the suite must not use: an upgrade may change them
# without notice. (tests/unit/test_compat.py names torch's private modules that accel's own
# compatibility shims patch: checking those shims is its point.)
GUARDED = set(sys.stdlib_module_names) | {"torch_xla", "jax", "jaxlib", "pytest"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _guarded(module: str) -> bool:
    return module.split(".")[0] in GUARDED


def _imports(tree: ast.AST) -> tuple[dict[str, str], set[str]]:
    """The dotted path each name an import binds stands for, and the private paths imported."""
    bound, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
                paths = [alias.name]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            paths = [f"{node.module}.{alias.name}" for alias in node.names]
            bound.update({a.asname or a.name: p for a, p in zip(node.names, paths, strict=True)})
        else:
            continue
        found |= {p for p in paths if _guarded(p) and any(map(_private, p.split(".")))}
    return bound, found


def _reached(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The dotted path an attribute chain or getattr(name, "literal") reaches from a bound name."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
        target, name = [*node.args, None, None][:2]
        if isinstance(target, ast.Name) and isinstance(name, ast.Constant):
            return f"{bound[target.id]}.{name.value}" if target.id in bound else None
        return None
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if chain and isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(chain)])
    return None


def private_names(source: str) -> set[str]:
    """The private attributes of GUARDED libraries `source` names: `module._name` through any
    name its imports bind, `from module import _name`, `import module._private`, and
    getattr(module, "_name")."""
    tree = ast.parse(source)
    bound, found = _imports(tree)
    for node in ast.walk(tree):
        path = _reached(node, bound)
        if path and _guarded(path) and any(map(_private, path.split("."))):
            found.add(path)
    return found


def _private_spelled(text: str) -> str:
    """`text` with each `$` as the `_` of a private name: spelled so, the names the check must
    find are in no file for a grep over tests/ to find."""
    return text.replace("$", "_")


def test_the_check_finds_private_names_however_they_are_reached():
    source = _private_spelled("""
import atexit, subprocess
import torch_xla as tx
import multiprocessing.process
from torch_xla import $XLAC
from jax.$src import core
import jax
atexit.$clear()
subprocess.Popen.$execute_child
tx.$XLAC.$get_xla_sharding_spec
multiprocessing.process.BaseProcess.$start_method
getattr(jax, "$src")
""")
    expected = {
        "torch_xla.$XLAC",
        "jax.$src.core",
        "atexit.$clear",
        "subprocess.Popen.$execute_child",
        "torch_xla.$XLAC.$get_xla_sharding_spec",
        "multiprocessing.process.BaseProcess.$start_method",
        "jax.$src",
    }
    assert private_names(source) == {_private_spelled(name) for name in expected}
    public = "from __future__ import annotations\nimport os\nos.environ.__class__\nx._y\n"
    assert private_names(public) == set()


def test_the_suite_names_no_private_attribute_of_python_torch_xla_or_jax():
    found = {
        str(path.relative_to(ROOT)): names
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (names := private_names(path.read_text()))
    }
    assert found == {}


@pytest.mark.parametrize(
    ("markexpr", "cuda", "platform"),
    [
        ("gpu", True, None),  # the GPU tier alone, a GPU visible: JAX takes it
        ("gpu and not slow", True, None),
        ("gpu", False, "cpu"),  # no GPU: the tier skips; JAX stays on the CPU
        ("", True, "cpu"),  # the whole suite: the CPU tiers need JAX on the CPU
        ("not slow and not gpu", True, "cpu"),
        ("gpu or slow", True, "cpu"),
        ("not gpu", True, "cpu"),
    ],
)
def test_jax_takes_the_gpu_in_a_gpu_tier_run_where_one_is_visible(markexpr, cuda, platform):
    assert helpers.jax_platform_default(markexpr, cuda) == platform


def test_the_gpu_tiers_jax_tests_come_last():
    class Item:
        def __init__(self, name: str, gpu: bool):
            self.name, self.keywords = name, {"gpu": True} if gpu else {}

        def get_closest_marker(self, name):
            return None

    items = [
        Item("test_jax_on_gpu", True),
        Item("test_eager_on_gpu", True),
        Item("test_jax", False),
    ]
    names = [i.name for i in sorted(items, key=conftest.gpu_jax_last)]
    assert names == ["test_eager_on_gpu", "test_jax", "test_jax_on_gpu"]


def test_a_worker_runs_a_files_tests_the_shared_runs_readers_and_the_unit_tests_together():
    """make test's two xdist workers each take whole groups (conftest.worker_group): a file's
    tests (its module fixtures made once), every file that reads tests/shared_runs.py's runs
    (made once), and the unit tests."""
    readers = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests" / "integration").glob("test_*.py")
        if any(name in path.read_text() for name in conftest.SHARED_RUNS)
    }
    assert {
        "tests/integration/test_sharded.py",
        "tests/integration/test_multi_device.py",
    } <= readers
    for path in readers:
        assert conftest.worker_group(f"{path}::test_x[a-b]") == "shared_runs"
    hybrid = "tests/integration/test_hybrid_parallel.py"
    assert conftest.worker_group(f"{hybrid}::test_each[tp2xdp2]") == hybrid
    assert conftest.worker_group(f"{hybrid}::test_each[fsdp2xtp2]") == hybrid
    assert conftest.worker_group("tests/unit/test_data.py::test_x") == "tests/unit"
    assert conftest.worker_group("tests/unit/test_amp.py::test_y[O1]") == "tests/unit"


def test_the_longest_groups_start_first_in_make_tests_order():
    """Each worker starts with LONGEST_FIRST's groups, in its order, then the rest as collected;
    every name there is still a group (a renamed file would lose its place in silence), and make
    test keeps this order (xdist's own reordering off)."""
    for group in conftest.LONGEST_FIRST:
        assert group == "shared_runs" or (ROOT / group).exists(), group

    class Item:
        def __init__(self, nodeid: str):
            self.nodeid = nodeid

    ids = [f"tests/{name}.py::t" for name in ("integration/test_nan_policy", "unit/test_data",
           "integration/test_faults", "integration/test_resume", "integration/test_sharded",
           "integration/test_examples")]  # fmt: skip
    ordered = [i.nodeid for i in sorted(map(Item, ids), key=conftest.start_order)]
    # test_sharded reads the shared runs; test_nan_policy's group is short: it fills in last
    assert ordered == [ids[5], ids[4], ids[3], ids[1], ids[2], ids[0]]
    assert "--no-loadscope-reorder" in (ROOT / "Makefile").read_text()


def test_each_process_of_make_tests_workers_keeps_one_intra_op_thread():
    """Under make test's pytest-xdist workers, conftest sets OMP_NUM_THREADS (1, unless the
    environment says otherwise) before torch's import, for the worker and every command it starts
    (which inherit it): the suite's processes fill the cores, and a second thread in each would
    only wait for one. Set too late, it would leave torch its default, a thread a core."""
    import torch

    if conftest.WORKER:
        assert "OMP_NUM_THREADS" in os.environ and "TORCHINDUCTOR_COMPILE_THREADS" in os.environ
    if "OMP_NUM_THREADS" in os.environ:
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
