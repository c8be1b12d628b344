"""Model parallel at the scale it exists for: ViT-L/16 cut into 4 pipeline stages, and a
1,000,000-class classifier split over 2 ranks. No rank builds, trains, saves or loads the whole
model's state. What a rank's run adds to its resident memory is its peak (`peak_host_bytes` in
summary.json) over what it held once its imports were done (`host_bytes_at_start`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.helpers import train_cli, train_ranks

pytestmark = pytest.mark.slow

# Two steps: the second's loss is the first update's, and the first's checkpoint is resumed. At
# these sizes a micro-batch costs a pass over its stage's weights, whatever its images: 4 of them,
# the fewest that 1F1B streams through 4 stages, of 2 images each.
VITL = ("--model", "vit_large_patch16_224", "--img_size", "32", "--batch_size", "8")
VITL += ("--num_classes", "10", "--synthetic_length", "16", "--workers", "0", "--no-eval")
VITL += ("--log_every", "1", "--steps", "2")
PP4 = ("--nproc_per_node", "4", "--pp", "4", "--pp_microbatches", "4")
# Every schedule trains the unsplit losses in test_pipeline.py; at scale the question is memory,
# asked of one schedule with one stage a rank and of the interleaved one with two.
SCHEDULES = ("1f1b", "interleaved")


def _train(output: Path, *args: str) -> tuple[dict, str]:
    """A run of several ranks from the suite's fork server (train_ranks); the one-process run in
    a process of its own, whose peak memory is its run's alone."""
    return (train_ranks if "--nproc_per_node" in args else train_cli)(output, *args)


def _grown(summary: dict) -> list[int]:
    """What each rank's run added to its memory: peak over the memory it had after imports."""
    peaks, starts = summary["peak_host_bytes"], summary["host_bytes_at_start"]
    return [p - s for p, s in zip(peaks, starts, strict=True)]


def _checkpoint(output: Path, model: str, step: int) -> Path:
    return output / model / "eager" / "r" / "checkpoints" / f"step_{step:08d}.dcp"


def _drop_checkpoints(output: Path, keep: Path | None = None) -> None:
    """A ViT-L checkpoint holds 3.6 GB: only the one a test resumes stays on disk."""
    for saved in output.glob("*/*/*/checkpoints/*"):
        if saved != keep:
            shutil.rmtree(saved) if saved.is_dir() else saved.unlink()


# A run saves what it trains (3.6 GB for ViT-L, 4.6 GB for the million-class head), unless no
# test reads its checkpoint (--no-save), and every save ends in fsync: on this suite's disk, about
# 25 s of the module's time. Where /dev/shm (memory) has room the runs write there instead, as fast
# as memory; the folder goes with the module. Its files take memory the runs need too: at most two
# checkpoints at once, beside 4 ranks' state.
SHM, SHM_NEEDED, MEMORY_NEEDED = Path("/dev/shm"), 12 * 2**30, 16 * 2**30


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Iterator[Callable[[str], Path]]:
    """scratch(name): a new empty folder for a run's output, in memory where there is room."""
    room = SHM.is_dir() and shutil.disk_usage(SHM).free >= SHM_NEEDED
    room = room and psutil.virtual_memory().available >= MEMORY_NEEDED
    base = Path(tempfile.mkdtemp(prefix="accel-scale-", dir=SHM)) if room else None
    try:
        if base is None:
            yield tmp_path_factory.mktemp
        else:
            yield lambda name: Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def vitl(scratch) -> dict[str, tuple[Path, dict]]:
    jobs = {"single": ()} | {s: (*PP4, "--pp_schedule", s) for s in SCHEDULES}
    saves = {"1f1b": ("--save_every", "1")}  # its step-1 checkpoint is resumed below; no other's
    runs = {}
    for name, extra in jobs.items():
        output = scratch(f"vitl-{name}")
        runs[name] = output, _train(output, *VITL, *extra, *saves.get(name, ("--no-save",)))[0]
        resumed = _checkpoint(output, "vit_large_patch16_224", 1) if name == "1f1b" else None
        _drop_checkpoints(output, keep=resumed)
    return runs


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_vit_large_in_four_stages_trains_alike_in_under_045_of_the_memory(vitl, schedule):
    _, single = vitl["single"]
    _, piped = vitl[schedule]
    np.testing.assert_allclose(piped["losses"], single["losses"], rtol=1e-4)
    grown = _grown(piped)
    assert len(grown) == 4
    assert max(grown) <= 0.45 * _grown(single)[0], (grown, _grown(single))


def test_vit_large_pipeline_resumes_bit_for_bit_within_the_same_memory(vitl, scratch):
    output, piped = vitl["1f1b"]
    _, single = vitl["single"]
    resume = ("--resume", str(_checkpoint(output, "vit_large_patch16_224", 1)))
    folder = scratch("vitl-resumed")
    resumed, _ = _train(folder, *VITL, *PP4, "--pp_schedule", "1f1b", *resume, "--no-save")
    _drop_checkpoints(folder)
    _drop_checkpoints(output)  # the step-1 checkpoint, resumed
    assert resumed["losses"] == piped["losses"]
    assert max(_grown(resumed)) <= 0.45 * _grown(single)[0], (_grown(resumed), _grown(single))


# A classifier of 1,000,000 classes at width 384 over a two-block body: 385M parameters, whose
# weights, gradients and AdamW moments take 6.2 GB unsplit.
CLASSES, WIDTH = 1_000_000, 384
TP = ("--model", "vit_micro_wide", "--num_classes", str(CLASSES), "--batch_size", "2")
TP += ("--synthetic_length", "16", "--workers", "0", "--no-eval", "--log_every", "1")
TP += ("--nproc_per_node", "2", "--tp_head", "2")


def test_a_million_class_head_split_in_two_saves_and_loads_in_under_06_of_its_state(scratch):
    whole = 16 * CLASSES * (WIDTH + 1)  # --tp_head 1: weights, gradients, two moments, fp32
    folder = scratch("million")
    saved, _ = _train(folder / "saved", *TP, "--steps", "1")
    checkpoint = _checkpoint(folder / "saved", "vit_micro_wide", 1)
    assert checkpoint.is_dir() and saved["state_bytes"]["classifier"] == whole // 2
    assert max(_grown(saved)) <= 0.6 * whole, _grown(saved)
    loaded, _ = _train(
        folder / "loaded", *TP, "--steps", "2", "--resume", str(checkpoint), "--no-save"
    )
    _drop_checkpoints(folder / "saved")
    _drop_checkpoints(folder / "loaded")
    assert loaded["losses"][0] == saved["losses"][0] and len(loaded["losses"]) == 2
    assert max(_grown(loaded)) <= 0.6 * whole, _grown(loaded)
