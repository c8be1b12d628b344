"""bench/gpu_check.py --smoke: every stage of the GPU check on CPU with the micro models, the
GPU-only parts reported as skipped. Its budgets are lifted (--budget): speeds belong in bench/,
not in a test on a shared machine."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import run_script

pytestmark = pytest.mark.slow  # its stages start pytest and the launcher


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, str]:
    folder = tmp_path_factory.mktemp("gpu-check")
    # --budget per stage: none is cut short on a busy machine
    args = ("--smoke", "--results", str(folder), "--budget", "600")
    done = run_script("bench/gpu_check.py", *args, timeout=900)
    record = json.loads((folder / "gpu-check-smoke.json").read_text())
    return done, record, (folder / "gpu-check-smoke.md").read_text()


def test_every_stage_finishes_and_is_recorded(smoke):
    done, record, markdown = smoke
    assert done.returncode == 0, done.stderr[-2000:]
    stages = {"profile", "remat", "bench", "tests", "decode", "attention", "data"}
    assert set(record["stages"]) == stages
    assert list(record["stages"])[:2] == ["profile", "remat"]  # where the time goes, first
    assert "unfinished" not in done.stdout and "unfinished" not in markdown
    assert record["device"] == "CPU" and record["versions"]["torchax"]
    assert done.stdout.startswith("gpu_check: torch ")  # the versions, first


def test_the_gpu_tier_is_collected_and_skipped_with_its_reason(smoke):
    tests = smoke[1]["stages"]["tests"]
    assert tests["exit_code"] == 0 and tests["counts"]["skipped"] >= 6
    assert set(tests["counts"]) == {"skipped"}
    assert any("CUDA" in line for line in tests["lines"] if "skipped because" in line)


def test_bench_and_data_stages_measure_each_backend(smoke):
    rows = smoke[1]["stages"]["bench"]["rows"]
    assert sorted((r["model"], r["backend"]) for r in rows) == [
        ("vit_micro", "eager"),
        ("vit_micro", "jax"),
    ]
    assert all(r["images_per_sec"] > 0 and r["loop_efficiency"] > 0 for r in rows)
    data = smoke[1]["stages"]["data"]
    assert [(r["backend"], r["ok"]) for r in data["rows"]] == [("eager", True), ("jax", True)]
    assert all(0 <= r["data_wait_fraction"] <= 1 for r in data["rows"])
    assert "skipped: --data_device gpu (no CUDA device)" in data["lines"]


def test_decode_attention_and_profile_stages_measure_on_this_machine(smoke):
    stages = smoke[1]["stages"]
    decode = stages["decode"]["40px"]  # the CPU's decoder is PIL's libjpeg-turbo: no gap
    assert decode["decoder"] == "torchvision" and decode["decoded"] > 0
    assert decode["decode_mean_abs"] == 0 and 0 <= decode["resize_bilinear_mean_abs"] < 1
    (row,) = stages["attention"]["rows"]
    assert row["model"] == "vit_base_patch32_224" and row["tokens"] == 50
    assert row["xla"]["ran"] == row["cudnn"]["ran"] == "xla"  # no cuDNN on a CPU
    assert row["xla"]["train_ms"] > 0 and row["cudnn"]["train_ms"] > 0
    profiled = stages["profile"]["rows"]
    assert [(r["model"], r["backend"]) for r in profiled] == [
        ("swin_micro", "jax"),
        ("swin_micro", "eager"),
    ]
    assert all(row["fed_images_per_sec"] > 0 for row in profiled)
    # torch's profiler gives eager's top ops on the CPU too (jax.profiler's planes are a GPU's)
    (cpu_ops,) = profiled[1]["profile"].values()
    assert cpu_ops["top"]
    # every op's time in one kind or another: the kinds sum to the step (each rounded to 1 us)
    kinds = cpu_ops["by_kind"]
    assert sum(kinds.values()) == pytest.approx(cpu_ops["ms_per_step"], abs=1e-3 * len(kinds))
    assert kinds["matmul"] > 0  # the model's linear layers: aten::mm and aten::addmm
    (remat,) = stages["remat"]["rows"]
    assert remat["remat"] == "dots" and remat["fed_images_per_sec"] > 0
