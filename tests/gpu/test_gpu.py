"""The GPU tier: what the CPU suite shows for the CUDA paths, on a CUDA GPU. Collected everywhere,
skipped with the reason where no CUDA device is visible (tests/conftest.py); each at most about a
minute on an H100. `python bench/gpu_check.py --stage tests` runs them on a GPU machine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from accel.backends import resolve_backend
from accel.cli.data.config import DataConfig, MixupConfig
from accel.cli.data.jpeg_decoders import make_decoder
from accel.cli.data.loaders import build_train_loader
from accel.cli.resolve import resolve_decode_on
from accel.cli.train import Trainer
from tests.helpers import dirty_mock_imagenet, micro_config, read_summary, run_cli, train_cli

pytestmark = pytest.mark.gpu
MIX = MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0)
BF16 = {"rtol": 2e-2, "atol": 2e-2}  # bf16 has 8 bits of mantissa: 1 part in 128, with margin


@pytest.fixture(scope="module")
def dirty_imagenet(tmp_path_factory) -> Path:
    """Real JPEGs with a truncated one, a CMYK one and a PNG among them."""
    return dirty_mock_imagenet(tmp_path_factory.mktemp("gpu-decode"), val_per_class=2)


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_torch_step_makes_no_host_sync_and_takes_pinned_side_stream_batches(
    backend, level, tmp_path
):
    cfg = micro_config(tmp_path, backend=backend, amp_level=level, steps=8)
    trainer = Trainer(cfg)
    engine = trainer.engine
    assert engine.pin_memory  # the loader hands over pinned host memory
    host = [b for _, b in zip(range(3), trainer.data.loader, strict=False)]
    assert all(b["images"].is_pinned() for b in host)
    batches = engine.loader((b["images"], b["targets"]) for b in host)
    warm = [next(batches) for _ in range(2)]
    for micro in ([warm[0]], [warm[1]]):  # warm-up: compiles and allocations may sync
        engine.step_micro_batches(micro)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            handle = engine.step_micro_batches([warm[0]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss, applied = engine.fetch([handle])[0]
    assert math.isfinite(loss) and applied


def test_nvjpeg_batches_match_the_cpu_path(dirty_imagenet):
    def epoch(decode_on: str, draft: bool = True) -> list:
        source = str(dirty_imagenet)
        cfg = DataConfig(source=source, workers=2, decode_on=decode_on, mixup=MIX, jpeg_draft=draft)
        loader = build_train_loader(cfg, 32, 4, (0, 1), seed=3, num_classes=3)
        loader.batch_sampler.set_epoch(1)
        return list(loader)

    # The CPU path at full decode: what the device decodes before its own resize.
    cpu, gpu = epoch("workers", draft=False), epoch("cuda")
    # nvJPEG and libjpeg-turbo (PIL) differ on their own, before any crop: 4.2-4.3 levels on
    # these images on an H200 (bench/jpeg_decode_diff.py), the resize 0.2. A crop, flip or mix
    # that went wrong differs by tens of levels; the same ones, by less than the decoders do.
    bound = decoder_gap(sorted(dirty_imagenet.glob("train/*/*.JPEG"))) + 1.0  # the good ones
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu, strict=True):
        assert b["images"].is_cuda
        assert torch.equal(b["targets"].cpu(), a["targets"])  # the same soft targets, exactly
        assert (b["images"].cpu().float() - a["images"].float()).abs().mean() < bound
        assert b["skipped"] == a["skipped"]
    skipped = {Path(p).name for batch in gpu for p in batch["skipped"]}
    assert skipped == {"truncated.jpg", "empty.jpg", "notes.png"}


def decoder_gap(files: list[Path]) -> float:
    """Mean absolute difference of the device's decoder from PIL's over whole images."""
    decoder = make_decoder(torch.device("cuda"))
    gaps = []
    for path in files:
        (image,) = decoder([torch.from_numpy(np.fromfile(path, dtype=np.uint8))])
        with Image.open(path) as img:
            pixels = torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)
        gaps.append((image.cpu().float() - pixels.float()).abs().mean().item())
    return sum(gaps) / len(gaps)


@pytest.mark.parametrize(
    ("tokens", "heads", "bias_batch"),
    [(197, 12, None), (49, 3, 1), (49, 3, 64)],  # ViT-B/16; Swin-T windows, plain and shifted
    ids=["vit-b16", "swin-window", "swin-shifted"],
)
def test_jax_takes_cudnn_flash_attention_and_matches_xla(tokens, heads, bias_batch):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from accel.backends.jax.attention import AttentionKernels

    keys = jax.random.split(jax.random.key(0), 4)
    batch = 64 if bias_batch == 64 else 8
    q, k, v = (jax.random.normal(kk, (batch, tokens, heads, 64), jnp.bfloat16) for kk in keys[:3])
    bias = None
    if bias_batch:
        bias = jax.random.normal(keys[3], (bias_batch, heads, tokens, tokens), jnp.bfloat16)
    kernels = AttentionKernels(flash=True)

    def flash(q, k, v):
        return kernels(q, k, v, bias, None, None, False).astype(jnp.float32).sum()

    def xla(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
        return out.astype(jnp.float32).sum()

    assert {d.platform for d in q.devices()} == {"gpu"}, "JAX fell back to its CPU platform"
    got = jax.grad(flash, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(xla, argnums=(0, 1, 2))(q, k, v)
    assert kernels.flash_calls > 0 and not kernels.refused, kernels.refused
    out = kernels(q, k, v, bias, None, None, False)
    ref = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **BF16)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **BF16)


@pytest.mark.parametrize("backend", ["eager", "compile", "jax"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("model", ["vit_micro", "swin_micro"])
def test_backend_by_amp_level_trains_five_finite_steps_on_cuda(backend, level, model, tmp_path):
    cfg = micro_config(tmp_path, backend=backend, model=model, amp_level=level, model_ema=True)
    summary = Trainer(cfg).train()
    assert len(summary["losses"]) == 5 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["compiles_after_warmup"] == 0
    assert summary["device"] != "CPU"
    if backend == "jax":  # torch sees the GPU either way: where did JAX's arrays live?
        assert summary["platform"] == "gpu", "JAX fell back to its CPU platform"


def test_a_jax_checkpoint_from_the_gpu_resumes_on_cpu_eager(tmp_path):
    job = ("--model", "vit_micro", "--steps", "4", "--batch_size", "8", "--workers", "0")
    trained, _ = train_cli(tmp_path / "gpu", *job, "--backend", "jax")
    checkpoint = next((tmp_path / "gpu").glob("vit_micro/jax/r/checkpoints/step_*.pt"))
    result = run_cli(
        *job, "--backend", "eager", "--resume", str(checkpoint), "--output", str(tmp_path / "cpu"),
        env={"CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert trained["platform"] == "gpu", "JAX fell back to its CPU platform"
    on_cpu = read_summary(tmp_path / "cpu")
    assert on_cpu["device"].startswith("CPU")
    assert on_cpu["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-3)


def test_use_accel_and_data_device_auto_choose_jax_and_the_gpu(tmp_path):
    assert resolve_backend(None, {"USE_ACCEL": "1"})[0] == "jax"
    root = dirty_mock_imagenet(tmp_path, val_per_class=1)
    cfg = micro_config(tmp_path, backend="jax", data=DataConfig(source=str(root)))
    assert resolve_decode_on(cfg, gpu_decoding=True) == ("cuda", None)
