"""jax's training step as a pure function (make_train_step), on its own, with a loss written in
JAX: the update it makes, the skip of a non-finite step and the count. (The mean over several
devices: tests/integration/test_api_replicas.py.)"""

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh

from accel.backends.jax.optimizer import OptaxGroups
from accel.backends.jax.step import make_train_step
from accel.optim import OptimizerSpec


def linear_loss(params, consts, batch, key):
    inputs, targets = batch
    return jnp.mean((inputs @ params["w"] - targets) ** 2)


def sgd() -> OptaxGroups:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3))
    return OptaxGroups(OptimizerSpec.of(torch.optim.SGD(model.parameters(), lr=0.1), model))


@pytest.fixture
def step():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return jax.jit(make_train_step(linear_loss, sgd(), mesh))


def call(step, inputs, targets, w=None):
    params = {"w": jnp.zeros(3) if w is None else w}
    state = sgd().init(params)
    batch = (inputs[None], targets[None])  # one micro-step
    return step(params, state, {}, jnp.int32(0), {}, batch, jnp.array([0.1]), jnp.float32(0))


def test_the_step_applies_plain_sgd_to_the_mean_gradient(step):
    inputs = jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]])
    targets = jnp.array([1.0, -1.0])
    params, _, _, count, result = call(step, inputs, targets)
    grad = 2 * inputs.T @ (inputs @ jnp.zeros(3) - targets) / 2  # d/dw of the mean square
    np.testing.assert_allclose(params["w"], -0.1 * grad, rtol=1e-6)
    assert float(result[0]) == pytest.approx(1.0) and float(result[1]) == 1.0
    assert int(count) == 1


def test_a_non_finite_batch_leaves_the_weights_and_the_count(step):
    w = jnp.array([0.5, -0.5, 1.0])
    inputs = jnp.array([[jnp.inf, 0.0, 0.0], [0.0, 1.0, 1.0]])
    params, _, _, count, result = call(step, inputs, jnp.zeros(2), w)
    np.testing.assert_array_equal(params["w"], w)
    assert float(result[1]) == 0.0 and int(count) == 0
