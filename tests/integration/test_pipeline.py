"""--pp: a ViT cut into stages over gloo processes trains the losses of the uncut run (ViT-L on
every schedule is in test_scale.py); its checkpoints load into any other layout."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from accel.cli.export import main as export_main
from tests import nan_model
from tests.helpers import (
    checkpoint_tensors,
    nan_config,
    nan_rank,
    read_summary,
    same_state,
    train,
    train_ranks,
)

pytestmark = pytest.mark.slow

# 4 blocks: 2 stages, 4 with the interleaved schedule (two a rank) or over 4 ranks. Clipping is
# on by default: its norm spans the stages.
JOB = ("--model", "vit_micro_d4", "--steps", "6", "--batch_size", "8", "--workers", "0")
JOB += ("--log_every", "1", "--save_every", "2", "--pp_microbatches", "4")
JOB += ("--model_ema", "--model_ema_decay", "0.9")  # each stage's own EMA
PIPELINE = ("--nproc_per_node", "2", "--pp", "2")


def _run(output: Path, *extra: str) -> tuple[dict, str]:
    """The job; in this process where it is one process, through the command line otherwise."""
    several = "--nproc_per_node" in extra
    return (train_ranks if several else train)(output, *JOB, *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict, str]]:
    jobs = {
        "single": (),
        "interleaved": (*PIPELINE, "--pp_schedule", "interleaved"),
        "pp4": ("--nproc_per_node", "4", "--pp", "4", "--pp_schedule", "1f1b"),
        "ddp2": ("--nproc_per_node", "2"),
        "dp2xpp2": ("--nproc_per_node", "4", "--pp", "2"),
    }
    out = {}
    for name, extra in jobs.items():
        output = tmp_path_factory.mktemp(name)
        out[name] = (output, *_run(output, *extra))
    return out


@pytest.mark.parametrize(
    ("name", "mesh"),
    [("interleaved", "dp 1 x pp 2 (2 processes), interleaved"), ("pp4", "dp 1 x pp 4")],
)
def test_stages_train_and_evaluate_as_the_single_process(runs, name, mesh):
    _, single, _ = runs["single"]
    _, piped, stdout = runs[name]
    assert f"accel: mesh {mesh}" in stdout
    np.testing.assert_allclose(piped["losses"][:5], single["losses"][:5], rtol=1e-5)
    np.testing.assert_allclose(piped["eval_loss"], single["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(piped["eval_loss_ema"], single["eval_loss_ema"], rtol=1e-5)
    assert piped["global_batch_size"] == single["global_batch_size"] == 8


def test_dp2_by_pp2_trains_the_ddp_losses(runs):
    _, ddp, _ = runs["ddp2"]
    _, mesh, stdout = runs["dp2xpp2"]
    assert "accel: mesh dp 2 x pp 2 (4 processes)" in stdout
    np.testing.assert_allclose(mesh["losses"][:5], ddp["losses"][:5], rtol=1e-5)
    np.testing.assert_allclose(mesh["eval_loss"], ddp["eval_loss"], rtol=1e-5)


def _checkpoint(output: Path, step: int, kind: str = "dcp") -> Path:
    return output / "vit_micro_d4" / "eager" / "r" / "checkpoints" / f"step_{step:08d}.{kind}"


def test_four_stages_to_one_process_to_two_stages_evaluate_alike(runs, tmp_path):
    """Resharding: the 4-stage checkpoint loads into one process (which saves its ordinary
    file), and that file into 2 stages; nothing is trained on the way."""
    output, piped, _ = runs["pp4"]
    single, _ = _run(tmp_path / "one", "--resume", str(_checkpoint(output, 6)))
    np.testing.assert_allclose(single["eval_loss"], piped["eval_loss"], rtol=1e-5)
    again = ("--resume", str(_checkpoint(tmp_path / "one", 6, "pt")))
    two, _ = _run(tmp_path / "two", *PIPELINE, *again)
    np.testing.assert_allclose(two["eval_loss"], piped["eval_loss"], rtol=1e-5)
    for run in (single, two):  # each stage's EMA, carried whole through both reshardings
        np.testing.assert_allclose(run["eval_loss_ema"], piped["eval_loss_ema"], rtol=1e-5)
    assert two["losses"] == single["losses"] == piped["losses"]  # the saved run's, carried


def test_export_writes_a_sharded_checkpoint_as_one_file(runs, tmp_path):
    """accel-export: timm's weights as safetensors, and the ordinary one-file checkpoint, which
    resumes in one process as the folder does."""
    output, piped, _ = runs["pp4"]
    folder = _checkpoint(output, 6)
    assert export_main([str(folder), "--out", str(tmp_path / "w.safetensors")]) == 0
    weights, whole = load_file(tmp_path / "w.safetensors"), checkpoint_tensors(folder)
    assert {f"model.model.{k}" for k in weights} == {k for k in whole if k.startswith("model.")}
    assert all(torch.equal(v, whole[f"model.model.{k}"]) for k, v in weights.items())
    assert export_main([str(folder), "--out", str(tmp_path / "one.pt")]) == 0
    single, _ = _run(tmp_path / "one", "--resume", str(tmp_path / "one.pt"))
    np.testing.assert_allclose(single["eval_loss"], piped["eval_loss"], rtol=1e-5)


def test_a_pipeline_resumes_bit_for_bit_at_the_same_layout(runs, tmp_path):
    output, piped, _ = runs["pp4"]
    job = ("--nproc_per_node", "4", "--pp", "4", "--resume", str(_checkpoint(output, 2)))
    resumed, _ = _run(tmp_path, *job)
    assert resumed["losses"] == piped["losses"]


def test_autocast_reaches_every_stages_weights(tmp_path):
    """O1 through the pipeline: the stages' first, shape-inferring pass must not leave cached
    weight casts without a graph behind them (no gradient would reach the weights)."""
    single, _ = _run(tmp_path / "single", "--amp_level", "O1", "--steps", "3")
    piped, _ = _run(tmp_path / "piped", *PIPELINE, "--amp_level", "O1", "--steps", "3")
    np.testing.assert_allclose(piped["losses"], single["losses"], rtol=2e-3)


def test_a_non_finite_step_is_skipped_on_every_stage(tmp_path, one_white_image, free_port):
    """--nan_policy skip through the pipeline: the loss of the batch with the white image is
    NaN on the last stage only; every stage leaves its weights and AdamW state as they were."""
    cfg = nan_config(
        tmp_path,
        "eager",
        one_white_image,
        nan_policy="skip",
        name=nan_model.PIPELINE_NAME,
        nproc_per_node=2,
        pp=2,
        pp_microbatches=2,
    )
    mp.start_processes(nan_rank, args=(cfg, free_port()), nprocs=2, start_method="forkserver")
    summary = read_summary(tmp_path)
    steps = summary["nonfinite_steps"]
    assert len(steps) == 2 and summary["steps"] == 8
    checkpoints = cfg.run_dir() / "checkpoints"
    states = {s: checkpoint_tensors(checkpoints / f"step_{s:08d}.dcp") for s in range(1, 9)}
    for step in (s for s in steps if s > 1):
        assert same_state(states[step], states[step - 1]), step
    applied = next(s for s in range(2, 9) if s not in steps)
    assert not same_state(states[applied], states[applied - 1])
