"""The ops the jax backend lowers itself (accel/backends/jax/ops.py), against torch's own on the
CPU: values and gradients, through the backend's tracer."""

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax
import jax.numpy as jnp
import numpy as np
import torch

from accel.backends import jax as jax_backend
from accel.backends.jax.ops import EAGER_LOWERINGS, overridden


@pytest.fixture(scope="module")
def env():
    jax_backend.require()
    from accel.backends.jax import runtime
    from accel.backends.jax.torchax_compat import removed_ops

    with removed_ops():
        return runtime.torchax.default_env()


def value_and_grad(env, fn, *inputs: np.ndarray):
    """fn(*tensors) -> scalar, and its gradient by the first input, traced by torchax with the
    backend's lowerings; and the same from torch."""
    from accel.backends.jax import runtime

    def traced(first, *rest):
        with env, torch.device("jax"):
            tensors = [runtime.interop.torch_view(a) for a in (first, *rest)]
            return runtime.interop.jax_view(fn(*tensors))

    with overridden(env, EAGER_LOWERINGS):
        value, grad = jax.jit(jax.value_and_grad(traced))(*(jnp.asarray(i) for i in inputs))
    tensors = [torch.tensor(i, requires_grad=k == 0) for k, i in enumerate(inputs)]
    expected = fn(*tensors)
    expected.backward()
    return (float(value), np.asarray(grad)), (expected.item(), tensors[0].grad.numpy())


CASES = [  # (kernel, stride, padding, dilation, ceil_mode) on 7 x 9 inputs
    (3, 2, 1, 1, False), (3, 2, 1, 1, True), (2, None, 0, 1, True), (3, 1, 0, 2, False),
    (3, 2, 1, 2, True), ((2, 3), (2, 1), (1, 0), 1, True),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_max_pool2d_gives_torchs_maxima_and_gradients(env, case):
    kernel, stride, padding, dilation, ceil_mode = case
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 9)).astype(np.float32)

    def pooled(t: torch.Tensor) -> torch.Tensor:  # cubed: each maximum's gradient its own
        out = torch.nn.functional.max_pool2d(t, kernel, stride, padding, dilation, ceil_mode)
        return (out**3).sum()

    (value, grad), (want, want_grad) = value_and_grad(env, pooled, x)
    assert value == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
@pytest.mark.parametrize("rows", [5, 30])  # 30: torch's matmul path
def test_cdist_to_itself_has_torchs_zero_gradient_at_zero_distance(env, p, rows):
    x = np.random.default_rng(2).standard_normal((rows, 4)).astype(np.float32)
    (value, grad), (want, want_grad) = value_and_grad(env, lambda t: torch.cdist(t, t, p).sum(), x)
    assert np.isfinite(grad).all()
    assert value == pytest.approx(want, rel=1e-4)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-4)


def test_lstsq_solves_inside_a_trace_as_torch_does(env):
    a = np.random.default_rng(3).standard_normal((6, 3)).astype(np.float32)
    b = np.random.default_rng(4).standard_normal((6, 2)).astype(np.float32)

    def solved(t: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        return torch.linalg.lstsq(t, rhs).solution.square().sum()

    (value, grad), (want, want_grad) = value_and_grad(env, solved, a, b)
    assert value == pytest.approx(want, rel=1e-4)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-4)
