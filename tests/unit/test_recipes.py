"""--recipe: the published values under explicit options, the learning rate scaled by the paper's
rule, and the resolved values said in the first lines of the log."""

from __future__ import annotations

import pytest

from accel.cli.config import RECIPE_NAMES
from accel.cli.options import build_parser, config_from_args
from accel.cli.recipes import RECIPES, describe


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_every_recipe_is_an_option():
    assert set(RECIPES) == set(RECIPE_NAMES)


def test_swin_tiny_sets_the_papers_values_and_scales_the_lr_linearly():
    cfg = parse("--recipe", "swin_tiny_in1k", "--batch_size", "128", "--nproc_per_node", "8")
    assert cfg.model.name == "swin_tiny_patch4_window7_224"
    assert (cfg.epochs, cfg.optim.warmup_epochs, cfg.model.drop_path_rate) == (300, 20.0, 0.2)
    assert cfg.data.aa == "rand-m9-mstd0.5-inc1" and cfg.data.reprob == 0.25
    assert (cfg.data.mixup.mixup_alpha, cfg.data.mixup.cutmix_alpha) == (0.8, 1.0)
    assert cfg.data.label_smoothing == 0.1 and cfg.optim.weight_decay == 0.05
    assert cfg.optim.lr == pytest.approx(5e-4 * 1024 / 512)  # global batch 8 x 128


def test_explicit_options_win_and_an_explicit_lr_is_not_scaled():
    cfg = parse("--recipe", "deit_base_in1k", "--reprob", "0", "--lr", "1e-3", "--steps", "10")
    assert cfg.data.reprob == 0.0 and cfg.optim.lr == 1e-3
    assert cfg.steps == 10 and cfg.epochs is None  # --steps sets the length
    assert cfg.optim.model_ema and cfg.optim.model_ema_decay == 0.99996
    assert cfg.data.aug_repeats == 3


def test_fine_tuning_recipe_starts_from_weights_with_layer_decay():
    cfg = parse("--recipe", "vit_finetune", "--batch_size", "64", "--grad_accum", "2")
    assert cfg.model.pretrained and cfg.optim.layer_decay == 0.65
    assert cfg.optim.lr == pytest.approx(5e-4 * 128 / 256)


def test_the_log_opens_with_the_resolved_recipe():
    cfg = parse("--recipe", "swin_tiny_in1k", "--batch_size", "64", "--drop_path", "0.1")
    first, values = describe(cfg)
    assert "swin_tiny_in1k" in first and "Swin Transformer" in first
    assert "linear rule" in first and "global batch 64 / 512" in first
    assert "drop_path_rate 0.1" in values and "aa rand-m9-mstd0.5-inc1" in values
