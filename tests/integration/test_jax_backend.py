"""The jax backend on JAX's CPU platform, through torchax: real JAX, real compiles."""

import math

import pytest
import torch

pytest.importorskip("jax", reason="jax is not installed: pip install 'accel[jax]'")

from accel.backends import jax as jax_backend
from accel.backends.base import BackendUnavailable
from accel.backends.jax import runtime as jax_runtime
from accel.checkpoint import to_cpu
from accel.cli.checkpoints import latest_checkpoint
from accel.cli.data.config import MixupConfig
from accel.cli.data.loaders import build_eval_loader
from accel.cli.task import classifier_metrics, summarise
from accel.cli.train import Trainer
from tests.helpers import (
    TWO_HOST_DEVICES,
    job_backend,
    micro_config,
    run_cli_without,
    train_forked,
    xla_flags,
)

pytestmark = pytest.mark.slow  # each test compiles its own jax step

MIXUP = MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0)


def _train(tmp_path, backend: str, model: str = "vit_micro", **kw) -> dict:
    cfg = micro_config(
        tmp_path, backend=backend, model=model, synthetic_length=100, mixup=MIXUP, **kw
    )
    return Trainer(cfg).train()


@pytest.mark.parametrize("model", ["vit_micro", "swin_micro"])
def test_two_forced_host_devices_train_with_mixup_without_recompiles(tmp_path, model):
    summary, _ = train_forked(  # the devices of a JAX of its own
        tmp_path, "--backend", "jax", "--nproc_per_node", "2", "--model", model,
        "--steps", "12", "--batch_size", "8", "--mixup", "0.8", "--cutmix", "1.0",
        "--synthetic_length", "100", "--workers", "0",
        env={"XLA_FLAGS": xla_flags(TWO_HOST_DEVICES)},
    )  # fmt: skip
    assert summary["devices"] == 2 and summary["world_size"] == 2
    assert summary["global_batch_size"] == 16
    assert summary["compiles_after_warmup"] == 0 and summary["graphs_compiled"] == 1
    assert len(summary["losses"]) == 12 and all(math.isfinite(x) for x in summary["losses"])


def _eval_loss(backend, cfg) -> float:
    loader = build_eval_loader(cfg.data, 32, cfg.batch_size, (0, 1), cfg.seed, 10)
    batches = ((b["images"], b["labels"], b["mask"]) for b in loader)
    return summarise(backend.evaluate_sums(batches, classifier_metrics))["eval_loss"]


def test_checkpoints_cross_between_jax_and_eager(tmp_path):
    summary = _train(tmp_path, "jax", eval=True)
    saved = torch.load(latest_checkpoint(tmp_path / "vit_micro" / "jax" / "t"), weights_only=True)
    cfg = micro_config(tmp_path, synthetic_length=100)
    eager = job_backend(cfg)
    eager.load_checkpoint_state(saved["state"])  # weights and AdamW moments by name
    assert _eval_loss(eager, cfg) == pytest.approx(summary["eval_loss"], rel=1e-5)
    steps = {int(s["step"]) for s in eager.core.optimizer.state.values()}
    assert steps == {5}

    back = job_backend(micro_config(tmp_path, backend="jax"))
    back.load_checkpoint_state(to_cpu(eager.checkpoint_state()))
    assert _eval_loss(back, cfg) == pytest.approx(summary["eval_loss"], rel=1e-5)
    steps = {int(s["step"]) for s in to_cpu(back.checkpoint_state())["optim"].values()}
    assert steps == {5}


def test_an_op_torchax_cannot_lower_is_named_with_the_model(tmp_path, monkeypatch):
    jax_backend.require()  # torchax, imported through the compatibility shim
    env = jax_runtime.torchax.default_env()
    # As if torchax had no lowering of cat (which accel does not lower itself), for a job of
    # its own (seed): another test's engine may have kept the step, which loads untraced.
    monkeypatch.delitem(env._ops, torch.ops.aten.cat)
    with pytest.raises(BackendUnavailable, match=r"vit_micro.*aten::cat"):
        _train(tmp_path, "jax", steps=1, seed=4321)


def test_missing_jax_is_one_line_with_the_install_command(tmp_path):
    result = run_cli_without("jax", "--backend", "jax", "--steps", "1", "--output", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "pip install 'accel[jax]'" in result.stderr


def _two_step_losses(tmp_path, drop_path: float) -> list[float]:
    """Losses of two steps with lr 0 (weights unchanged) on one fixed batch."""
    cfg = micro_config(tmp_path, backend="jax", model="swin_micro", drop_path_rate=drop_path)
    backend = job_backend(cfg)
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=gen)
    targets = torch.softmax(torch.randn(8, 10, generator=gen), -1)
    (batch,) = backend.device_batches([(images, targets)])
    handles = [backend.train_step([batch], lr=0.0) for _ in range(2)]
    return [r.loss for r in backend.fetch_results(handles)]


def test_stochastic_depth_trains_with_new_draws_each_step_reproducibly(tmp_path):
    plain = _two_step_losses(tmp_path, 0.0)
    assert plain[0] == plain[1]  # lr 0 leaves the weights as they were
    dropped = _two_step_losses(tmp_path, 0.5)
    assert dropped[0] != dropped[1]  # train mode, and a fresh key per step
    assert dropped[0] != plain[0]
    assert _two_step_losses(tmp_path, 0.5) == dropped  # from the seed and step count alone
