"""The ops the jax backend lowers itself (accel/backends/jax/ops.py), against torch's own on the
CPU: values and gradients, through the backend's tracer."""

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax
import jax.numpy as jnp
import numpy as np
import torch

from accel.backends import jax as jax_backend
from accel.backends.jax.model_ops import MODEL_LOWERINGS
from accel.backends.jax.ops import EAGER_LOWERINGS, overridden
from accel.backends.jax.tracing import eager_lowerings


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

    with overridden(env, eager_lowerings(env)):
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


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_gives_torchs_values_and_gradients(env, approximate):
    x = np.random.default_rng(8).standard_normal((5, 11)).astype(np.float32) * 3

    def activated(t: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.gelu(t, approximate=approximate)
        return (out**3).sum()  # every output's gradient its own

    (value, grad), (want, want_grad) = value_and_grad(env, activated, x)
    assert value == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)


# Each torch function accel lowers, called as torch allows: its whole argument list by position,
# or its arguments by their keywords (a lowering must take torch's names and arity, not a subset).
F = torch.nn.functional
SIGNATURE_CASES = {  # what the case calls: the function accel lowers, and the call
    "torch.layer_norm, all by position": (
        torch.layer_norm,
        lambda t: torch.layer_norm(t, [6], None, None, 1e-5, True),
    ),
    "F.layer_norm by keyword": (
        F.layer_norm,
        lambda t: F.layer_norm(input=t, normalized_shape=(6,), weight=None, bias=None, eps=1e-3),
    ),
    "F.gelu by keyword": (F.gelu, lambda t: F.gelu(input=t, approximate="tanh")),
    "torch.cdist by keyword": (
        torch.cdist,
        lambda t: torch.cdist(x1=t[0], x2=t[1] * 2, p=2.0, compute_mode="use_mm_for_euclid_dist"),
    ),
    "torch.max_pool2d, all by position": (
        torch.max_pool2d,
        lambda t: torch.max_pool2d(t, 2, 1, 0, 1, False),
    ),
    "F.max_pool2d by keyword": (
        F.max_pool2d,
        lambda t: F.max_pool2d(
            input=t,
            kernel_size=2,
            stride=1,
            padding=0,
            dilation=1,
            ceil_mode=True,
            return_indices=False,
        ),
    ),
    "F.ctc_loss by keyword, targets concatenated": (
        F.ctc_loss,
        lambda t: F.ctc_loss(
            log_probs=t.reshape(6, 2, 6).log_softmax(-1),
            targets=torch.tensor([1, 2, 3, 3, 4]),
            input_lengths=torch.tensor([6, 5]),
            target_lengths=torch.tensor([2, 3]),
            blank=0,
            reduction="mean",
            zero_infinity=False,
        ),
    ),
    "torch.ctc_loss, all by position, padded targets and an impossible alignment zeroed": (
        torch.ctc_loss,
        lambda t: torch.ctc_loss(
            t.reshape(6, 2, 6).log_softmax(-1),
            torch.tensor([[1, 1, 2], [4, 4, 4]]),  # the second needs 5 steps and is given 2
            [6, 2],
            [3, 3],
            5,
            1,  # torch.ctc_loss's reduction by number: "mean"... as F.ctc_loss's enum
            True,
        ).sum(),
    ),
    "F.embedding_bag by keyword, mean with padding_idx": (
        F.embedding_bag,
        lambda t: F.embedding_bag(
            input=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]),
            weight=t.reshape(12, 6),
            offsets=torch.tensor([0, 4, 4]),  # the middle bag empty
            mode="mean",
            padding_idx=4,
        ),
    ),
    "F.embedding_bag, all by position: max of rows of a 2-D input": (
        F.embedding_bag,
        lambda t: F.embedding_bag(
            torch.tensor([[1, 2, 3], [7, 7, 0]]), t.reshape(12, 6), None, None, 2.0, False, "max"
        ),
    ),
    "F.embedding_bag: per-sample weights summed, the last offset included": (
        F.embedding_bag,
        lambda t: F.embedding_bag(
            torch.tensor([1, 2, 3, 8]),
            t.reshape(12, 6),
            torch.tensor([0, 1, 4]),
            mode="sum",
            per_sample_weights=torch.tensor([0.5, 2.0, -1.0, 3.0]),
            include_last_offset=True,
        ),
    ),
    "torch.linalg.lstsq by keyword": (
        torch.linalg.lstsq,
        # torch's own keywords (its docs name them A and B)
        lambda t: torch.linalg.lstsq(input=t[0], b=t[1][:, :2], rcond=None, driver="gelsy")[0],
    ),
}


def test_every_torch_function_accel_lowers_has_a_signature_case():
    lowered = {**EAGER_LOWERINGS, **MODEL_LOWERINGS}
    lowered = {f for f in lowered if not str(f).startswith("aten.")}  # not ATen's ops
    assert lowered == {function for function, _ in SIGNATURE_CASES.values()}


