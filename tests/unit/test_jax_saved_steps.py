"""jax's step kept between launches (accel/backends/jax/saved.py): a second engine of the same
job loads the exported step instead of tracing it and trains the same losses; what changes the
program (a batch shape, a flag of the model, a value the loss closes over) traces anew; a model
whose code is in no file keeps nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import torch
from torch import nn

import accel
from accel.config import BackendConfig, CompilerConfig


class Scaled(nn.Module):
    """A small model with a plain attribute its forward reads (as timm's fused_attn)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.body = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * self.scale)


def cross_entropy(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def batches(size: int = 4, count: int = 3) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g))] * count


def run(folder, model=None, loss_fn=cross_entropy, size: int = 4) -> tuple[list, int]:
    """Three steps of a fresh engine whose compiled programs live in `folder`: its losses and the
    steps it loaded instead of tracing."""
    torch.manual_seed(0)
    model = model or Scaled()
    config = BackendConfig("jax", compiler=CompilerConfig(cache_dir=str(folder)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = accel.prepare(model, optimizer, loss_fn, config=config, quiet=True)
    losses = [r.loss for r in engine.fetch([engine.step(*b) for b in batches(size)])]
    return losses, engine.stats().details["steps_loaded"]


def kept(folder) -> int:
    return len(list((folder / "steps").glob("*.jaxexport")))


def test_a_second_engine_of_the_same_job_loads_the_step_and_trains_the_same_losses(tmp_path):
    first, loaded = run(tmp_path)
    assert loaded == 0 and kept(tmp_path) == 1
    second, loaded = run(tmp_path)
    assert loaded == 1 and kept(tmp_path) == 1
    assert second == first


def test_a_new_batch_shape_a_model_flag_or_a_closed_over_value_traces_anew(tmp_path):
    run(tmp_path)
    assert run(tmp_path, size=8)[1] == 0 and kept(tmp_path) == 2
    assert run(tmp_path, model=Scaled(scale=2.0))[1] == 0 and kept(tmp_path) == 3
    settings = {"smoothing": 0.1}

    def smoothed(model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, label_smoothing=settings["smoothing"])

    run(tmp_path, loss_fn=smoothed)
    assert kept(tmp_path) == 4
    settings["smoothing"] = 0.2  # the same function, closing over another value
    assert run(tmp_path, loss_fn=smoothed)[1] == 0 and kept(tmp_path) == 5


def test_a_model_whose_code_is_in_no_file_keeps_nothing(tmp_path):
    scope: dict = {"nn": nn}
    exec(  # as a notebook cell or an interactive session defines it
        "class Cell(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(6, 3)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x)\n",
        scope,
    )
    run(tmp_path, model=scope["Cell"]())
    assert run(tmp_path, model=scope["Cell"]())[1] == 0
    assert kept(tmp_path) == 0
