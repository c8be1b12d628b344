"""A user's DataLoader with workers on jax, where they start from a fork server: the server has
imported torch and the script before it forks them, so no worker imports them again, pass after
pass; a script without a main guard is told, in one line, what to add."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_script

SCRIPT = """
import json
import os
import sys

IMPORTED_IN = os.getpid()  # the process that ran this script's imports

import torch
from torch.utils.data import DataLoader, TensorDataset

import accel


def report(worker_id):
    main = sys.modules["__main__"]
    seen = {
        "worker": os.getpid(),
        "parent": os.getppid(),
        "script_imported_in": main.IMPORTED_IN,
        "jax": "jax" in sys.modules,
    }
    print("worker " + json.dumps(seen), flush=True)


def main():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = accel.prepare(model, optimizer, lambda m, batch: m(batch[0]).sum(), quiet=True)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), 8, num_workers=2, worker_init_fn=report)
    for _ in range(2):  # each pass starts its workers afresh
        for (x,) in engine.loader(data):
            engine.step(x)
    print("trainer " + json.dumps(os.getpid()), flush=True)
"""


def lines(stdout: str, kind: str) -> list:
    """What the script printed after `kind` on each line that starts with it."""
    found = [line for line in stdout.splitlines() if line.startswith(kind + " ")]
    return [json.loads(line.split(" ", 1)[1]) for line in found]


@pytest.mark.jax
def test_jax_loader_workers_start_from_a_server_that_imported_torch_and_the_script(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT + '\nif __name__ == "__main__":\n    main()\n')
    result = run_script("train.py", env={"ACCEL_BACKEND": "jax"}, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (trainer,) = lines(result.stdout, "trainer")
    workers = lines(result.stdout, "worker")
    assert len(workers) == 4  # two workers, two passes
    servers = {w["parent"] for w in workers}
    assert len(servers) == 1 and trainer not in servers  # one fork server, kept for both passes
    for worker in workers:
        # The script (and torch, which it imports first) was imported by the fork server before
        # it forked the worker: the worker runs the script's module as it was, not again.
        assert worker["script_imported_in"] == worker["parent"] != worker["worker"]
        assert not worker["jax"]  # the workers hold no JAX runtime
    assert "deadlock" not in result.stderr and "os.fork()" not in result.stderr


@pytest.mark.jax
def test_a_script_without_a_main_guard_is_told_what_to_add(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT + "\nmain()\n")
    result = run_script("train.py", env={"ACCEL_BACKEND": "jax"}, cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert 'train.py has no `if __name__ == "__main__":`' in last
    assert "num_workers=0" in last
    # Said before any worker started: no worker ran the script, nor failed.
    assert result.stderr.count("Traceback") == 1 and "DataLoader worker" not in result.stderr
    assert not lines(result.stdout, "worker")
