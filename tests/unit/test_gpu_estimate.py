# ruff: noqa: E501  (the hand-written program keeps XLA's one-line instructions)
"""bench/gpu_estimate.py's roofline and bench/gpu_program.py's reading of a compiled GPU program:
on a small hand-written program (a cuBLAS matmul, a layer-norm fusion, an AdamW update and a
copy), the bytes, flops and group of each kernel, and the step's estimate, worked out here by
hand."""

import pytest

from bench.gpu_estimate import H200, Efficiency, Kernel, estimate, group_of, kernel_seconds
from bench.gpu_program import estimated, kernels

PROGRAM = """HloModule jit_step, is_scheduled=true

%fused_norm (p0: bf16[256,512]) -> bf16[256,512] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %c = f32[256,512]{1,0} convert(%p0)
  ROOT %r = bf16[256,512]{1,0} convert(%c)
}

%fused_update (p0: f32[512,512], p1: f32[512,512]) -> f32[512,512] {
  %p0 = f32[512,512]{1,0} parameter(0)
  %p1 = f32[512,512]{1,0} parameter(1)
  ROOT %s = f32[512,512]{1,0} subtract(%p0, %p1)
}

ENTRY %main (x: bf16[256,512], w: bf16[512,512], p: f32[512,512]) -> f32[512,512] {
  %x = bf16[256,512]{1,0} parameter(0)
  %w = bf16[512,512]{1,0} parameter(1)
  %p = f32[512,512]{1,0} parameter(2)
  %mm = (bf16[256,512]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp(linear)/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %y = bf16[256,512]{1,0} get-tuple-element(%mm), index=0
  %norm = bf16[256,512]{1,0} fusion(%y), kind=kInput, calls=%fused_norm, metadata={op_name="jit(step)/transpose(jvp(layer_norm))/mul"}
  %copy = bf16[256,512]{1,0} copy(%norm)
  ROOT %update = f32[512,512]{1,0} fusion(%p, %p), kind=kLoop, calls=%fused_update, metadata={op_name="jit(step)/adamw/sub" source_file="/x/site-packages/optax/_src/alias.py" source_line=1}
}
"""

MB = 256 * 512 * 2  # a bf16[256,512]
SHARE = Efficiency(bandwidth=0.5, matmul=0.25, attention=0.5, launch_s=1e-6)


@pytest.fixture(scope="module")
def rows():
    return {row["name"]: row for row in kernels(PROGRAM)}


def test_each_kernel_reads_and_writes_its_operands_and_results(rows):
    assert set(rows) == {"mm", "norm", "copy", "update"}  # parameters and tuples launch nothing
    workspace = 4194304  # cuBLAS's scratch is part of its result
    assert rows["mm"]["bytes"] == MB + 512 * 512 * 2 + MB + workspace
    assert rows["norm"]["bytes"] == 2 * MB
    assert rows["copy"]["bytes"] == 2 * MB
    assert rows["update"]["bytes"] == 3 * 512 * 512 * 4


def test_matmul_flops_from_the_contracted_dimension(rows):
    assert rows["mm"]["flops"] == 2 * 256 * 512 * 512
    assert rows["mm"]["matmul_dtype"] == "bf16"
    assert rows["norm"]["flops"] == rows["copy"]["flops"] == 0


def test_kernels_grouped_by_what_they_do(rows):
    assert rows["mm"]["group"] == "matmul"
    assert rows["norm"]["group"] == "normalization"  # its backward: transpose(jvp(layer_norm))
    assert rows["copy"]["group"] == "layout"
    # the autodiff's "transpose(...)" is no transpose of data; an op with no torch name and a
    # plain convert is a cast
    assert group_of("fusion kLoop", "jvp()/convert_element_type", "", {"convert"}) == "casts"
    assert group_of("fusion kInput", "transpose(jvp(aten::permute))/transpose", "", set()) == (
        "layout"
    )
    assert group_of("Triton", "jvp(scaled_dot_product_attention)/pallas_call", "", set()) == (
        "attention"
    )


def test_the_estimate_is_the_sum_of_each_kernels_roofline(rows):
    found = estimated(list(rows.values()), launched=len(rows), share=SHARE)
    bandwidth = H200.bandwidth * SHARE.bandwidth
    mm_memory = rows["mm"]["bytes"] / bandwidth
    mm_compute = 2 * 256 * 512 * 512 / (989e12 * SHARE.matmul)
    assert mm_memory > mm_compute  # this small matmul is bound by its bytes
    by_hand = (
        mm_memory
        + (2 * MB + 2 * MB + 3 * 512 * 512 * 4) / bandwidth  # the others: bytes alone
        + 4 * SHARE.launch_s
    )
    assert found["estimated_ms"] == pytest.approx(by_hand * 1e3, abs=0.006)
    assert set(found["by_group"]) == {"matmul", "normalization", "layout", "optimizer update"}
    # two launches the program's instructions do not account for cost a launch each
    more = estimated(list(rows.values()), launched=len(rows) + 2, share=SHARE)
    assert more["estimated_ms"] - found["estimated_ms"] == pytest.approx(2e-3, abs=0.006)


def test_a_large_matmul_is_bound_by_its_flops():
    big = Kernel("mm", "cuBLAS", "matmul", bytes=1e6, flops=1e13, dtype="bf16")
    assert kernel_seconds(big, H200, SHARE) == pytest.approx(1e13 / (989e12 * 0.25) + 1e-6)
    tf32 = Kernel("mm", "cuBLAS", "matmul", bytes=1e6, flops=1e13, dtype="f32")
    assert kernel_seconds(tf32, H200, SHARE) > 1.9 * kernel_seconds(big, H200, SHARE)
    step = estimate([big, tf32], H200, SHARE)
    assert step["by_group"]["matmul"]["kernels"] == 2
    assert step["estimated_ms"] == pytest.approx(sum(step["kernel_us"]) / 1e3, abs=0.01)
