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
    rates = {"lr": jnp.array([0.1])}
    return step(params, state, {}, jnp.int32(0), {}, batch, rates, jnp.float32(0))


def test_the_step_applies_plain_sgd_to_the_mean_gradient(step):
    inputs = jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]])
    targets = jnp.array([1.0, -1.0])
    params, _, _, count, _, result = call(step, inputs, targets)
    grad = 2 * inputs.T @ (inputs @ jnp.zeros(3) - targets) / 2  # d/dw of the mean square
    np.testing.assert_allclose(params["w"], -0.1 * grad, rtol=1e-6)
    assert float(result[0]) == pytest.approx(1.0) and float(result[1]) == 1.0
    assert int(count) == 1


def test_a_non_finite_batch_leaves_the_weights_and_the_count(step):
    w = jnp.array([0.5, -0.5, 1.0])
    inputs = jnp.array([[jnp.inf, 0.0, 0.0], [0.0, 1.0, 1.0]])
    params, _, _, count, _, result = call(step, inputs, jnp.zeros(2), w)
    np.testing.assert_array_equal(params["w"], w)
    assert float(result[1]) == 0.0 and int(count) == 0


def counting_loss(params, consts, batch, key):
    """Writes a constant, as BatchNorm writes its running statistics: the rows it saw."""
    inputs, targets = batch
    loss = jnp.mean((inputs @ params["w"] - targets) ** 2)
    return loss, jnp.zeros(0, jnp.float32), {"seen": consts["seen"] + inputs.shape[0]}


def test_constants_the_loss_writes_carry_over_micro_steps_and_come_out():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    step = jax.jit(make_train_step(counting_loss, sgd(), mesh))
    params = {"w": jnp.zeros(3)}
    batch = (jnp.ones((3, 2, 3)), jnp.zeros((3, 2)))  # three micro-steps of two rows
    consts = {"seen": jnp.float32(1.0), "kept": jnp.arange(2)}
    *_, written, _ = step(params, sgd().init(params), {}, jnp.int32(0), consts, batch,
                          {"lr": jnp.array([0.1])}, jnp.float32(0))  # fmt: skip
    assert float(written["seen"]) == 7.0  # 1 + 3 x 2, each micro-step after the one before
    np.testing.assert_array_equal(written["kept"], jnp.arange(2))


def test_weights_the_loss_does_not_read_are_left_as_they_were():
    """As torch's AdamW leaves a parameter without a gradient: no decay, no moments."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3))
    model.v = torch.nn.Parameter(torch.ones(2))
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    optimizer = OptaxGroups(OptimizerSpec.of(adamw, model))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    step = jax.jit(make_train_step(linear_loss, optimizer, mesh, unread=lambda: {"v"}))
    params = {"w": jnp.ones(3), "v": jnp.ones(2)}
    batch = (jnp.ones((1, 2, 3)), jnp.zeros((1, 2)))
    new, state, *_ = step(params, optimizer.init(params), {}, jnp.int32(0), {}, batch,
                          {"lr": jnp.array([0.1])}, jnp.float32(0))  # fmt: skip
    np.testing.assert_array_equal(new["v"], jnp.ones(2))
    assert not np.allclose(new["w"], jnp.ones(3))
    moments = optimizer.named(state)
    np.testing.assert_array_equal(moments["v"]["exp_avg"], jnp.zeros(2))
    assert np.any(np.asarray(moments["w"]["exp_avg"]) != 0)


def test_each_replicas_draws_come_from_its_replica_seed():
    """The key a step draws from is replica_seed(seed, replica)'s, folded with the step count
    and the micro-step, as every backend derives its stream (docs/api.md, random draws)."""
    from accel.backends.base import replica_seed

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def noisy_loss(params, consts, batch, key):
        inputs, targets = batch
        noise = jax.random.normal(key, targets.shape)
        return jnp.mean((inputs @ params["w"] + noise - targets) ** 2)

    step = jax.jit(make_train_step(noisy_loss, sgd(), mesh, seed=7))
    inputs, targets = jnp.zeros((2, 3)), jnp.zeros(2)
    loss = float(call(step, inputs, targets)[-1][0])  # count 0
    replica = jax.random.key(replica_seed(7, 0))
    key = jax.random.fold_in(jax.random.fold_in(replica, 0), 0)  # step count 0, micro-step 0
    expected = jax.random.normal(key, (2,))
    assert loss == pytest.approx(float(jnp.mean(expected**2)), rel=1e-6)
