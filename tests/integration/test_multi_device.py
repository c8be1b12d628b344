"""Beyond one process, on every backend: xla on an SPMD device mesh (CPU_NUM_DEVICES), jax over
several processes (a coordinator on 127.0.0.1, gloo collectives), and eager on two localhost
"nodes" (two launchers, --nnodes 2): each trains the losses of the one-process run on the same
global batch."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.helpers import (
    TWO_HOST_DEVICES,
    Command,
    launch,
    read_summary,
    run_cli,
    train,
    train_forked,
    xla_flags,
)
from tests.shared_runs import SHARD_JOB, TP_JOB

pytestmark = pytest.mark.slow

# A global batch of 8 however it is split; six steps, a checkpoint every two.
JOB = ("--steps", "6", "--workers", "0", "--log_every", "1", "--save_every", "2")
JOB += ("--synthetic_length", "64", "--num_classes", "10")


def _summary(output: Path, *extra: str, env: dict | None = None) -> dict:
    """A run on a mesh of one process's devices, its XLA's or JAX's own (helpers.train_forked):
    its summary."""
    return train_forked(output, *JOB, *extra, env=env)[0]


def _checkpoint(output: Path, backend: str, step: int, kind: str = "pt") -> Path:
    return output / "vit_micro" / backend / "r" / "checkpoints" / f"step_{step:08d}.{kind}"


# --- xla: one process, a mesh of CPU devices (SPMD) ---------------------------------------------
@pytest.fixture(scope="module")
def xla_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    jobs = {
        "1": ("--batch_size", "8"),
        "2": ("--batch_size", "4", "--nproc_per_node", "2"),
        "2-full": ("--batch_size", "4", "--nproc_per_node", "2", "--shard", "full"),
    }
    runs = {}
    for name, extra in jobs.items():
        output = tmp_path_factory.mktemp(f"xla{name}")
        if name == "1":  # one device: in this process, whose XLA has started
            runs[name] = output, train(output, *JOB, "--backend", "xla", *extra)[0]
        else:  # a mesh: an XLA of its own
            runs[name] = output, _summary(output, "--backend", "xla", *extra)
    return runs


@pytest.mark.xla
@pytest.mark.parametrize("devices", ["2", "2-full"])
def test_xla_on_a_device_mesh_trains_the_one_device_losses(xla_runs, devices):
    _, one = xla_runs["1"]
    _, mesh = xla_runs[devices]
    np.testing.assert_allclose(mesh["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(mesh["eval_loss"], one["eval_loss"], rtol=1e-5)
    assert mesh["devices"] == int(devices[0]) and mesh["world_size"] == int(devices[0])
    assert mesh["global_batch_size"] == one["global_batch_size"] == 8
    assert mesh["compiles_after_warmup"] == 0
    assert mesh["shard"] == ("full" if devices.endswith("full") else "none")


@pytest.mark.xla
def test_xla_on_a_mesh_resumes_exactly_and_its_checkpoint_loads_into_eager(xla_runs, tmp_path):
    output, sharded = xla_runs["2-full"]
    mesh = ("--backend", "xla", "--batch_size", "4", "--nproc_per_node", "2", "--shard", "full")
    resumed = _summary(tmp_path / "r", *mesh, "--resume", str(_checkpoint(output, "xla", 2)))
    np.testing.assert_allclose(resumed["losses"], sharded["losses"], rtol=1e-6)
    eager, _ = train(  # in this process: one rank of eager
        tmp_path / "e", *JOB, "--batch_size", "8", "--resume", str(_checkpoint(output, "xla", 6))
    )
    np.testing.assert_allclose(eager["eval_loss"], sharded["eval_loss"], rtol=1e-5)


@pytest.mark.xla
def test_a_mesh_larger_than_cpu_num_devices_is_one_line(tmp_path):
    job = ("--backend", "xla", "--nproc_per_node", "4", "--batch_size", "2")
    job += ("--output", str(tmp_path))
    result = run_cli(*JOB, *job, env={"CPU_NUM_DEVICES": "2"}, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "CPU_NUM_DEVICES is 2" in lines[0] and "--nproc_per_node 4" in lines[0]


# --- several launchers on this host, as several nodes -------------------------------------------
def _node(
    output: Path,
    port: int,
    rank: int,
    *extra: str,
    nodes: int = 2,
    base: tuple = JOB,
    env: dict | None = None,
) -> Command:
    """The launcher of node `rank`, on 127.0.0.1 (a static rendezvous at rank 0's port), in a
    session of its own (killing its group kills the node)."""
    args = (*base, *extra, "--output", str(output), "--run_name", "r", "--nnodes", str(nodes))
    args += ("--master_addr", "127.0.0.1", "--master_port", str(port), "--node_rank", str(rank))
    return Command(list(args), env, new_session=True)


def _nodes(
    output: Path, port: int, *extra: str, nodes: int = 2, base: tuple = JOB, env: dict | None = None
) -> list[Command]:
    return [_node(output, port, r, *extra, nodes=nodes, base=base, env=env) for r in range(nodes)]


def _finish(procs: list[Command], timeout: int = 300) -> list[tuple[int, str]]:
    """(exit code, stderr) of each launcher."""
    out = []
    for proc in procs:
        _, stderr = proc.communicate(timeout=timeout)
        out.append((proc.returncode, stderr))
    return out


@pytest.fixture(scope="module")
def node_runs(tmp_path_factory, eager_runs, tp_runs, free_port) -> dict[str, tuple[dict, dict]]:
    """(two nodes of one process, one node of two processes) for each kind of process group,
    the latter the shared runs of test_sharded.py and test_tensor_parallel.py: one group over
    the world (DDP; FSDP2 uses the same one, and test_sharded.py shows it trains DDP's losses),
    and a mesh of groups (tensor parallel)."""
    layouts = {
        "ddp": (SHARD_JOB, eager_runs["none"][1]),
        "tp": ((*TP_JOB, "--tp_head", "2"), tp_runs["tp2"][1]),
    }
    runs = {}
    for name, (job, one_node) in layouts.items():
        nodes = tmp_path_factory.mktemp(f"nodes-{name}")
        finished = _finish(_nodes(nodes, free_port(), *job, base=()))
        assert all(code == 0 for code, _ in finished), finished[0][1][-2000:]
        runs[name] = read_summary(nodes), one_node
    return runs


@pytest.mark.parametrize("layout", ["ddp", "tp"])
def test_two_nodes_train_the_losses_of_one_node_with_two_processes(node_runs, layout):
    two_nodes, one_node = node_runs[layout]
    assert two_nodes["world_size"] == one_node["world_size"] == 2
    np.testing.assert_allclose(two_nodes["losses"], one_node["losses"], rtol=1e-5)


def test_killing_one_nodes_launcher_ends_the_other_naming_the_rank(tmp_path, free_port):
    job = ("--steps", "100000", "--batch_size", "8", "--save_every", "0")
    procs = _nodes(tmp_path, free_port(), *job)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("**/metrics.rank1.jsonl")):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(procs[1].pid, signal.SIGKILL)  # node 1: its launcher and its rank
    code, stderr = _finish(procs[:1], timeout=60)[0]  # it ends, without a hang
    assert code != 0 and "training failed on rank 0" in stderr
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]


def test_a_node_that_never_arrives_is_one_line_naming_the_endpoint(tmp_path, free_port):
    port = free_port()
    node = _node(tmp_path, port, 0, "--batch_size", "8", "--rdzv_timeout", "5")
    code, stderr = _finish([node], timeout=120)[0]
    lines = [line for line in stderr.splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1, stderr[-2000:]
    assert f"127.0.0.1:{port}" in lines[0] and "1/2" in lines[0]


def test_nodes_started_with_different_options_are_refused_naming_the_key(tmp_path, free_port):
    port = free_port()
    procs = [_node(tmp_path, port, r, "--batch_size", "8", "--seed", str(r)) for r in range(2)]
    finished = _finish(procs, timeout=180)
    assert all(code != 0 for code, _ in finished)
    # every rank says it (none is left waiting in a collective for the other)
    assert all("different options: seed (rank 0: 0, rank 1: 1)" in err for _, err in finished)


# --- jax: several processes, one mesh -----------------------------------------------------------
def _jax_process(output: Path, port: int, process: int, *job: str) -> Command:
    """One of two jax processes started as docs/parallelism.md shows: the coordinator and this
    process's place in JAX_* variables, no --run_name."""
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    env["JAX_PROCESS_ID"] = str(process)
    return Command([*JOB, *job, "--output", str(output)], env)


def test_jax_over_two_processes_trains_the_losses_of_one_process_with_two_devices(
    tmp_path, free_port
):
    """Each process names no run folder: they write into process 0's, one summary, one set of
    checkpoints, and both exit 0."""
    jax = ("--backend", "jax", "--batch_size", "4")
    port = free_port()
    finished = _finish([_jax_process(tmp_path / "two", port, p, *jax) for p in range(2)])
    assert [code for code, _ in finished] == [0, 0], [err[-2000:] for _, err in finished]
    runs = list((tmp_path / "two" / "vit_micro" / "jax").iterdir())
    assert len(runs) == 1, runs
    assert sorted(p.name for p in runs[0].glob("metrics*.jsonl")) == [
        "metrics.jsonl",
        "metrics.rank1.jsonl",
    ]
    devices = {"XLA_FLAGS": xla_flags(TWO_HOST_DEVICES)}
    one = _summary(tmp_path / "one", *jax, "--nproc_per_node", "2", env=devices)
    two = read_summary(tmp_path / "two")
    assert two["world_size"] == one["world_size"] == 2 and two["global_batch_size"] == 8
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two["eval_loss"], one["eval_loss"], rtol=1e-5)
    # Written once, by process 0; it resumes at the other layout.
    saved = sorted((runs[0] / "checkpoints").iterdir())
    assert [p.name for p in saved] == [f"step_{s:08d}.pt" for s in (2, 4, 6)]
    resume = ("--resume", str(saved[0]))
    again = _summary(tmp_path / "again", *jax, "--nproc_per_node", "2", *resume, env=devices)
    np.testing.assert_allclose(again["losses"], two["losses"], rtol=1e-6)


def test_jax_coordination_variables_half_set_are_one_line(tmp_path, free_port):
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2"}
    result = launch(*JOB, "--backend", "jax", "--output", str(tmp_path), env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "JAX_PROCESS_ID unset" in lines[0]
