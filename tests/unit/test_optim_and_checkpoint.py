import itertools
import os

import pytest
import torch

from accel.checkpoint import write_file
from accel.cli.checkpoints import checkpoint_dir, latest_checkpoint, list_checkpoints, prune
from accel.cli.config import OptimConfig
from accel.cli.job import LRSchedule, parameter_settings
from accel.cli.models.factory import ModelConfig, create_model


def test_schedule_warms_up_then_decays_to_min():
    sched = LRSchedule(OptimConfig(lr=1e-3, warmup_steps=4, min_lr=1e-6), total_steps=20)
    values = [sched(s) for s in range(21)]
    assert values[0] == pytest.approx(1e-6)
    assert values[0] < values[2] < values[4]
    assert max(values) == pytest.approx(1e-3, rel=1e-6)
    assert values[-1] == pytest.approx(1e-6, rel=1e-3)
    assert all(a >= b for a, b in itertools.pairwise(values[4:]))


def test_no_weight_decay_on_norms_and_biases():
    settings = parameter_settings(create_model(ModelConfig("vit_micro")), OptimConfig())
    assert settings["model.blocks.0.attn.qkv.weight"] == (1.0, 0.05)
    assert settings["model.blocks.0.attn.qkv.bias"] == (1.0, 0.0)
    assert settings["model.blocks.0.norm1.weight"] == (1.0, 0.0)
    assert settings["model.pos_embed"] == (1.0, 0.0)  # timm's no_weight_decay() list


def _save(run_dir, step: int, keep: int = 2) -> None:
    write_file(checkpoint_dir(run_dir) / f"step_{step:08d}.pt", {"w": torch.ones(3) * step})
    prune(run_dir, keep)


def test_checkpoints_are_atomic_and_only_the_last_k_kept(tmp_path, monkeypatch):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004.pt"]

    def crash(*args, **kwargs):
        raise OSError("disk died mid-write")

    monkeypatch.setattr(os, "replace", crash)  # the crash lands after the data, before the rename
    with pytest.raises(OSError):
        _save(tmp_path, 5)
    latest = latest_checkpoint(tmp_path)
    assert torch.load(latest, weights_only=True)["w"][0] == 4
    assert not list(checkpoint_dir(tmp_path).glob(".*.tmp"))  # the writer removed its own
