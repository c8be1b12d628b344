"""What an Accelerate script does, through accel on every backend, against the plain loop it
came from: accumulation groups cut short at an epoch's end weigh as the plain loop weighs them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel
from tests.helpers import INSTALLED

ACCUM = 5


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def micro_batches(count: int) -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(count)]  # fmt: skip


def groups(batches: list) -> list[list]:
    """An epoch's micro-batches in groups of ACCUM, the last one short (7 -> 5 and 2)."""
    return [batches[i : i + ACCUM] for i in range(0, len(batches), ACCUM)]


def plain_loop(batches: list[tuple]) -> tuple[dict, list[float]]:
    """The plain loop's accumulation (Accelerate's too): each micro-batch's loss divided by
    ACCUM, the optimizer stepped after a whole group and at the epoch's end."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for group in groups(batches):
        parts = [loss_fn(model, b) for b in group]
        for part in parts:
            (part / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(torch.stack(parts).detach().mean()))
    return model.state_dict(), losses


@pytest.mark.parametrize("backend", INSTALLED)
def test_a_short_accumulation_group_weighs_as_in_the_plain_loop(backend):
    """7 micro-batches with accum=5: the group of 2 weighs 2/5 of a whole group, as the plain
    loop's (the mean over the 2 would put the weights 8.5e-2 apart); each step's loss is still
    the mean over its micro-batches."""
    batches = micro_batches(7)
    want, want_losses = plain_loop(batches)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, accum=ACCUM, quiet=True)
    device_batches = list(engine.loader(batches))
    handles = [engine.step_micro_batches(group) for group in groups(device_batches)]
    losses = [r.loss for r in engine.fetch(handles)]
    assert losses == pytest.approx(want_losses, rel=1e-5)
    got = engine.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
