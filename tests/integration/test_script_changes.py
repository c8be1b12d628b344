"""A script that changes its training between steps, against the plain loop it came from: a
layer frozen mid-training (`requires_grad_(False)`) stops changing on every backend, weight
decay included, as torch leaves a weight without a gradient; what accel cannot follow (a param
group added, a weight unfrozen that the prepared optimizer does not hold, every weight frozen,
and on jax a weight trained again under Adam) is one line naming the cure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel
from tests.helpers import HAS_XLA

BACKENDS = ["eager", "compile", "xla", "jax"] if HAS_XLA else ["eager", "compile", "jax"]
FREEZE_AT = 2  # the step before which the script freezes the first layer


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)
    )


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def batches(count: int = 6) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(count)]  # fmt: skip


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def plain_loop() -> dict[str, torch.Tensor]:
    """The script as it was: freezing the first layer before step FREEZE_AT, clipping at 1."""
    model = mlp()
    optimizer = adamw(model)
    for i, batch in enumerate(batches()):
        if i == FREEZE_AT:
            model[0].requires_grad_(False)
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accel_loop(backend: str, amp: str = "O0") -> tuple[dict, dict]:
    """The same script on accel: (the trained weights, the first layer's at the freeze)."""
    model = mlp()
    engine = accel.prepare(
        model, adamw(model), loss_fn, backend=backend, amp=amp, clip_grad=1.0, quiet=True
    )
    at_freeze: dict = {}
    for i, batch in enumerate(batches()):
        if i == FREEZE_AT:
            at_freeze = {k: v.clone() for k, v in engine.state_dict().items() if k[0] == "0"}
            model[0].requires_grad_(False)
        engine.fetch([engine.step(*batch)])
    return engine.state_dict(), at_freeze


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_frozen_between_steps_trains_as_in_the_plain_loop(backend):
    trained, at_freeze = accel_loop(backend)
    expected = plain_loop()
    for name in ("0.weight", "0.bias"):  # frozen: not one bit changed, weight decay included
        assert torch.equal(trained[name], at_freeze[name]), name
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("xla", "jax")])
def test_a_frozen_layer_keeps_its_fp32_weights_at_o1(backend):
    trained, at_freeze = accel_loop(backend, amp="O1")
    for name in ("0.weight", "0.bias"):
        assert torch.equal(trained[name], at_freeze[name]), name
    assert not torch.equal(trained["2.weight"], mlp().state_dict()["2.weight"])  # the rest trains


def _prepared(backend: str, model: nn.Module, optimizer) -> accel.Engine:
    return accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True)


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_what_accel_cannot_follow_is_refused_in_one_line_naming_the_cure(backend):
    (batch,) = batches(1)
    model = mlp()
    model[4].requires_grad_(False)  # frozen when prepare runs: its optimizer holds none of it
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = _prepared(backend, model, optimizer)
    engine.fetch([engine.step(*batch)])

    optimizer.add_param_group({"params": list(model[4].parameters()), "lr": 0.01})
    with pytest.raises(accel.AccelError, match=r"^the optimizer's param groups changed after "
                       r"prepare .*call accel\.prepare again"):  # fmt: skip
        engine.step(*batch)
    optimizer.param_groups.pop()

    model[4].requires_grad_(True)
    unheld = r"^4\.bias requires a gradient now but did not when prepare ran.*after unfreezing it$"
    with pytest.raises(accel.AccelError, match=unheld):
        engine.step(*batch)
    model[4].requires_grad_(False)

    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    with pytest.raises(accel.AccelError, match=r"^every weight the optimizer holds is frozen"):
        engine.step(*batch)


def test_jax_refuses_a_weight_trained_again_under_adam_and_follows_it_under_sgd():
    (batch,) = batches(1)
    for make, refused in (
        (adamw, True),
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), False),
    ):
        model = mlp()
        engine = _prepared("jax", model, make(model))
        model[0].requires_grad_(False)
        engine.fetch([engine.step(*batch)])
        model[0].requires_grad_(True)  # trained again
        if refused:
            again = r"^0\.\w+ requires a gradient again: the jax backend keeps one AdamW step"
            with pytest.raises(accel.AccelError, match=again):
                engine.step(*batch)
            continue
        before = engine.state_dict()["0.weight"].clone()
        engine.fetch([engine.step(*batch)])
        assert not torch.equal(engine.state_dict()["0.weight"], before)
