"""Each bad input: one line naming the problem, exit code 2, no traceback."""

import pytest
import torch

from accel.config import ConfigError
from accel.launch_single_task import _check_gpu_count, resolve_backend
from tests.helpers import micro_config, run_cli


def _one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--model", "vit_mcro"], ["unknown model 'vit_mcro'", "vit_micro"]),
        (["--mixup", "0.8", "--batch_size", "7"], ["even --batch_size", "7"]),
        (["--cutmix", "1.0", "--batch_size", "5"], ["even --batch_size"]),
        (["--amp_level", "O7"], ["unknown AMP level 'O7'"]),
        (
            ["--data", "/nonexistent/imagenet"],
            ["dataset folder not found", "/nonexistent/imagenet"],
        ),
        (["--backend", "tpu"], ["--backend", "tpu"]),
        (["--steps", "0"], ["--steps or --epochs"]),
        (["--backend", "xla", "--shard", "full"], ["--shard is not supported by the xla backend"]),
        (["--backend", "jax", "--tp_head", "2"], ["--tp_head", "not jax"]),
        (["--nproc_per_node", "3", "--tp_head", "2"], ["--nproc_per_node 3", "--tp_head 2"]),
        (["--tp_head", "2", "--shard", "full"], ["--tp_head and --shard"]),
        (["--nproc_per_node", "2", "--model", "swin_micro", "--pp", "2"], ["--pp cuts", "swin"]),
        (["--nproc_per_node", "4", "--pp", "4"], ["--pp 4", "4 stages", "vit_micro has 2 blocks"]),
        (["--nproc_per_node", "3", "--pp", "2"], ["--nproc_per_node 3", "--pp 2"]),
        (
            ["--nproc_per_node", "2", "--pp", "2", "--pp_microbatches", "3"],
            ["--batch_size 32", "--pp_microbatches 3"],
        ),
        (["--backend", "compile", "--pp", "2"], ["--pp runs on eager, not compile"]),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needles):
    _one_line_error(run_cli("--steps", "1", *args, timeout=120), *needles)


def test_empty_dataset_folder(tmp_path):
    (tmp_path / "train").mkdir()
    _one_line_error(run_cli("--steps", "1", "--data", str(tmp_path)), "empty", str(tmp_path))


def test_more_processes_than_gpus_is_refused_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="--nproc_per_node 4 exceeds the 2 visible GPUs"):
        _check_gpu_count(micro_config(tmp_path, nproc_per_node=4))
    _check_gpu_count(micro_config(tmp_path, nproc_per_node=2))


def test_use_accel_selects_the_xla_path():
    assert resolve_backend(None, {})[0] == "eager"
    assert resolve_backend(None, {"USE_ACCEL": "0"})[0] == "eager"
    assert resolve_backend("compile", {"USE_ACCEL": "1"})[0] == "compile"
    expected = "jax" if torch.cuda.is_available() else "xla"
    name, why = resolve_backend(None, {"USE_ACCEL": "1"})
    assert name == expected and "USE_ACCEL=1" in why
