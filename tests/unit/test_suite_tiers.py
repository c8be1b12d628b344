"""The suite's own machinery: which tests conftest marks slow, and the commands forked
ready-imported (tests/cli_server.py) behaving as processes of their own. (The first test names
helpers that start processes, so it is slow by the same rule.)"""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import starts_processes
from tests.helpers import micro_config, run_cli, run_script, start_cli, train


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
