"""Nothing lost: a killed or signalled run resumes with the losses and the weights' EMA of an
uninterrupted one: bit for bit on eager (CPU, fp32), within 1e-6 relative on xla and jax. The
job keeps an EMA, erases at random and decays the learning rate by layer, so all of that state
and randomness has to come back too."""

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from accel.checkpoint import read_meta
from accel.cli.data.config import DataConfig
from accel.cli.data.prepare import prepare_mock_imagenet
from accel.cli.train import Trainer
from tests.helpers import (
    CLI,
    FUSION_EMITTERS,
    fork_module,
    launch,
    micro_config,
    read_summary,
    start_cli,
    train_ranks,
)

JOB = (
    "--model",
    "vit_micro",
    "--steps",
    "12",
    "--batch_size",
    "8",
    "--workers",
    "0",
    "--save_every",
    "1",
    "--log_every",
    "1",
    "--no-eval",
    "--run_name",
    "r",
    "--model_ema",
    "--model_ema_decay",
    "0.5",
    "--reprob",
    "0.5",
    "--layer_decay",
    "0.75",
)


def start(output: Path, backend: str = "eager", env: dict | None = None) -> subprocess.Popen:
    return start_cli(*JOB, "--backend", backend, "--output", str(output), env=env)


def wait_for_checkpoint(
    output: Path, step: int, proc: subprocess.Popen, backend: str = "eager"
) -> None:
    path = output / "vit_micro" / backend / "r" / "checkpoints" / f"step_{step:08d}.pt"
    deadline = time.monotonic() + 180
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, f"no checkpoint {path}"
        time.sleep(0.05)


def final_ema(output: Path, backend: str) -> torch.Tensor:
    """The last checkpoint's EMA weights, flattened into one vector."""
    path = output / "vit_micro" / backend / "r" / "checkpoints" / "step_00000012.pt"
    ema = torch.load(path, weights_only=True)["state"]["ema"]
    return torch.cat([t.flatten() for _, t in sorted(ema.items())])


def full_run(output: Path, *args: str, backend: str = "eager", env: dict | None = None) -> tuple:
    """A run to its end: in this process, or with `env` in a process of its own (XLA reads its
    flags once, as it starts: forked from the suite's server, helpers.fork_module); its losses
    and final EMA."""
    argv = (*JOB, "--backend", backend, "--output", str(output), *args)
    result = launch(*argv) if env is None else fork_module(CLI, *argv, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return read_summary(output)["losses"], final_ema(output, backend)


def resume(output: Path, backend: str = "eager", env: dict | None = None) -> tuple:
    """The killed run's resume, in this process unless `env` is given: only the kill needs a
    process of its own."""
    return full_run(output, "--resume", "auto", backend=backend, env=env)


def killed_and_resumed(
    output: Path, kill_after: int, backend: str = "eager", env: dict | None = None
) -> tuple:
    proc = start(output, backend, env)
    wait_for_checkpoint(output, kill_after, proc, backend)
    proc.kill()
    proc.wait()
    return resume(output, backend, env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[float], torch.Tensor]:
    return full_run(tmp_path_factory.mktemp("uninterrupted"))


def same(got: tuple, want: tuple) -> bool:
    return got[0] == want[0] and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kill_after", [3, 8])
def test_sigkill_then_resume_auto_reproduces_every_loss(tmp_path, reference, kill_after):
    # exact: same data order, weights, optimizer moments, EMA and RNG states
    assert same(killed_and_resumed(tmp_path, kill_after), reference)


@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.xla), "jax"])
def test_xla_and_jax_resume_after_sigkill_reproduce_the_losses(tmp_path, backend):
    # One kill point: which steps come before it is eager's two-point test's concern; here,
    # that the compiled step's state (weights, AdamW, EMA, RNG key) all come back. xla's runs
    # at XLA's fusion emitters: the resumed run's first graphs are not the uninterrupted run's,
    # and the suite's elemental emitters round them 6e-7 apart in the EMA, beyond this bound.
    env = FUSION_EMITTERS if backend == "xla" else None
    losses, ema = full_run(tmp_path / "full", backend=backend, env=env)
    got = killed_and_resumed(tmp_path / "killed", 5, backend, env)
    assert got[0] == pytest.approx(losses, rel=1e-6)
    torch.testing.assert_close(got[1], ema, rtol=1e-6, atol=1e-7)


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path, reference):
    proc = start(tmp_path)
    wait_for_checkpoint(tmp_path, 4, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert "stopped by SIGTERM at step" in stdout and "--resume auto" in stdout
    assert not list(tmp_path.glob("**/summary.json"))  # unfinished, and it says so
    assert same(resume(tmp_path), reference)


def test_resuming_with_an_incompatible_config_names_the_keys(tmp_path):
    job = ("--workers", "0", "--no-eval", "--output", str(tmp_path))
    code, _, stderr = launch(*job, "--steps", "2", "--batch_size", "8", "--run_name", "a")
    assert code == 0, stderr[-2000:]
    checkpoint = next(tmp_path.glob("vit_micro/eager/a/checkpoints/*.pt"))
    other = ("--model", "swin_micro", "--steps", "4", "--batch_size", "4")
    code, _, stderr = launch(*job, *other, "--resume", str(checkpoint))
    assert code == 2
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in stderr
    assert "model.name (checkpoint vit_micro, now swin_micro)" in errors[0]
    assert "global_batch (checkpoint 8, now 4)" in errors[0]


def test_two_ranks_resume_their_own_random_streams(tmp_path):
    """Stochastic depth draws from each rank's torch generator (seeded seed + rank); a resumed
    2-process run restores every rank's own state, so its losses match bit for bit."""
    job = ("--nproc_per_node", "2", "--drop_path", "0.5", "--save_every", "3")
    job += ("--steps", "6", "--batch_size", "8", "--workers", "0", "--no-eval", "--log_every", "1")
    uninterrupted, _ = train_ranks(tmp_path / "a", *job, "--keep_checkpoints", "0")
    saved = tmp_path / "a" / "vit_micro" / "eager" / "r" / "checkpoints" / "step_00000003.pt"
    ranks = read_meta(saved)["rng"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])
    resumed, _ = train_ranks(tmp_path / "b", *job, "--resume", str(saved))
    assert resumed["losses"] == uninterrupted["losses"]


def test_after_a_resume_the_images_evaluation_skips_are_counted(tmp_path):
    """The evaluator records unreadable validation images into the resumed run's state."""
    root = prepare_mock_imagenet(
        tmp_path / "data", classes=3, per_class=6, val_per_class=2, size=40, progress=False
    )
    bad = next((root / "val").iterdir()) / "truncated.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a whole jpeg")
    data = DataConfig(source=str(root), workers=0)
    first = micro_config(tmp_path, data=data, steps=2, batch_size=4)
    assert Trainer(first).train()["skipped_images"] == 0  # no evaluation yet
    resumed = micro_config(tmp_path, data=data, steps=3, batch_size=4, resume="auto", eval=True)
    assert Trainer(resumed).train()["skipped_images"] == 1
