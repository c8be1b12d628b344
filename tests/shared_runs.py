"""Runs several test modules read, started once per session (multi-process runs are the
suite's slowest part): the FSDP/DDP pair of test_sharded.py and the split-classifier runs of
test_tensor_parallel.py, which the two-node runs of test_multi_device.py compare against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import train, train_ranks

# Two micro-steps a step (FSDP's reduce-scatter skipped on the first) and clipping on (the
# global norm over the shards): both would change the losses if done per shard.
SHARD_JOB = ("--model", "vit_micro", "--steps", "6", "--batch_size", "8", "--grad_accum", "2")
SHARD_JOB += ("--workers", "0", "--log_every", "1", "--save_every", "2", "--clip_grad", "0.5")
SHARD_JOB += ("--model_ema", "--model_ema_decay", "0.9")  # an EMA of the shards

# 11 classes: split over 2 ranks, the classifier is padded to 12 and the padded class masked.
TP_JOB = ("--model", "vit_micro", "--num_classes", "11", "--steps", "6", "--batch_size", "8")
TP_JOB += ("--workers", "0", "--log_every", "1", "--save_every", "2", "--mixup", "0.8")
TP_JOB += ("--drop_path", "0.3")  # the ranks of a tp group must draw the same masks
TP_JOB += ("--model_ema", "--model_ema_decay", "0.9")  # an EMA of the split classifier too


@pytest.fixture(scope="session")
def eager_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """SHARD_JOB on 2 processes, replicated (DDP) and sharded (FSDP2)."""
    runs = {}
    for shard in ("none", "full"):
        output = tmp_path_factory.mktemp(f"eager-{shard}")
        job = (*SHARD_JOB, "--nproc_per_node", "2", "--shard", shard)
        runs[shard] = output, train_ranks(output, *job)[0]
    return runs


@pytest.fixture(scope="session")
def tp_runs(tmp_path_factory) -> dict[str, tuple[Path, dict, str]]:
    """TP_JOB in one process, split over 2 ranks, on DDP, and on a dp 2 x tp 2 mesh."""
    jobs = {
        "single": (),
        "tp2": ("--nproc_per_node", "2", "--tp_head", "2"),
        "ddp2": ("--nproc_per_node", "2", "--batch_size", "8"),
        "dp2xtp2": ("--nproc_per_node", "4", "--tp_head", "2"),
    }
    out = {}
    for name, extra in jobs.items():
        output = tmp_path_factory.mktemp(name)
        run = train if not extra else train_ranks  # one process: in this one
        out[name] = (output, *run(output, *TP_JOB, *extra))
    return out
