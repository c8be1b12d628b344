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


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_gives_torchs_values_and_gradients(env, affine):
    x = np.random.default_rng(5).standard_normal((4, 7, 16)).astype(np.float32) * 3 + 1
    w = np.random.default_rng(6).standard_normal(16).astype(np.float32)
    b = np.random.default_rng(7).standard_normal(16).astype(np.float32)

    def normed(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.layer_norm(t, (16,), weight if affine else None,
                                             bias if affine else None, eps=1e-5)  # fmt: skip
        return (out**3 * weight).sum()  # every output's gradient its own, and the weight's

    (value, grad), (want, want_grad) = value_and_grad(env, normed, x, w, b)
    assert value == pytest.approx(want, rel=1e-4)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-4)
    (_, grad_w), (_, want_w) = value_and_grad(env, lambda weight, t, bias: normed(t, weight, bias),
                                              w, x, b)  # fmt: skip
    np.testing.assert_allclose(grad_w, want_w, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ((torch.bfloat16, 3), 0.125),  # a scale: torch keeps bf16
        ((torch.int32, 3), 0.5),  # an integer tensor and a float: the default float
        ((torch.bfloat16, 3), (torch.float32, 0)),  # a 0-dim float32 tensor: bf16 still
        ((torch.int32, 0), (torch.bfloat16, 3)),
        ((torch.bfloat16, 3), (torch.float32, 3)),  # two tensors: promoted
        ((torch.int32, 3), 2),
        ((torch.bool, 3), 2),
    ],
    ids=str,
)
@pytest.mark.parametrize("op", ["mul", "add", "div"])
def test_arithmetic_keeps_torchs_result_dtype(env, op, left, right):
    from accel.backends.jax import runtime

    def make(spec):
        if not isinstance(spec, tuple):
            return spec
        dtype, rank = spec
        return torch.ones((2,) * rank, dtype=dtype) * (1 if dtype == torch.bool else 3)

    a, b = make(left), make(right)
    want = getattr(torch, op)(a, b)

    def array(t: torch.Tensor) -> jax.Array:
        return jnp.asarray(t.float().numpy()).astype(str(t.dtype).split(".")[1])

    def traced(x):
        with env, torch.device("jax"):
            x_ = runtime.interop.torch_view(x)
            other = runtime.interop.torch_view(array(b)) if torch.is_tensor(b) else b
            return runtime.interop.jax_view(getattr(torch, op)(x_, other))

    with overridden(env, EAGER_LOWERINGS):
        got = jax.jit(traced)(array(a))
    assert str(got.dtype) == str(want.dtype).split(".")[1].replace("int64", "int32")
    np.testing.assert_allclose(np.asarray(got, np.float32), want.float().numpy(), rtol=1e-2)
