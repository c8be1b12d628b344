"""The jax backend's fused window attention (one Pallas kernel forward, one backward), run by
Pallas's interpreter on the CPU, against attention written out by hand in float32: the output
and the gradients of q, k, v and the bias at Swin-T's shapes (49 tokens, head dim 32, 3 to 24
heads, a bias shared by the batch or one per window with a shifted window's -100s) and at other
token counts; and what `supports` refuses. Small batches: the interpreter is slow."""

import pytest

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax
import jax.numpy as jnp
import numpy as np

try:
    import accel.backends.jax.window_attention as window_attention
except ImportError as err:  # a jax without Pallas's Triton API
    pytest.skip(f"Pallas is not available: {err}", allow_module_level=True)

from accel.backends.jax.window_attention import fused_attention, sequence_group, supports


def plain_attention(q, k, v, bias, scale):
    """softmax(q k^T * scale + bias) v over [B, T, heads, D], in float32."""
    f32 = jnp.float32
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(f32), k.astype(f32)) * scale
    if bias is not None:
        logits = logits + bias.astype(f32)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v.astype(f32))


def _inputs(batch, tokens, heads, dim, bias_shape, dtype=jnp.float32, shifted=False, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q, k, v, cotangent = (
        jax.random.normal(key, (batch, tokens, heads, dim), jnp.float32).astype(dtype)
        for key in keys[:4]
    )
    bias = None
    if bias_shape is not None:
        bias = jax.random.normal(keys[4], bias_shape, jnp.float32)
        if shifted:  # a shifted window's mask, added to the relative-position bias as timm does
            bias = bias + jnp.where(jax.random.bernoulli(keys[5], 0.3, bias_shape), -100.0, 0.0)
        bias = bias.astype(dtype)
    return q, k, v, bias, cotangent


def _forward_and_grads(attention, q, k, v, bias, cotangent):
    """The output and the gradients of q, k, v and the bias, as one compiled program."""

    def run(q, k, v, bias):
        out, pullback = jax.vjp(attention, q, k, v, bias)
        return out, pullback(cotangent)

    return jax.jit(run)(q, k, v, bias)


def _check(q, k, v, bias, cotangent, scale, tolerance):
    fused = _forward_and_grads(
        lambda q, k, v, b: fused_attention(q, k, v, b, scale, interpret=True),
        q,
        k,
        v,
        bias,
        cotangent,
    )
    # The reference from the same (rounded) inputs, in float32 throughout.
    wide = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, bias, cotangent)]
    plain = _forward_and_grads(lambda q, k, v, b: plain_attention(q, k, v, b, scale), *wide)
    (out, grads), (want, expected) = fused, plain
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out.astype(jnp.float32), want, **tolerance, err_msg="out")
    for name, got, exact, like in zip("qkvb", grads, expected, (q, k, v, bias), strict=True):
        if like is None:
            assert got is None
            continue
        assert got.shape == like.shape and got.dtype == like.dtype, name
        np.testing.assert_allclose(got.astype(jnp.float32), exact, **tolerance, err_msg=name)


TIGHT = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def two_groups(monkeypatch):
    """A shared bias's batch taken two sequences a program: the kernels' loop over a group and
    the bias gradient's partial sums over groups, at batch 4."""
    monkeypatch.setattr(window_attention, "MIN_PROGRAMS", 1)
    monkeypatch.setattr(window_attention, "MAX_GROUP", 2)


@pytest.mark.parametrize("heads", [3, 6, 12, 24])  # Swin-T's four stages
@pytest.mark.parametrize("bias_kind", ["shared", "shifted windows"])
def test_swin_t_windows_equal_plain_attention(heads, bias_kind, two_groups):
    batch, tokens, dim = 4, 49, 32
    shared = bias_kind == "shared"
    bias_shape = (1 if shared else batch, heads, tokens, tokens)
    if shared:
        assert sequence_group(batch, heads) == 2
    inputs = _inputs(batch, tokens, heads, dim, bias_shape, shifted=not shared, seed=heads)
    with jax.default_matmul_precision("highest"):
        _check(*inputs, scale=dim**-0.5, tolerance=TIGHT)


@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "dim", "bias_shape", "scale"),
    [
        (3, 16, 2, 16, (2, 16, 16), 0.3),  # one sequence a program; a bias without its batch axis
        (2, 64, 2, 64, (2, 1, 64, 64), None),  # a tile with no padding; one bias for all heads
        (2, 100, 1, 16, (100, 100), None),  # 128-row tiles (8 warps), one bias for everything
        (2, 7, 2, 32, None, None),  # no bias; 7 tokens in a 16-row tile
    ],
)
def test_other_token_counts_and_bias_shapes(batch, tokens, heads, dim, bias_shape, scale):
    inputs = _inputs(batch, tokens, heads, dim, bias_shape)
    with jax.default_matmul_precision("highest"):
        _check(*inputs, scale=dim**-0.5 if scale is None else scale, tolerance=TIGHT)


def test_bf16_swin_window_with_shift_mask():
    heads, tokens = 3, 49
    inputs = _inputs(2, tokens, heads, 32, (2, heads, tokens, tokens), jnp.bfloat16, True)
    # bf16 outputs, and the probabilities and ds in bf16 in the matmuls, as flash attention's
    _check(*inputs, scale=32**-0.5, tolerance={"rtol": 2e-2, "atol": 3e-2})


