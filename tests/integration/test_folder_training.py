"""Training on real JPEG folders with bad files, through the launcher."""

import re

import numpy as np
import pytest
import torch

from accel.cli.data.config import MixupConfig
from accel.cli.train import Trainer
from tests.helpers import dirty_mock_imagenet, launch, micro_config, read_summary


@pytest.fixture(scope="module")
def dirty_imagenet(tmp_path_factory):
    return dirty_mock_imagenet(tmp_path_factory.mktemp("dirty"), val_per_class=3)


def _train(dirty_imagenet, tmp_path, *extra: str):
    return launch(
        "--model",
        "vit_micro",
        "--data",
        str(dirty_imagenet),
        "--epochs",
        "1",
        "--batch_size",
        "4",
        "--output",
        str(tmp_path),
        *extra,
    )


def test_unreadable_files_are_skipped_counted_and_odd_modes_trained_on(tmp_path, dirty_imagenet):
    result = _train(dirty_imagenet, tmp_path, "--workers", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["skipped_images"] == 3  # truncated, empty and non-image; gray/RGBA/CMYK train
    assert summary["steps"] == 6  # 24 files, batch 4, one epoch
    assert result.stderr.count(f"skipped unreadable image {dirty_imagenet}") == 3
    for name in ("truncated.jpg", "empty.jpg", "notes.png"):
        assert result.stderr.count(name) == 1, name  # one warning per file
    # One clean line each: no source line of the project printed after it.
    lines = re.split(r"[\r\n]", result.stderr)  # the progress bar redraws with carriage returns
    warned = [line for line in lines if "skipped unreadable" in line]
    assert all(line.startswith("warning: skipped unreadable image") for line in warned)
    assert "self.add(" not in result.stderr and "warnings.warn(" not in result.stderr
    assert summary["eval_images"] == 9


@pytest.mark.slow  # a loader worker: a forkserver process
def test_strict_data_stops_at_the_first_bad_file_from_a_worker(tmp_path, dirty_imagenet):
    result = _train(dirty_imagenet, tmp_path, "--workers", "1", "--strict-data")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0].startswith("launch_single_task: error: unreadable image")
    assert str(dirty_imagenet) in errors[0]


def test_a_class_with_no_images_in_either_split_is_kept_and_trained(tmp_path):
    root = dirty_mock_imagenet(tmp_path / "data", val_per_class=2)
    for split in ("train", "val"):
        (root / split / "a_empty").mkdir()
    result = _train(root, tmp_path / "runs", "--workers", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "runs")
    assert summary["steps"] == 6 and summary["eval_images"] == 6
    kept = [line for line in re.split(r"[\r\n]", result.stderr) if "kept as classes" in line]
    assert len(kept) == 2  # once per split
    assert all(line.startswith("warning:") and line.endswith(": a_empty") for line in kept)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine with no GPU")
def test_data_device_gpu_without_a_gpu_is_one_line_exit_2(tmp_path, dirty_imagenet):
    result = _train(dirty_imagenet, tmp_path, "--data_device", "gpu")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "launch_single_task: error: --data_device gpu: no CUDA GPU is visible to torch"
    ]


@pytest.mark.slow
def test_device_decoding_trains_eager_and_jax_on_the_same_batches(tmp_path, dirty_imagenet):
    """Decoding in the training process (the GPU path, on the CPU device here): bad files are
    skipped and counted, and jax trains on exactly what eager trains on (losses as in the AMP
    matrix's O0 parity)."""
    runs = {}
    for backend in ("eager", "jax"):
        cfg = micro_config(
            tmp_path / backend,
            backend=backend,
            source=str(dirty_imagenet),
            num_classes=3,
            decode_on="cpu",
            batch_size=4,
            steps=6,
            mixup=MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0),
        )
        runs[backend] = Trainer(cfg).train()
    for summary in runs.values():
        assert summary["skipped_images"] == 3 and summary["steps"] == 6
    np.testing.assert_allclose(runs["jax"]["losses"], runs["eager"]["losses"], rtol=1e-3)
