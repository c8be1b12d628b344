"""The suite's own machinery: which tests conftest marks slow, and the commands forked
ready-imported (tests/cli_server.py), and the Python programs they start, behaving as processes
of their own. (The first test names helpers that start processes, so it is slow by the same
rule.)"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.conftest import starts_processes
from tests.helpers import (
    FRESH_RANKS,
    ROOT,
    micro_config,
    run_cli,
    run_module,
    run_script,
    start_cli,
    train,
)


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


SCRIPT = """import os, sys
print(os.getcwd(), os.environ.get("ACCEL_TEST_VALUE"), os.getpid(), sys.argv[1:])
print("torch imported before the script:", "torch" in sys.modules)
sys.exit(3)
"""


@pytest.mark.slow
def test_a_forked_command_has_its_own_folder_environment_arguments_and_exit_code(tmp_path):
    (tmp_path / "probe.py").write_text(SCRIPT)
    done = run_script("probe.py", "a", "b", env={"ACCEL_TEST_VALUE": "x"}, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    first, second = done.stdout.splitlines()
    cwd, value, pid, args = first.split(" ", 3)
    assert (cwd, value, args) == (str(tmp_path), "x", "['a', 'b']")
    assert int(pid) != os.getpid()
    assert second.endswith("True")  # forked from the process that imported it


@pytest.mark.slow
def test_a_variable_read_as_libraries_import_starts_the_command_afresh(tmp_path):
    (tmp_path / "probe.py").write_text(SCRIPT)
    done = run_script("probe.py", env={"HF_HUB_CACHE": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines()[1].endswith("False")  # a new interpreter


@pytest.mark.slow
def test_the_command_line_exits_with_its_code_and_a_killed_one_with_the_signal(tmp_path):
    refused = run_cli("--model", "vit_mcro", "--output", str(tmp_path))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(lines) == 1 and "unknown model 'vit_mcro'" in lines[0]
    running = start_cli("--steps", "100000", "--workers", "0", "--output", str(tmp_path))
    running.send_signal(signal.SIGKILL)
    assert running.wait(timeout=60) == -signal.SIGKILL


def _probe(*args: str, env: dict | None = None) -> dict:
    """tests/probe.py's report, forked ready-imported by the suite's server; it exits 3."""
    done = run_module("tests.probe", *args, env=env)
    assert done.returncode == 3, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_python_program_a_command_starts_is_forked_too_as_a_process_of_its_own():
    parent = _probe("--child", env={"ACCEL_TEST_VALUE": "parent"})
    assert parent["torch_before"] and parent["value"] == "parent"
    child = parent["child"]
    assert parent["child_code"] == 3
    assert child["torch_before"]  # forked from the command, ready-imported
    assert child["pid"] != parent["pid"] and child["value"] == "child"
    assert child["args"] == ["from-child"] and child["cwd"] == str(ROOT)


@pytest.mark.slow
def test_a_command_that_has_run_torchs_threads_starts_its_programs_afresh():
    parent = _probe("--child", "--threads-first")
    assert parent["threads_ran"]
    # Forked, the child would wait for threads it does not have (subprocess.run's timeout).
    assert parent["child_code"] == 3 and not parent["child"]["torch_before"]


@pytest.mark.slow
def test_fresh_ranks_start_a_commands_programs_as_fresh_interpreters():
    parent = _probe("--child", env=FRESH_RANKS)
    assert parent["torch_before"] and not parent["child"]["torch_before"]
