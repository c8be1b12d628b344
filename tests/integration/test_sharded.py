"""--shard: FSDP2 on eager (2 gloo processes) and sharded arrays on jax (2 host devices) train
the losses of the replicated run with about half the state per rank; sharded checkpoints resume
bit for bit after SIGKILL and load into an unsharded single process."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from accel.amp import amp_policy
from accel.cli.models.factory import ModelConfig, create_model
from accel.cli.runs import in_use
from accel.distributed import destroy_process_group
from accel.parallel import fsdp
from tests import nan_model
from tests.helpers import (
    TWO_HOST_DEVICES,
    Command,
    checkpoint_tensors,
    launch,
    nan_config,
    nan_rank,
    read_summary,
    run_cli,
    train_forked,
    train_ranks,
    xla_flags,
)
from tests.shared_runs import SHARD_JOB

pytestmark = pytest.mark.slow

JOB = SHARD_JOB


def _run(output: Path, *extra: str, env: dict | None = None) -> dict:
    """The job: eager's and compile's ranks from the fork server (train_ranks); jax's devices,
    counted as its JAX starts, in a process of their own from the same server (train_forked)."""
    run = train_forked if "jax" in extra else train_ranks
    return run(output, *JOB, *extra, env=env)[0]


def _state_bytes(summary: dict) -> int:
    return sum(summary["state_bytes"].values())


def test_fsdp_trains_the_ddp_losses_with_half_the_state_per_rank(eager_runs):
    (_, ddp), (output, sharded) = eager_runs["none"], eager_runs["full"]
    assert sharded["shard"] == "full" and ddp["shard"] == "none"
    np.testing.assert_allclose(sharded["losses"][:5], ddp["losses"][:5], rtol=1e-5)
    assert _state_bytes(sharded) <= 0.55 * _state_bytes(ddp)
    assert sharded["state_bytes"]["grads"] <= 0.55 * ddp["state_bytes"]["grads"]
    np.testing.assert_allclose(sharded["eval_loss"], ddp["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(sharded["eval_loss_ema"], ddp["eval_loss_ema"], rtol=1e-5)
    saved = sorted(p.name for p in (output / "vit_micro/eager/r/checkpoints").iterdir())
    assert saved == ["step_00000002.dcp", "step_00000004.dcp", "step_00000006.dcp"]


def test_a_sharded_checkpoint_loads_into_one_unsharded_process(eager_runs, tmp_path):
    """--shard full in one process warns that nothing is sharded and trains unsharded; the
    2-rank checkpoint loads into it resharded, and evaluates to the same loss."""
    output, sharded = eager_runs["full"]
    last = output / "vit_micro/eager/r/checkpoints/step_00000006.dcp"
    # The same global batch (2 ranks x 8 x 2 micro-steps), as a resume requires.
    job = (*JOB, "--batch_size", "16", "--shard", "full", "--resume", str(last))
    result = run_cli(*job, "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--shard full with world size 1: nothing to shard" in result.stderr
    assert "resuming at another world_size" in result.stderr
    single = read_summary(tmp_path)
    assert single["shard"] == "none" and single["world_size"] == 1
    np.testing.assert_allclose(single["eval_loss"], sharded["eval_loss"], rtol=1e-5)


def test_resuming_a_sharded_checkpoint_into_another_job_names_the_keys(eager_runs, tmp_path):
    output, _ = eager_runs["full"]
    last = output / "vit_micro/eager/r/checkpoints/step_00000006.dcp"
    job = (*JOB, "--output", str(tmp_path), "--batch_size", "4", "--resume", str(last))
    code, _, stderr = launch(*job)
    assert code == 2
    assert "cannot resume" in stderr
    assert "global_batch (checkpoint 32, now 8)" in stderr


def test_sigkill_of_a_sharded_run_then_resume_auto_is_bit_for_bit(eager_runs, tmp_path):
    _, sharded = eager_runs["full"]
    job = [*JOB, "--nproc_per_node", "2", "--shard", "full", "--output", str(tmp_path)]
    # Its own session, so that SIGKILL of its group reaches the launcher and not the suite.
    proc = Command([*job, "--run_name", "r"], new_session=True)
    done = tmp_path / "vit_micro/eager/r/checkpoints/step_00000002.dcp"
    deadline = time.monotonic() + 300
    while not done.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The ranks are torchrun's children in sessions of their own: they die with the launcher
    # (PR_SET_PDEATHSIG), a moment later; rank 0 holds the run folder's lock until it is gone.
    run = done.parents[1]
    while in_use(run):
        assert time.monotonic() < deadline, f"rank 0 outlived its launcher: {in_use(run)}"
        time.sleep(0.05)
    assert not (run / "summary.json").exists()  # killed before the end
    resumed = _run(tmp_path, "--nproc_per_node", "2", "--shard", "full", "--resume", "auto")
    assert resumed["losses"] == sharded["losses"]
    assert resumed["eval_loss_ema"] == sharded["eval_loss_ema"]


def test_jax_sharded_arrays_train_the_replicated_losses_with_half_the_state(tmp_path):
    env = {"XLA_FLAGS": xla_flags(TWO_HOST_DEVICES)}
    runs = {
        shard: _run(
            tmp_path / shard,
            "--backend",
            "jax",
            "--nproc_per_node",
            "2",
            "--shard",
            shard,
            "--no-eval",
            env=env,
        )
        for shard in ("none", "full")
    }
    np.testing.assert_allclose(runs["full"]["losses"][:5], runs["none"]["losses"][:5], rtol=1e-5)
    assert _state_bytes(runs["full"]) <= 0.55 * _state_bytes(runs["none"])


def test_compile_with_fsdp_trains_the_ddp_losses(eager_runs, tmp_path):
    _, ddp = eager_runs["none"]
    compiled = _run(tmp_path, "--backend", "compile", "--nproc_per_node", "2", "--shard", "full")
    assert compiled["shard"] == "full" and compiled["compiles_after_warmup"] == 0
    np.testing.assert_allclose(compiled["losses"][:5], ddp["losses"][:5], rtol=1e-4)


def test_a_non_finite_step_leaves_the_sharded_state_untouched(tmp_path, one_white_image, free_port):
    """--nan_policy skip, sharded: the step with the white image saves the weights and AdamW
    moments it started from, bit for bit, on every shard; other steps change them."""
    cfg = nan_config(
        tmp_path, "eager", one_white_image, nan_policy="skip", shard="full", nproc_per_node=2
    )
    mp.start_processes(nan_rank, args=(cfg, free_port()), nprocs=2, start_method="forkserver")
    summary = read_summary(tmp_path)
    steps = summary["nonfinite_steps"]
    assert len(steps) == 2 and summary["steps"] == 4 and summary["shard"] == "full"
    checkpoints = tmp_path / nan_model.NAME / "eager" / "t" / "checkpoints"
    states = {s: checkpoint_tensors(checkpoints / f"step_{s:08d}.dcp") for s in range(1, 5)}
    for step in (s for s in steps if s > 1):
        assert all(torch.equal(v, states[step - 1][k]) for k, v in states[step].items()), step
    applied = next(s for s in range(2, 5) if s not in steps)
    assert not all(torch.equal(v, states[applied - 1][k]) for k, v in states[applied].items())


@pytest.fixture
def one_rank_group(free_port):
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    yield
    destroy_process_group()


def test_blocks_are_found_per_model_and_a_model_without_them_is_wrapped_whole(one_rank_group):
    vit = create_model(ModelConfig("vit_micro")).model
    swin = create_model(ModelConfig("swin_micro")).model
    assert fsdp.transformer_blocks(vit) == list(vit.blocks)
    assert fsdp.transformer_blocks(swin) == list(swin.layers)  # Swin: its stages
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert fsdp.transformer_blocks(flat) == []
    with pytest.warns(UserWarning, match="no blocks to wrap one by one; sharded as one unit"):
        fsdp.apply_fsdp(flat, "full", amp_policy("O0"), init_device_mesh("cpu", (1,)))
    assert type(flat).__name__.startswith("FSDP")
