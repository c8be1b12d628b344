"""The xla backend on PJRT CPU: real torch_xla, real compiles."""

import re

import pytest
import torch

from accel.backends.base import BackendUnavailable
from accel.backends.xla import check_versions, compile_count
from accel.checkpoint import read_meta
from accel.cli.data.config import MixupConfig
from accel.cli.train import Trainer
from tests.helpers import job_backend, micro_config, run_cli_without, run_python, train

MIXUP = MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0)
# Ops the step may run outside the graph, and why. None are needed for timm ViT/Swin with our step.
ALLOWED_FALLBACK_OPS: set[str] = set()


def _run(tmp_path, backend: str, model: str, **kw) -> tuple[dict, Trainer]:
    # 100 training samples: not a multiple of the batch (8), so the epoch tail is dropped;
    # the 25 evaluation samples leave a padded, masked last batch.
    cfg = micro_config(
        tmp_path,
        backend=backend,
        model=model,
        steps=30,
        synthetic_length=100,
        mixup=MIXUP,
        eval=True,
        **kw,
    )
    trainer = Trainer(cfg)
    return trainer.train(), trainer


XLA = pytest.mark.xla
SLOW = pytest.mark.slow  # compiles; the fast tier's xla run is test_finetune's


@pytest.fixture(scope="module", params=["vit_micro", "swin_micro"])
def xla_run(request, tmp_path_factory):
    return request.param, *_run(tmp_path_factory.mktemp(request.param), "xla", request.param)


@XLA
@SLOW
def test_thirty_steps_with_mixup_compile_nothing_after_warmup(xla_run):
    _, summary, _ = xla_run
    assert summary["steps"] == 30 and len(summary["losses"]) == 30
    assert summary["compiles_after_warmup"] == 0
    # At most a few graphs (fewer when an earlier test in this process compiled the same ones).
    assert summary["graphs_compiled"] <= 3
    assert set(summary["fallback_ops"]) <= ALLOWED_FALLBACK_OPS
    assert summary["input_shapes"] == ["(8, 3, 32, 32)"]


@XLA
@SLOW
def test_padded_evaluation_counts_every_sample_and_does_not_recompile(xla_run):
    _, summary, trainer = xla_run
    assert summary["eval_images"] == 25
    before = compile_count()
    again = trainer.evaluate()  # same graphs: the ragged tail is padded, never a new shape
    assert compile_count() == before
    assert again["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)


@XLA
@SLOW
def test_first_five_losses_equal_eager_at_o0(xla_run, tmp_path):
    model, summary, _ = xla_run
    eager, _ = _run(tmp_path, "eager", model)
    assert summary["losses"][:5] == pytest.approx(eager["losses"][:5], rel=1e-3)


@XLA
@SLOW
def test_o1_matmuls_run_in_bf16_on_the_xla_device(tmp_path):
    cfg = micro_config(tmp_path, backend="xla", amp_level="O1")
    backend = job_backend(cfg)
    seen = []
    linear = next(m for m in backend.module.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda m, i, out: seen.append((out.dtype, out.device.type)))
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8).to(backend.device)
    with backend.autocast():
        backend.module(images)
    assert seen[0] == (torch.bfloat16, "xla")
    assert {p.dtype for p in backend.module.parameters()} == {torch.float32}


# A batch shape that changes after warm-up stops the step in one line: the Engine's policy for
# every backend (test_api.py's test_the_recompile_limit_stops_xla_and_jax_alike_in_one_line).


def test_versions_that_do_not_pair_are_named():
    check_versions("2.9.0+cu128", "2.9.0")
    with pytest.raises(BackendUnavailable, match=r"torch 2\.10\.1 .* torch_xla 2\.9\.0"):
        check_versions("2.10.1", "2.9.0")


BACKWARD_FIRST = """
import torch
w = torch.ones(2, requires_grad=True)
(w * 2).sum().backward()  # a plain CPU backward, before XLA's runtime started
import accel
from tests.helpers import Net, api_loss_fn, colour_batches, grouped
model = Net()
try:
    engine = accel.prepare(model, grouped(model, "sgd"), api_loss_fn, backend="xla", quiet=True)
    print("trained:", engine.fetch([engine.step(*colour_batches(1)[0])]))
except accel.AccelError as err:
    print("refused:", err)
"""


@XLA
def test_a_cpu_backward_before_xla_starts_is_refused_in_one_line_by_prepare():
    """torch's autograd engine sizes its device queues at the process's first backward: one run
    before XLA's runtime started leaves every XLA backward to fail with a 20-line INTERNAL
    ASSERT. The suite's process started XLA at collection: a fresh interpreter shows it."""
    done = run_python(BACKWARD_FIRST, env={"PJRT_DEVICE": "CPU"})
    assert "INTERNAL ASSERT" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("refused: "), done.stdout
    assert "before the first backward" in out[0] and "fresh process" in out[0]


def test_missing_torch_xla_is_one_line_with_the_install_command(tmp_path):
    result = run_cli_without(
        "torch_xla", "--backend", "xla", "--steps", "1", "--output", str(tmp_path)
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "pip install 'accel[xla]'" in result.stderr


@XLA
@SLOW
def test_evaluating_between_epochs_is_not_a_recompile_and_is_said_with_the_best(tmp_path):
    """--eval_every compiles evaluation graphs mid-run; --max_recompiles 0 counts only the
    training step's. The console and train.log say what summary.json holds: a line every
    --log_every steps (the mean loss since the last), one per evaluation with the best so far,
    and --checkpoint_best keeps the best evaluation's weights."""
    summary, stdout = train(
        tmp_path,
        *("--backend", "xla", "--epochs", "2", "--synthetic_length", "64", "--batch_size", "16"),
        *("--workers", "0", "--eval_every", "1", "--max_recompiles", "0"),
        *("--log_every", "3", "--checkpoint_best", "loss"),
    )
    assert [e["epoch"] for e in summary["evals"]] == [1, 2]
    assert summary["compiles_after_warmup"] == 0
    run_dir = tmp_path / "vit_micro" / "xla" / "r"
    log = (run_dir / "train.log").read_text()
    losses = summary["losses"]  # 8 steps: lines at 3, 6 and the last, 8
    for start, end in ((0, 3), (3, 6), (6, 8)):
        mean = sum(losses[start:end]) / (end - start)
        line = re.search(rf"step +{end}/8  epoch [\d.]+  loss {mean:.4f}  lr [\d.e+-]+  ", stdout)
        assert line and line.group(0) in log, (end, mean, stdout)
    for e in summary["evals"]:
        said = (
            f"eval top-1 {e['eval_acc']:.4f}, top-5 {e['eval_acc5']:.4f}, loss {e['eval_loss']:.4f}"
        )
        assert said in stdout and said in log, said
    best = min(summary["evals"], key=lambda e: e["eval_loss"])  # the first of equals
    assert f"best eval loss {best['eval_loss']:.4f} (epoch {best['epoch']:g}" in stdout
    meta = read_meta(run_dir / "checkpoints" / "best.pt")
    assert meta["loop"]["step"] == best["step"] and meta["best"]["eval_loss"] == best["eval_loss"]
    closing = log[log.index("done: ") :]  # the closing block names both checkpoints
    assert f"  checkpoint {run_dir / 'checkpoints' / 'best.pt'}" in closing, closing
    assert f"  checkpoint {run_dir / 'checkpoints' / 'step_00000008.pt'}" in closing, closing
