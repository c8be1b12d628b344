"""bench/fed_step.py sorts a profile's device time by kind of work (matmul, attention,
elementwise, reduction, ...) from kernel names: here, the names an H200 gave for Swin-T's and
ViT-B/16's steps on jax and compile (bench/results/gpu-check-nvidia-h200.json)."""

import json
from pathlib import Path

import pytest

from bench.fed_step import by_kind, kernel_kind

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def h200_kernels() -> set[str]:
    record = json.loads((ROOT / "bench/results/gpu-check-nvidia-h200.json").read_text())
    rows = record["stages"]["profile"]["rows"]
    return {op["name"] for row in rows for line in row["profile"].values() for op in line["top"]}


def test_every_kernel_of_the_h200_profile_has_the_kind_its_name_says(h200_kernels):
    kinds = {name: kernel_kind(name) for name in h200_kernels}
    assert "other" not in kinds.values()  # each of the four steps' top kernels is placed
    by_prefix = {  # XLA's fusions and inductor's Triton kernels by their prefixes
        "loop_": "elementwise",
        "input_": "reduction",
        "triton_poi_": "elementwise",
        "triton_red_": "reduction",
        "triton_per_": "reduction",
        "nvjet_": "matmul",
        "fusion_": "other fusion",
    }
    for prefix, kind in by_prefix.items():
        named = [name for name in h200_kernels if name.startswith(prefix)]
        assert named and {kinds[name] for name in named} == {kind}, prefix
    # cuDNN's flash attention (jax, compile on ViT) and PyTorch's memory-efficient one (compile
    # on Swin-T), though their names also hold wgmma and cutlass
    attention = {name for name, kind in kinds.items() if kind == "attention"}
    assert any("sdpa" in name for name in attention) and any("fmha" in name for name in attention)


def test_by_kind_sums_each_kind_and_puts_the_largest_first():
    timed = [("nvjet_a", 2.0), ("loop_add_fusion", 0.5), ("nvjet_b", 1.5), ("fusion_3", 3.0)]
    assert by_kind(timed) == {"matmul": 3.5, "other fusion": 3.0, "elementwise": 0.5}
