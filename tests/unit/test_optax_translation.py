"""jax's translation of a torch optimizer (optax, one chain per param group) updates as torch
does, given the same gradients: AdamW, Adam and SGD with Nesterov momentum, with param groups of
their own rate and weight decay and a schedule, 5 steps."""

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax.numpy as jnp
import numpy as np
import torch

from accel.backends.jax.optimizer import OptaxGroups
from accel.optim import LearningRates, OptimizerSpec
from tests.helpers import LR, Net, grouped


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_the_optax_translation_updates_as_torch_does(kind):
    torch.manual_seed(0)
    model = Net()
    optimizer = grouped(model, kind)
    spec = OptimizerSpec.of(optimizer, model)
    rates = LearningRates(spec, lambda step: LR[kind] * 0.8**step)
    translated = OptaxGroups(spec)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    state = translated.init(params)
    for step in range(5):
        grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for group, rate in zip(optimizer.param_groups, rates(step), strict=True):
            group["lr"] = rate
        optimizer.step()
        jax_grads = {n: jnp.asarray(g.numpy()) for n, g in grads.items()}
        params, state = translated.update(jax_grads, state, params, translated.rates(rates(step)))
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(params[name]), p.detach().numpy(), rtol=0, atol=1e-6)
    # The state maps onto torch's, name by name.
    names = {id(p): n for n, p in model.named_parameters()}
    theirs = {names[id(p)]: s for p, s in optimizer.state.items()}
    for name, ours in translated.to_torch(state).items():
        for key, value in ours.items():
            want = theirs[name][key]
            np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
