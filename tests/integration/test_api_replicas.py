"""The public API over several replicas equals one replica on the same global batch: eager under
torchrun with 2 processes (gloo), an xla SPMD mesh of 2 devices, jax over 2 devices; each
replicated and sharded (shard="full"), whose checkpoint loads into one replica."""

import json
from pathlib import Path

import pytest
import torch

import accel
from tests.helpers import (
    HAS_XLA,
    TWO_HOST_DEVICES,
    Net,
    api_loss_fn,
    fork_module,
    run_module,
    xla_flags,
)

pytestmark = pytest.mark.slow
SCRIPT = "tests.api_replicas"  # a user's script, run as `python -m tests.api_replicas ...`


def run(module: str, *args: str, out: Path, env: dict | None = None) -> dict:
    """`python -m MODULE ARGS`: torchrun in a fresh interpreter (its ranks' claim includes the
    interpreter's teardown), the script alone in a process forked from the suite's server (its
    XLA's or JAX's devices its own: helpers.fork_module)."""
    start = run_module if module == "torch.distributed.run" else fork_module
    done = start(module, *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run(SCRIPT, "eager", "1", str(out), out=out)


def close(a: dict, b: dict, tolerance: float) -> None:
    """Equal losses and trained weights (engine.state_dict: whole, fp32, on the host), and the
    user's own model loaded from them evaluates as engine.evaluate does."""
    assert a["losses"] == pytest.approx(b["losses"], rel=tolerance, abs=tolerance)
    assert set(a["weights"]) == set(b["weights"])
    for name, values in a["weights"].items():
        assert values == pytest.approx(b["weights"][name], abs=tolerance), name
    assert a["dtypes"] == ["torch.float32"] and a["devices"] == ["cpu"]
    assert a["evaluated"]["count"] == 32
    assert a["evaluated"] == pytest.approx(a["plain_evaluated"], rel=1e-5)


def loaded_weights(checkpoint: Path, backend: str) -> dict:
    """The checkpoint loaded through the API into one replica of `backend`, in this process."""
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    engine = accel.prepare(model, optimizer, api_loss_fn, backend=backend, quiet=True)
    engine.load(checkpoint)
    return {n: t.float().flatten()[:4].tolist() for n, t in engine.state_dict().items()}


@pytest.mark.parametrize("shard", ["none", "full"])
def test_two_processes_under_torchrun_equal_one(one_replica, tmp_path, shard):
    torchrun = ("--standalone", "--nproc_per_node", "2", "-m", SCRIPT)
    result = run(
        "torch.distributed.run", *torchrun, "eager", "1", str(tmp_path), shard, out=tmp_path
    )
    close(result, one_replica, 1e-6)
    # Each rank runs gloo's threads: its DataLoaders' workers come from a fork server
    assert result["start_method"] == "forkserver"
    # The script never destroys its group; accel does before the interpreter's teardown, where
    # gloo's threads could abort the rank (exit -6, "terminate called without an active exception")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"exit_{rank}.json").read_text()) == {"group_alive": False}
    checkpoint = tmp_path / "checkpoint"
    if shard == "full":  # FSDP2: each rank holds about half the state, and writes its half
        assert result["shard"] == "full"
        for part in ("params", "optimizer"):
            assert result["state_bytes"][part] < 0.6 * one_replica["state_bytes"][part], part
        assert sorted(p.name for p in checkpoint.glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    weights = loaded_weights(checkpoint, "eager")
    for name, values in result["weights"].items():
        assert weights[name] == pytest.approx(values, abs=1e-7), name


@pytest.mark.parametrize("shard", ["none", "full"])
@pytest.mark.parametrize("backend", ["xla", "jax"])
def test_two_devices_of_one_process_equal_one_replica(one_replica, tmp_path, backend, shard):
    if backend == "xla" and not HAS_XLA:
        pytest.skip("torch_xla is not installed")
    env = {"XLA_FLAGS": xla_flags(TWO_HOST_DEVICES), "PJRT_DEVICE": "CPU"}
    result = run(SCRIPT, backend, "2", str(tmp_path), shard, out=tmp_path, env=env)
    close(result, one_replica, 1e-5)
    assert result["shard"] == shard
    if shard == "full" and backend == "jax":  # the weights and moments split over the devices
        for part in ("params", "optimizer"):
            assert result["state_bytes"][part] < 0.6 * one_replica["state_bytes"][part], part
    if backend == "xla":  # FSDPv2: every weight split over the mesh's 2 devices, or none
        split = [spec.startswith("{devices=") for spec in result["xla_shardings"]]
        assert split == [shard == "full"] * len(split)
    if shard == "full":  # one file from the one process, which loads into one eager replica
        weights = loaded_weights(tmp_path / "checkpoint", "eager")
        for name, values in result["weights"].items():
            assert weights[name] == pytest.approx(values, abs=1e-6), name
