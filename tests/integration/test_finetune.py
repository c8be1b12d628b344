"""EMA, layer decay, random erasing, evaluation-only runs, weights handed to timm and taken back:
the same on every backend, each run started once for the module."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import timm
import torch

from accel.backends.base import BackendStats
from accel.cli.export import main as export_main
from accel.cli.job import parameter_settings
from accel.cli.launch import main
from accel.cli.models.factory import ModelConfig, create_model, meta_model
from accel.report.run_records import Run, run_row
from accel.report.summary import RunSummary
from tests.helpers import (
    INSTALLED,
    job_backend,
    launch,
    micro_config,
    read_summary,
    run_cli,
    run_python,
    train,
)

# Without torch_xla (make test-latest) the other three, and the xla cases skip; CI requires it.
BACKENDS = INSTALLED
JOB = ("--model", "vit_micro", "--steps", "5", "--batch_size", "8", "--workers", "0")
JOB += ("--model_ema", "--model_ema_decay", "0.5", "--reprob", "0.5", "--layer_decay", "0.75")
JOB += ("--lr", "3e-3", "--log_every", "1")


def _checkpoint(output: Path, backend: str) -> Path:
    return output / "vit_micro" / backend / "r" / "checkpoints" / "step_00000005.pt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    out = {}
    for backend in BACKENDS:
        output = tmp_path_factory.mktemp(backend)
        out[backend] = output, train(output, *JOB, "--backend", backend)[0]
    return out


def _ema(output: Path, backend: str) -> dict[str, torch.Tensor]:
    return torch.load(_checkpoint(output, backend), weights_only=True)["state"]["ema"]


@pytest.mark.parametrize("backend", ["compile", pytest.param("xla", marks=pytest.mark.xla), "jax"])
def test_ema_agrees_with_eager_within_the_losses_tolerance(runs, backend):
    (eager_out, eager), (output, other) = runs["eager"], runs[backend]
    assert other["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    want, got = _ema(eager_out, "eager"), _ema(output, backend)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=1e-4, msg=name)
    assert other["eval_loss_ema"] == pytest.approx(eager["eval_loss_ema"], rel=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_reports_the_typed_stats_the_report_reads(runs, backend):
    summary = runs[backend][1]
    for name in (f.name for f in dataclasses.fields(BackendStats) if f.name != "details"):
        assert name in summary, name
    compiler = backend in ("xla", "jax")  # the backends that time their compiles
    assert (summary["compile_time_s"] > 0) if compiler else summary["compile_time_s"] is None
    assert summary["graphs_compiled"] >= (1 if backend != "eager" else 0)
    typed = RunSummary.from_dict(summary)  # as the report reads it: every field back in place
    assert typed.to_dict() == summary and "details" not in summary
    run = Run("vit_micro", backend, "r", typed)
    assert run_row(run)["compile_s"] == summary["compile_time_s"]
    # One evaluation path: the command line's metric through each backend's evaluate_sums.
    assert summary["eval_images"] > 0
    assert summary["eval_loss"] == pytest.approx(runs["eager"][1]["eval_loss"], rel=1e-3)


def test_the_ema_is_its_own_weights_and_is_evaluated_beside_them(runs):
    output, summary = runs["eager"]
    state = torch.load(_checkpoint(output, "eager"), weights_only=True)["state"]
    moved = [not torch.equal(state["ema"][n], state["model"][n]) for n in state["ema"]]
    assert all(moved)  # decay 0.5 over 5 steps: behind the live weights
    for key in ("eval_loss_ema", "eval_acc_ema", "eval_acc5_ema"):
        assert math.isfinite(summary[key])
    assert summary["eval_acc5"] >= summary["eval_acc"]


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_layer_decay_gives_each_parameter_timms_learning_rate_scale(backend, tmp_path):
    cfg = micro_config(tmp_path, backend=backend, model="vit_micro_d4", layer_decay=0.75)
    backend_ = job_backend(cfg)
    model = meta_model(cfg.model)
    groups = timm.optim.param_groups_layer_decay(
        model.model, 0.05, model.model.no_weight_decay(), layer_decay=0.75
    )
    names = {id(p): f"model.{n}" for n, p in model.model.named_parameters()}
    want = {names[id(p)]: g["lr_scale"] for g in groups for p in g["params"]}
    if backend == "jax":
        translated = backend_.optimizer  # optax, one chain per group, each at its own rate
        rates = translated.rates(1e-3)["lr"].tolist()
        groups = zip(translated.spec.groups, rates, strict=True)
        got = {n: r / 1e-3 for g, r in groups for n in g.names}
    else:
        backend_.core.update(1e-3, torch.tensor(1.0), 0.0, lambda _: torch.tensor(0.0))
        by_id = {id(p): n for n, p in backend_.core.modules[0].named_parameters()}
        got = {
            by_id[id(p)]: g["lr"] / 1e-3
            for g in backend_.core.optimizer.param_groups
            for p in g["params"]
        }
    assert got == pytest.approx(want, rel=1e-6)
    assert len(set(want.values())) == 6  # embeddings, 4 blocks, head: each its own scale
    assert parameter_settings(model, cfg.optim)["model.head.weight"][0] == 1.0


def _logits(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(images)


@pytest.mark.parametrize("section", ["model", "ema"])
def test_an_export_loads_in_timm_and_gives_the_same_logits(runs, tmp_path, section):
    output, _ = runs["eager"]
    out = tmp_path / "weights.safetensors"
    flags = ["--ema"] if section == "ema" else []
    assert export_main([str(_checkpoint(output, "eager")), "--out", str(out), *flags]) == 0
    theirs = timm.create_model("vit_micro", pretrained=True, pretrained_cfg_overlay={"file": out})
    ours = create_model(ModelConfig("vit_micro"))
    state = torch.load(_checkpoint(output, "eager"), weights_only=True)["state"]
    weights = {**state["model"], **(state["ema"] if section == "ema" else {})}
    ours.load_state_dict(weights)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    torch.testing.assert_close(_logits(theirs, ours.normalise(images)), _logits(ours, images))


def test_eval_only_evaluates_a_checkpoint_without_training_or_saving(runs, tmp_path):
    output, trained = runs["eager"]
    summary, stdout = train(
        tmp_path, *JOB, "--eval_only", "--resume", str(_checkpoint(output, "eager"))
    )
    assert summary["eval_only"] and summary["step"] == 5
    for key in ("eval_loss", "eval_acc", "eval_acc5", "eval_loss_ema", "eval_acc_ema"):
        assert summary[key] == pytest.approx(trained[key], rel=1e-6), key
    assert "top-1" in stdout and "top-5" in stdout
    assert not list(tmp_path.glob("**/checkpoints/*"))


def test_pretrained_path_with_other_classes_starts_a_fresh_head(runs, tmp_path):
    output, trained = runs["eager"]
    weights = tmp_path / "w.safetensors"
    assert export_main([str(_checkpoint(output, "eager")), "--out", str(weights)]) == 0
    same, _ = train(tmp_path / "same", *JOB, "--eval_only", "--pretrained_path", str(weights))
    assert same["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)
    five = ("--num_classes", "5", "--pretrained_path", str(weights), "--steps", "1")
    code, stdout, stderr = launch(*JOB, *five, "--output", str(tmp_path / "five"))
    assert code == 0, stderr[-2000:]
    assert "a fresh classifier (10 classes there, 5 here)" in stdout
    assert read_summary(tmp_path / "five")["steps"] == 1


def test_weights_that_do_not_fit_are_one_line_naming_the_mismatch(runs, tmp_path, capsys):
    output, _ = runs["eager"]
    weights = tmp_path / "w.safetensors"
    assert export_main([str(_checkpoint(output, "eager")), "--out", str(weights)]) == 0
    code = main(
        [
            *JOB,
            "--model",
            "vit_micro_d4",
            "--pretrained_path",
            str(weights),
            "--output",
            str(tmp_path / "runs"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "does not fit vit_micro_d4" in err[0] and "missing: model" not in err[0]
    assert "missing: blocks.2." in err[0]


def test_pretrained_without_a_local_copy_says_where_timm_looks(tmp_path):
    env = {
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "TORCH_HOME": str(tmp_path / "torch"),
        "HF_HUB_OFFLINE": "1",
    }
    result = run_cli(
        *JOB,
        "--model",
        "vit_tiny_patch16_224",
        "--pretrained",
        "--output",
        str(tmp_path),
        env=env,
        timeout=60,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "no local copy of vit_tiny_patch16_224's weights" in lines[0]
    assert str(tmp_path / "hub") in lines[0]


def test_pretrained_finds_timms_cached_file(tmp_path):
    """The Hugging Face cache layout timm downloads into: refs/main names the snapshot."""
    code = (
        "import os, timm\n"
        "from accel.cli.models.pretrained import timm_cache_file\n"
        "hub = timm.models.get_pretrained_cfg('vit_tiny_patch16_224').hf_hub_id\n"
        f"repo = os.path.join({str(tmp_path)!r}, 'models--' + hub.replace('/', '--'))\n"
        "os.makedirs(os.path.join(repo, 'refs'))\n"
        "open(os.path.join(repo, 'refs', 'main'), 'w').write('abc123')\n"
        "os.makedirs(os.path.join(repo, 'snapshots', 'abc123'))\n"
        "open(os.path.join(repo, 'snapshots', 'abc123', 'model.safetensors'), 'w').close()\n"
        "print(timm_cache_file('vit_tiny_patch16_224'))\n"
    )
    result = run_python(code, env={"HF_HUB_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("snapshots/abc123/model.safetensors")