def test_the_group_divides_the_batch_and_keeps_the_grid_wide():
    assert sequence_group(8192, 3) == 16  # Swin-T stage 1: 1536 programs
    assert sequence_group(2048, 6) == 8
    assert sequence_group(512, 12) == 4
    assert sequence_group(128, 24) == 2
    assert sequence_group(7, 3) == 1  # too few programs to share out
    assert sequence_group(8192 * 3, 1) == 16  # 16 divides it
    assert sequence_group(13 * 1024, 1) == 13  # the largest divisor up to 16, not a power of two


def _spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


SWIN = (128, 49, 3, 32)


@pytest.mark.parametrize(
    ("query", "key", "bias", "mask", "causal", "reason"),
    [
        (SWIN, SWIN, None, (1, 1, 49, 49), False, "boolean mask"),
        (SWIN, SWIN, None, None, True, "causal"),
        ((128, 197, 12, 64), (128, 197, 12, 64), None, None, False, "197 tokens"),
        (SWIN, (128, 64, 3, 32), None, None, False, "not self-attention"),
        (SWIN, (128, 49, 1, 32), None, None, False, "not self-attention"),  # grouped heads
        ((128, 49, 3, 48), (128, 49, 3, 48), None, None, False, "head dim 48"),
        ((49, 3, 32), (49, 3, 32), None, None, False, "rank 3"),
        (SWIN, SWIN, (2, 3, 49, 49), None, False, "bias (2, 3, 49, 49)"),  # batch neither 1 nor B
        (SWIN, SWIN, (1, 2, 49, 49), None, False, "bias (1, 2, 49, 49)"),
        (SWIN, SWIN, (1, 3, 1, 49), None, False, "bias (1, 3, 1, 49)"),  # broadcast over queries
        (SWIN, SWIN, (1, 128, 3, 49, 49), None, False, "bias (1, 128, 3, 49, 49)"),
    ],
)
def test_supports_refuses_what_the_kernel_cannot_take(query, key, bias, mask, causal, reason):
    said = supports(
        _spec(query),
        _spec(key),
        None if bias is None else _spec(bias),
        None if mask is None else _spec(mask, jnp.bool_),
        causal,
    )
    assert said is not None and reason in said, said


def test_supports_refuses_dtypes_and_takes_swin_t():
    q = _spec(SWIN, jnp.bfloat16)
    double = _spec(SWIN, jnp.float64)
    assert "dtypes" in supports(double, double, None, None, False)
    assert "dtypes" in supports(q, _spec(SWIN), None, None, False)
    assert "bias of dtype" in supports(q, q, _spec((1, 3, 49, 49), jnp.int32), None, False)
    for bias in (None, (1, 3, 49, 49), (128, 3, 49, 49), (3, 49, 49), (49, 49), (128, 1, 49, 49)):
        assert supports(q, q, None if bias is None else _spec(bias), None, False) is None


def test_fused_attention_raises_for_what_it_does_not_take():
    q, k, v, bias, _ = _inputs(2, 49, 3, 32, (1, 3, 49, 49))
    with pytest.raises(ValueError, match="197 tokens"):
        wide = jnp.zeros((2, 197, 3, 32))
        fused_attention(wide, wide, wide, interpret=True)
    with pytest.raises(ValueError, match="value"):
        fused_attention(q, k, v[:, :16], bias, interpret=True)


def _swin_losses(attention: str | None, amp: str = "O0") -> tuple[list[float], dict]:
    """Three AdamW steps of a two-stage Swin whose first stage has a shifted block (a window
    bias and shift mask per window), on jax with `attention` (or on eager: None)."""
    import timm
    import torch

    import accel
    from accel.cli.models.factory import fused_attention as through_sdpa

    torch.manual_seed(0)
    model = timm.create_model("swin_micro", depths=(2, 1))  # 16-token windows, heads of 16
    through_sdpa(model)  # timm's window attention through scaled_dot_product_attention
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])  # noqa: E731
    options = {"backend": "eager"} if attention is None else {"backend": "jax"}
    options |= {"attention": attention} if attention else {}
    engine = accel.prepare(model, optimizer, loss_fn, amp=amp, quiet=True, **options)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (4,), generator=generator)
    losses = [r.loss for r in engine.fetch([engine.step(images, labels) for _ in range(3)])]
    details = engine.stats().details if attention else {}
    return losses, details


def test_a_swin_step_trains_on_the_fused_kernel_as_on_xlas_attention_and_eager():
    amp = "O0"  # float32 (bf16 inputs: test_bf16_swin_window_with_shift_mask)
    fused, details = _swin_losses("pallas", amp)
    shapes = details["attention_shapes"].values()
    assert {s["ran"] for s in shapes} == {"pallas"}  # every window, the shifted ones included
    names = " ".join(details["attention_shapes"])
    assert "bias (1, 2, 16, 16)" in names and "bias (64, 2, 16, 16)" in names  # shared, shifted
    assert details["pallas_attention_calls"] == 3  # two blocks of stage 1, one of stage 2
    plain, _ = _swin_losses("xla", amp)
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
    np.testing.assert_allclose(fused, _swin_losses(None)[0], rtol=1e-4)  # and eager's
