import itertools
import os

import pytest
import torch

from accel.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from accel.config import OptimConfig
from accel.optim import LRSchedule, decay_mask
from models.factory import ModelConfig, create_model


def test_schedule_warms_up_then_decays_to_min():
    sched = LRSchedule(OptimConfig(lr=1e-3, warmup_steps=4, min_lr=1e-6), total_steps=20)
    values = [sched(s) for s in range(21)]
    assert values[0] == pytest.approx(1e-6)
    assert values[0] < values[2] < values[4]
    assert max(values) == pytest.approx(1e-3, rel=1e-6)
    assert values[-1] == pytest.approx(1e-6, rel=1e-3)
    assert all(a >= b for a, b in itertools.pairwise(values[4:]))


def test_no_weight_decay_on_norms_and_biases():
    mask = decay_mask(create_model(ModelConfig("vit_micro")))
    assert mask["model.blocks.0.attn.qkv.weight"] is True
    assert mask["model.blocks.0.attn.qkv.bias"] is False
    assert mask["model.blocks.0.norm1.weight"] is False


def test_checkpoints_are_atomic_and_only_the_last_k_kept(tmp_path, monkeypatch):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.ones(3) * step}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004.pt"]

    def crash(*args, **kwargs):
        raise OSError("disk died mid-write")

    monkeypatch.setattr(os, "replace", crash)  # the crash lands after the data, before the rename
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 5, {"step": 5}, keep=2)
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 4