@pytest.mark.parametrize("case", SIGNATURE_CASES)
def test_each_lowered_function_takes_torchs_arguments_as_torch_does(env, case):
    x = np.random.default_rng(11).standard_normal((2, 6, 6)).astype(np.float32)
    x[0] += 3 * np.eye(6, dtype=np.float32)  # lstsq's A: well conditioned
    (value, grad), (want, want_grad) = value_and_grad(
        env, lambda t: SIGNATURE_CASES[case][1](t).pow(2).sum(), x
    )
    assert value == pytest.approx(want, rel=1e-4)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-3, atol=1e-3)


def _distributions(t: torch.Tensor) -> torch.Tensor:
    """torch.distributions with their arguments validated (torch's default)."""
    dist = torch.distributions
    normal = dist.Normal(t[0, 0], F.softplus(t[0, 1]) + 0.1, validate_args=True)
    category = dist.Categorical(logits=t[1], validate_args=True)
    coin = dist.Bernoulli(logits=t[0, 2], validate_args=True)
    labels, heads = torch.arange(6) % 3, (torch.arange(6) % 2).float()
    return -(normal.log_prob(t[0, 3]) + category.log_prob(labels) + coin.log_prob(heads)).sum()


def _warped(t: torch.Tensor) -> torch.Tensor:
    """An image resampled through an affine grid (a spatial transformer's)."""
    theta = t[0, :2, :3].unsqueeze(0) * 0.5 + torch.eye(2, 3)
    grid = F.affine_grid(theta, [1, 1, 6, 6], align_corners=False)
    return F.grid_sample(t[1][None, None], grid, align_corners=False).pow(2).sum()


@pytest.mark.parametrize("loss", [_distributions, _warped], ids=["distributions", "grid_sample"])
def test_ops_torchax_lacks_give_torchs_values_and_gradients(env, loss):
    x = np.random.default_rng(5).standard_normal((2, 6, 6)).astype(np.float32)
    (value, grad), (want, want_grad) = value_and_grad(env, loss, x)
    assert value == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "bias", "bias and mask", "causal"])
def test_attention_on_xla_gives_torchs_values_and_gradients(env, kind):
    """torch's SDPA through the backend's XLA attention (recomputed_attention), a bias's
    gradient among the gradients (Swin's relative positions train through it)."""
    from accel.backends.jax.attention import AttentionKernels
    from accel.backends.jax.tracing import attention_lowerings, torch_sdpa

    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 3, 7, 4)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((1, 3, 7, 7)).astype(np.float32)
    mask = np.tril(np.ones((7, 7), bool)) | (kind != "bias and mask")

    def attended(bias_: torch.Tensor, q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor):
        given = None
        if kind == "bias":
            given = bias_
        elif kind == "bias and mask":
            given = bias_.masked_fill(~torch.as_tensor(mask), float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=given, is_causal=kind == "causal"
        )
        return (out**3).sum() + (q_ * k_).sum()  # every output's gradient its own

    sdpa = torch_sdpa(AttentionKernels(flash=False, choice="xla"))
    with overridden(env, attention_lowerings(sdpa)):
        biased = kind.startswith("bias")
        for first in range(0 if biased else 1, 4):  # by each input in turn, the bias's first
            inputs = [bias, q, k, v]
            inputs = [inputs[first], *inputs[:first], *inputs[first + 1 :]]

            def ordered(*tensors, first=first):
                back = list(tensors[1:])
                back.insert(first, tensors[0])
                return attended(*back)

            (value, grad), (want, want_grad) = value_and_grad(env, ordered, *inputs)
            assert value == pytest.approx(want, rel=1e-5)
            np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5)


def saved_for_the_backward(fn, *args) -> list[str]:
    """The types of what jax keeps for fn's backward (jax.ad_checkpoint's public report)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(fn, *args)
    return [line.split(" ")[0] for line in printed.getvalue().splitlines()]


def test_gelu_and_xla_attention_keep_for_the_backward_what_it_needs():
    """GELU: its input alone (jax.nn.gelu keeps three values its input's size); attention: the
    T x S probabilities once, in the inputs' dtype (jax.nn.dot_product_attention's autodiff
    keeps them in float32 and in bf16)."""
    from accel.backends.jax.ops import jax_gelu
    from accel.backends.jax.recomputed_attention import recomputed_attention

    x = jnp.ones((8, 16), jnp.bfloat16)
    assert saved_for_the_backward(lambda x: jax_gelu(x, False).sum(), x) == ["bf16[8,16]"]
    q, bias = jnp.ones((2, 7, 3, 4), jnp.bfloat16), jnp.ones((1, 3, 7, 7), jnp.bfloat16)
    kept = saved_for_the_backward(
        lambda q, b: recomputed_attention(q, q, q, b, None, 0.5, False).sum(), q, bias
    )
    by_scores = [t for t in kept if t.endswith(",7,7]")]
    assert by_scores == ["bf16[1,3,7,7]", "bf16[2,3,7,7]"]  # the bias given, the probabilities


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
