"""Every torch optimizer of torch.optim a script may bring trains on each backend that claims it as
the plain loop with that optimizer does: its weights and its optimizer state (read through the
script's own optimizer, as torch's state_dict gives it) after 5 steps, to 1e-5. eager, compile
and xla run torch's own update; jax its translation (optax's for AdamW, Adam and SGD, torch's
arithmetic in accel/backends/jax/torch_optax.py for the rest). What no backend runs (LBFGS's
closure) is one line."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import accel
from tests.helpers import HAS_XLA

BACKENDS = ["eager", "compile", "xla", "jax"] if HAS_XLA else ["eager", "compile", "jax"]
STEPS = 5

OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, weight_decay=0.01),
    "RMSprop_centered_momentum": lambda p: torch.optim.RMSprop(
        p, lr=1e-2, alpha=0.9, centered=True, momentum=0.9
    ),
    "Adagrad": lambda p: torch.optim.Adagrad(
        p, lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1
    ),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.01),
    "RAdam_decoupled": lambda p: torch.optim.RAdam(
        p, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True
    ),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2, weight_decay=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0, weight_decay=0.01),
    "SGD_maximize": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, maximize=True),
    "AdamW_maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, maximize=True),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def batches() -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def plain(kind: str) -> tuple[dict, dict]:
    model = mlp()
    optimizer = OPTIMIZERS[kind](model.parameters())
    for batch in batches():
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        optimizer.step()
    return model.state_dict(), optimizer.state_dict()["state"]


def on_accel(kind: str, backend: str) -> tuple[dict, dict]:
    model = mlp()
    optimizer = OPTIMIZERS[kind](model.parameters())
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True)
    engine.fetch([engine.step(*b) for b in batches()])
    return engine.state_dict(), optimizer.state_dict()["state"]  # the script's own optimizer


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_optimizer_trains_as_the_plain_loop(backend, kind):
    weights, state = on_accel(kind, backend)
    want_weights, want_state = plain(kind)
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert set(state) == set(want_state)
    for index, tensors in want_state.items():
        assert set(state[index]) == set(tensors), index
        for key, value in tensors.items():
            got, value = torch.as_tensor(state[index][key]).float(), value.float()
            # To 1e-5 of the tensor's scale: centred RMSprop divides by sqrt(E[g^2] - E[g]^2),
            # whose float32 cancellation puts single small elements of its momentum further
            # apart, by how the CPU's vector width orders the sums.
            scale = max(float(value.abs().max()), 0.1)
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5 * scale, msg=key)


def test_lbfgs_is_refused_in_one_line():
    model = mlp()
    with pytest.raises(accel.AccelError, match=r"^accel cannot run torch\.optim\.LBFGS: its step "
                       r"calls a closure"):  # fmt: skip
        accel.prepare(model, torch.optim.LBFGS(model.parameters()), loss_fn, quiet=True)


def test_a_value_no_step_follows_changed_by_a_scheduler_is_one_line():
    model = mlp()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-2, momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    engine = accel.prepare(model, optimizer, loss_fn, schedule=schedule, quiet=True)
    batch = batches()[0]
    engine.fetch([engine.step(*batch)])  # the first step: the momentum as built
    with pytest.raises(accel.AccelError, match=r"^RMSprop's momentum changed from 0\.9\d* to "
                       r"[\d.]+ after prepare: accel's step follows its lr only"):  # fmt: skip
        engine.step(*batch)


def adamw_in_float64(steps: int) -> dict[str, torch.Tensor]:
    """The plain loop's AdamW in float64: its bias corrections and moments without float32's
    rounding, the reference each backend's float32 update is measured from."""
    model = mlp().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for inputs, labels in batches() + batches()[: steps - STEPS]:
        optimizer.zero_grad()
        loss_fn(model, (inputs.double(), labels)).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "compile"])
def test_adamw_sits_as_near_a_float64_adamw_as_eager(backend):
    """xla and jax compute Adam's bias corrections in float32 (1 - 0.999 rounds 1.3e-5 low),
    eager in Python's float64: after 8 steps each backend's weights sit within float32's own
    rounding of a float64 AdamW (docs/api.md states the sizes), relative to how far they moved."""
    steps, start = 8, mlp().state_dict()
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True)
    engine.fetch([engine.step(*b) for b in batches() + batches()[: steps - STEPS]])
    weights, exact = engine.state_dict(), adamw_in_float64(steps)
    moved = sum(float((exact[n] - start[n].double()).norm() ** 2) for n in exact) ** 0.5
    off = sum(float((weights[n].double() - exact[n]).norm() ** 2) for n in exact) ** 0.5
    assert moved > 1e-3  # the steps moved the weights: the ratio measures the update
    assert off / moved < 5e-5, off / moved


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_warm_up_from_a_rate_of_0_leaves_the_weights_finite_and_unchanged(backend):
    """A warm-up's first step at lr 0 (transformers' linear warm-up starts there) over a weight
    whose gradient is 0 (its input column is 0): on xla torch's capturable AdamW divided 0 by
    0 there, and every later step trained NaNs."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(step, 1.0))
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True)
    start = mlp().state_dict()
    losses = []
    for inputs, labels in batches()[:3]:
        inputs[:, 0] = 0.0  # the first layer's first input column: a gradient of 0
        losses.append(engine.fetch([engine.step(inputs, labels)])[0].loss)
        scheduler.step()
        if len(losses) == 1:
            first = engine.state_dict()
            assert all(torch.equal(first[n], start[n]) for n in start), "lr 0 moved a weight"
    weights = engine.state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values()) and losses[2] != losses[1]
