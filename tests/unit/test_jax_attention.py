"""The padded attention path of the jax backend (what cuDNN flash attention gets on a GPU), run
through XLA's implementation on the CPU, against attention written out by hand; and the choice
of attention (auto, cudnn, xla) per shape, from prepare's keyword and the command line's flag."""

import warnings

import pytest
import torch

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

import jax
import jax.numpy as jnp
import numpy as np

import accel
import accel.backends.jax.attention as jax_attention
from accel.backends.jax.attention import AttentionKernels, auto_choice, padded_attention
from accel.cli.job import backend_config
from accel.cli.options import build_parser, config_from_args


def plain_attention(q, k, v, bias):
    """softmax(q k^T / sqrt(d) + bias) v over [B, T, heads, D]."""
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1]) + bias
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)


def _inputs(tokens: int, bias_batch: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (2, tokens, 3, 16), jnp.float32) for kk in keys[:3])
    bias = jax.random.normal(keys[3], (bias_batch, 3, tokens, tokens), jnp.float32)
    return q, k, v, bias


@pytest.mark.parametrize(
    ("tokens", "bias_batch"),
    [(197, 1), (49, 2)],  # ViT-B/16's tokens; a Swin window with a per-window (shift) bias
)
def test_padded_path_equals_plain_attention_forward_and_gradients(tokens, bias_batch):
    q, k, v, bias = _inputs(tokens, bias_batch)

    def padded(q, k, v, bias):
        return padded_attention(q, k, v, bias=bias, implementation="xla")

    # Each path and its gradients as one compiled program, as a step runs them: op by op, the
    # CPU compiles every primitive on its own (seconds for one test).
    def forward_and_grads(attention, cotangent):
        out, pullback = jax.vjp(attention, q, k, v, bias)
        return out, pullback(cotangent)

    compiled = jax.jit(forward_and_grads, static_argnums=0)
    cotangent = jax.random.normal(jax.random.key(7), q.shape)
    with jax.default_matmul_precision("highest"):
        out, grads = compiled(padded, cotangent)
        plain, expected = compiled(plain_attention, cotangent)
    assert out.shape == q.shape
    np.testing.assert_allclose(out, plain, rtol=1e-6, atol=1e-6)
    for name, got, want in zip(("q", "k", "v", "bias"), grads, expected, strict=True):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_shape_cudnn_refuses_falls_back_to_xla_once_named():
    # No cuDNN on this machine: every flash attempt is refused, as an unsupported shape would be.
    kernels = AttentionKernels(flash=True, choice="cudnn")
    q, k, v, bias = (x.astype(jnp.bfloat16) for x in _inputs(49, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = kernels(q, k, v, bias, None, None, False)
        second = kernels(q, k, v, bias, None, None, False)
    refusals = [w for w in caught if "cuDNN flash attention refused" in str(w.message)]
    assert len(refusals) == 1
    assert "49 tokens" in str(refusals[0].message) and "bias (1, 3, 49, 49)" in str(
        refusals[0].message
    )
    np.testing.assert_array_equal(first, second)
    expected = plain_attention(*(x.astype(jnp.float32) for x in (q, k, v, bias)))
    np.testing.assert_allclose(first.astype(jnp.float32), expected, atol=3e-2)
    assert kernels.stats()["attention"] == "xla" and kernels.flash_calls == 0


@pytest.mark.parametrize(
    ("tokens", "head_dim", "biased", "expected"),
    [
        (49, 32, True, "pallas"),  # Swin-T's windows: the fused window kernel
        (128, 32, True, "pallas"),
        (144, 32, True, "xla"),  # Swin-B/384's: beyond one tile, a bias sends them to XLA
        (49, 64, False, "xla"),
        (127, 64, False, "xla"),
        (128, 64, False, "cudnn"),
        (197, 64, False, "cudnn"),  # ViT-B/16
        (197, 256, False, "xla"),
    ],
)
def test_auto_picks_by_tokens_head_dim_and_bias(tokens, head_dim, biased, expected):
    assert auto_choice(tokens, head_dim, biased).implementation == expected


@pytest.fixture
def flash_spy(monkeypatch):
    """padded_attention as if cuDNN took it (XLA's implementation underneath), counted."""
    calls = []

    def spy(query, key, value, bias=None, mask=None, scale=None, is_causal=False):
        calls.append(query.shape)
        return padded_attention(query, key, value, bias, mask, scale, is_causal, "xla")

    monkeypatch.setattr(jax_attention, "padded_attention", spy)
    return calls


@pytest.fixture
def pallas_spy(monkeypatch):
    """The fused window kernel as if on a GPU (through Pallas's interpreter here), counted."""
    calls = []
    fused = jax_attention.window_attention.fused_attention

    def spy(query, key, value, bias=None, scale=None, interpret=False):
        calls.append((query.shape, interpret))
        return fused(query, key, value, bias, scale, interpret=True)

    monkeypatch.setattr(jax_attention.window_attention, "fused_attention", spy)
    return calls


def _bf16(tokens: int):
    return (x.astype(jnp.bfloat16) for x in _inputs(tokens, 1))


def test_auto_sends_unbiased_sequences_to_cudnn_biased_windows_to_pallas(flash_spy, pallas_spy):
    kernels = AttentionKernels(flash=True, choice="auto")  # as on a GPU
    for tokens, biased in ((197, False), (49, True), (49, True), (197, True)):
        q, k, v, bias = _bf16(tokens)
        kernels(q, k, v, bias if biased else None, None, None, False)
    assert [shape[1] for shape in flash_spy] == [197]  # the unbiased one only
    # the biased windows, compiled for the GPU (not interpreted)
    assert [(shape[1], interpret) for shape, interpret in pallas_spy] == [(49, False)] * 2
    stats = kernels.stats()
    assert stats["attention"] == "cudnn+pallas+xla" and stats["attention_choice"] == "auto"
    assert stats["pallas_attention_calls"] == 2 and stats["flash_attention_calls"] == 1
    by_shape = {(s["tokens"], "bias" in name): s for name, s in stats["attention_shapes"].items()}
    vit, swin, biased_vit = by_shape[197, False], by_shape[49, True], by_shape[197, True]
    assert vit["ran"] == "cudnn" and vit["cudnn_padded_tokens"] == 208
    assert swin["chose"] == swin["ran"] == "pallas" and biased_vit["ran"] == "xla"
    assert swin["calls"] == 2 and swin["why"].startswith("auto: a bias on short windows")


def test_auto_without_a_gpu_runs_biased_windows_on_xla(pallas_spy):
    kernels = AttentionKernels(flash=False, choice="auto")  # the CPU
    q, k, v, bias = _bf16(49)
    kernels(q, k, v, bias, None, None, False)
    (shape,) = kernels.stats()["attention_shapes"].values()
    assert pallas_spy == [] and (shape["chose"], shape["ran"]) == ("pallas", "xla")
    assert "no CUDA GPU here" in shape["why"]


def test_pallas_by_name_runs_the_fused_kernel_interpreted_without_a_gpu():
    kernels = AttentionKernels(flash=False, choice="pallas")
    q, k, v, bias = _inputs(49, 2)  # a per-window bias, float32
    out = kernels(q, k, v, bias, None, None, False)
    (shape,) = kernels.stats()["attention_shapes"].values()
    assert (shape["chose"], shape["ran"]) == ("pallas", "pallas")
    assert "interpreter" in shape["why"] and kernels.pallas_calls == 1
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(out, plain_attention(q, k, v, bias), rtol=1e-5, atol=1e-5)


def test_pallas_leaves_what_the_kernel_does_not_take_to_xla_saying_why(pallas_spy):
    kernels = AttentionKernels(flash=True, choice="pallas")
    q, k, v, bias = _bf16(197)  # ViT-B/16's tokens: beyond one tile
    kernels(q, k, v, bias, None, None, False)
    q, k, v, _ = _bf16(49)
    kernels(q, k, v, None, jnp.ones((1, 1, 49, 49), jnp.bool_), None, False)  # a boolean mask
    whys = [s["why"] for s in kernels.stats()["attention_shapes"].values()]
    assert pallas_spy == [] and {
        s["ran"] for s in kernels.stats()["attention_shapes"].values()
    } == {"xla"}
    assert any("197 tokens (at most 128" in why for why in whys)
    assert any("a boolean mask" in why for why in whys)


def test_xla_never_calls_the_flash_path(flash_spy):
    kernels = AttentionKernels(flash=True, choice="xla")
    for tokens in (197, 49):
        q, k, v, bias = _bf16(tokens)
        out = kernels(q, k, v, bias, None, None, False)
        want = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
        # jax's own arithmetic, fused apart (its backward is the backend's): a bf16 rounding
        # at most (tests/unit/test_jax_ops.py checks values and gradients against torch's)
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-3
        )
    assert flash_spy == [] and kernels.flash_calls == 0
    assert {s["ran"] for s in kernels.stats()["attention_shapes"].values()} == {"xla"}


def test_cudnn_without_a_gpu_runs_xla_and_says_what_it_would_have_taken(flash_spy):
    kernels = AttentionKernels(flash=False, choice="cudnn")  # the CPU: no cuDNN
    q, k, v, bias = _bf16(49)
    kernels(q, k, v, bias, None, None, False)
    (shape,) = kernels.stats()["attention_shapes"].values()
    assert flash_spy == [] and (shape["chose"], shape["ran"]) == ("cudnn", "xla")
    assert "no cuDNN here" in shape["why"]


class Attend(torch.nn.Module):
    """Self-attention over `tokens` tokens of width 32 (4 heads of 8) through torch's SDPA."""

    def __init__(self, tokens: int):
        super().__init__()
        self.embed, self.tokens = torch.nn.Linear(4, 32 * tokens), tokens

    def forward(self, x):
        h = self.embed(x).view(x.shape[0], 4, self.tokens, 8)
        return torch.nn.functional.scaled_dot_product_attention(h, h, h).mean((1, 2, 3))


def _prepare(model, **options):
    loss_fn = lambda m, batch: (m(batch[0]) ** 2).mean()  # noqa: E731
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accel.prepare(model, optimizer, loss_fn, backend="jax", quiet=True, **options)


def test_prepare_takes_the_attention_keyword_and_the_step_says_what_each_shape_took():
    engine = _prepare(Attend(197), attention="xla", amp="O1")
    engine.fetch([engine.step(torch.randn(2, 4))])
    details = engine.stats().details
    assert details["attention_choice"] == "xla"
    (shape,) = details["attention_shapes"].values()
    assert shape["tokens"] == 197 and (shape["chose"], shape["ran"]) == ("xla", "xla")


def test_prepare_defaults_to_auto_and_refuses_an_unknown_attention_in_one_line():
    assert _prepare(Attend(49)).stats().details["attention_choice"] == "auto"
    with pytest.raises(
        accel.AccelError, match=r"^attention must be one of auto, cudnn, pallas, xla, got 'flash'$"
    ):
        _prepare(Attend(49), attention="flash")


def test_the_attention_flag_reaches_the_step_config():
    parse = lambda *argv: config_from_args(build_parser().parse_args(list(argv)))  # noqa: E731
    assert backend_config(parse()).step.attention == "auto"
    assert backend_config(parse("--attention", "xla")).step.attention == "xla"
    with pytest.raises(SystemExit):
        parse("--attention", "flash")
