"""A handful of timm's families train on jax and xla as on eager, through bench/timm_zoo.py's
own run (its smallest model of each of 30 families, 3 AdamW steps at 64 px, on every backend;
its record in bench/results/cpu-timm-zoo.md): EVA-02 (torch's keywords into F.linear, rotary
position embeddings), ConvNeXt (LayerNorm over channels, depthwise convolutions, stochastic
depth's identity) and MobileNetV3 (BatchNorm, hard-swish, squeeze-excitation)."""

from __future__ import annotations

from functools import cache

import pytest

from bench.timm_zoo import AS_EAGER, outcome
from tests.helpers import INSTALLED

HANDFUL = ("eva02_tiny_patch14_224", "convnext_atto", "mobilenetv3_small_050")


@cache
def eager_losses(model: str) -> tuple[float, ...]:
    found = outcome(model, "eager", None)
    assert found.status == "as eager" and found.losses, found
    return tuple(found.losses)


# Each family on jax; on xla, whose compile of a model takes 10 s here, EVA-02 (its keywords)
CASES = [(m, "jax") for m in HANDFUL] + [("eva02_tiny_patch14_224", "xla")]


@pytest.mark.slow  # a timm model's compile by XLA on the CPU: seconds each
@pytest.mark.parametrize(("model", "backend"), [c for c in CASES if c[1] in INSTALLED])
def test_a_timm_family_trains_as_on_eager(model, backend):
    eager = eager_losses(model)
    found = outcome(model, backend, list(eager))
    assert found.backend == backend and found.losses
    assert found.status == "as eager", found  # within AS_EAGER of eager's losses
    assert found.distance is not None and found.distance <= AS_EAGER
    assert found.losses[-1] != found.losses[0]  # the steps changed the weights
