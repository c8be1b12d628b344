"""The public API over several replicas equals one replica on the same global batch: eager under
torchrun with 2 processes (gloo), an xla SPMD mesh of 2 devices, jax over 2 devices."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import HAS_XLA, ROOT

pytestmark = pytest.mark.slow
SCRIPT = ("-m", "tests.api_replicas")


def run(cmd: list[str], out, env: dict | None = None) -> dict:
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run([sys.executable, *SCRIPT, "eager", "1", str(out)], out)


def close(a: dict, b: dict, tolerance: float) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=tolerance, abs=tolerance)
    for name, values in a["weights"].items():
        assert values == pytest.approx(b["weights"][name], abs=tolerance), name


def test_two_processes_under_torchrun_equal_one(one_replica, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc_per_node", "2", *SCRIPT, "eager", "1", str(tmp_path)]
    close(run(cmd, tmp_path), one_replica, 1e-6)


@pytest.mark.parametrize("backend", ["xla", "jax"])
def test_two_devices_of_one_process_equal_one_replica(one_replica, tmp_path, backend):
    if backend == "xla" and not HAS_XLA:
        pytest.skip("torch_xla is not installed")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PJRT_DEVICE": "CPU"}
    cmd = [sys.executable, *SCRIPT, backend, "2", str(tmp_path)]
    close(run(cmd, tmp_path, env), one_replica, 1e-5)
