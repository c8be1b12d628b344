"""An H200's time for a compiled training step, estimated kernel by kernel from the program alone.

bench/gpu_program.py compiles the program an H200 runs and reads, for each kernel, the bytes it
reads and writes, the floating-point work of its matmuls and the kind of kernel it is. Nothing
runs on this machine, so a time can only be estimated: each kernel takes a launch, then the
longer of its memory traffic over the card's bandwidth and its matmul work over the card's
tensor-core peak, each at the share of the peak such kernels reach (a roofline per kernel):

    t = launch + max(bytes / (bandwidth * e_bandwidth), flops / (peak[dtype] * e_kind))

and the step is the sum of its kernels (one stream, in order, as XLA:GPU's command buffers run
it). The shares (`Efficiency`) are stated, calibrated once against a step an H200 measured, and
kept in the record beside the estimate; `Card` holds the H200's public figures. An estimate is
not a measurement: it says which change buys what, not what the card will do. What it cannot
see: a kernel's occupancy and tiling (a small matmul reaches less of the peak than a large
one), caches (a kernel reading what the last one wrote may find it in L2), overlap between
kernels, and what autotuning would pick on a device.

Kernels are grouped by what they do (GROUPS), so that the record says where the time goes.

    from bench.gpu_estimate import H200, CALIBRATED, Kernel, estimate
    step = estimate([Kernel("fusion.1", "fusion kLoop", "activation", 2e9, 0, "bf16")], H200,
                    CALIBRATED)
    step["estimated_ms"]  # 0.6 ms: 2 GB over 4.8 TB/s at 0.7 of it, and one launch
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

GROUPS = (
    "matmul",
    "attention",
    "normalization",
    "activation",
    "casts",
    "layout",
    "optimizer update",
    "other",
)


@dataclass(frozen=True)
class Card:
    """A GPU's public peak figures: HBM bandwidth (bytes/s) and dense tensor-core flops/s by
    the matmul's operand dtype (float32 operands as TF32, XLA:GPU's default precision)."""

    name: str
    bandwidth: float
    tensor_flops: dict[str, float] = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        return self.tensor_flops.get(dtype, self.tensor_flops["f32"])


# NVIDIA H200 SXM: 4.8 TB/s of HBM3e; dense tensor cores 989 TFLOP/s in bf16 and fp16, 494 in
# TF32 (the H100 SXM's tensor cores: the H200 changed the memory, not the SM).
H200 = Card("NVIDIA H200", 4.8e12, {"bf16": 989e12, "f16": 989e12, "f32": 494e12, "s8": 1979e12})


@dataclass(frozen=True)
class Efficiency:
    """The share of a peak that each kind of kernel reaches, and a launch's fixed cost."""

    bandwidth: float  # of HBM bandwidth, for every kernel's bytes
    matmul: float  # of the tensor-core peak, cuBLAS's and XLA's matmuls and convolutions
    attention: float  # of the tensor-core peak, fused attention kernels (cuDNN, Pallas)
    launch_s: float  # a kernel's start and drain within a command buffer

    def share(self, group: str) -> float:
        return self.attention if group == "attention" else self.matmul


# Before calibration: what such kernels reach on Hopper by common account (copies and
# elementwise passes at 80-90% of HBM bandwidth, large bf16 GEMMs at 60-75% of the dense peak,
# a few microseconds between kernels of a CUDA graph).
NOMINAL = Efficiency(bandwidth=0.85, matmul=0.65, attention=0.40, launch_s=2e-6)


def scaled(share: Efficiency, factor: float) -> Efficiency:
    """`share` with every share of a peak times `factor` (the launch kept)."""
    return Efficiency(
        bandwidth=round(share.bandwidth * factor, 4),
        matmul=round(share.matmul * factor, 4),
        attention=round(share.attention * factor, 4),
        launch_s=share.launch_s,
    )


# Calibrated against the steps an H200 measured (the profile of 2026-11-27: Swin-T 32.2 ms,
# ViT-B/16 40.3 ms of device time a step): NOMINAL's shares times one factor, the one that fits
# both steps best (`bench/gpu_program.py --calibrate`; the record's "calibration" block says
# the errors before and after).
CALIBRATION_FACTOR = 0.82
CALIBRATED = scaled(NOMINAL, CALIBRATION_FACTOR)


@dataclass
class Kernel:
    """One kernel of a program: what the estimate needs of it."""

    name: str
    kind: str  # "fusion kLoop", "cuBLAS", "cuDNN", ...
    group: str  # one of GROUPS
    bytes: float  # read and written
    flops: float  # of its matmuls (0 for elementwise and data movement)
    dtype: str  # the matmul's operand dtype ("" where there is none)


def best_factor(errors: Callable[[float], list[float]]) -> float:
    """The factor in [0.3, 2] whose relative errors (`errors(factor)`) have the least sum of
    squares, to two decimals (a search over a grid: the sum has one minimum)."""
    grid = [round(0.3 + 0.01 * i, 2) for i in range(171)]
    return min(grid, key=lambda f: sum(e * e for e in errors(f)))


def kernel_seconds(kernel: Kernel, card: Card, share: Efficiency) -> float:
    """The roofline time of one kernel: a launch, then memory or matmul work, the longer."""
    memory = kernel.bytes / (card.bandwidth * share.bandwidth)
    compute = 0.0
    if kernel.flops:
        compute = kernel.flops / (card.peak_flops(kernel.dtype) * share.share(kernel.group))
    return share.launch_s + max(memory, compute)


def estimate(kernels: Iterable[Kernel], card: Card, share: Efficiency) -> dict:
    """The step's estimated time, its kernels' times, and both grouped by GROUPS."""
    rows, groups = [], {g: {"ms": 0.0, "gb": 0.0, "kernels": 0} for g in GROUPS}
    for kernel in kernels:
        seconds = kernel_seconds(kernel, card, share)
        rows.append((kernel, seconds))
        group = groups[kernel.group]
        group["ms"] += seconds * 1e3
        group["gb"] += kernel.bytes / 1e9
        group["kernels"] += 1
    total = sum(s for _, s in rows) * 1e3
    return {
        "estimated_ms": round(total, 2),
        "card": card.name,
        "efficiency": asdict(share),
        "by_group": {
            g: {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            for g, row in groups.items()
            if row["kernels"]
        },
        "kernel_us": [round(s * 1e6, 2) for _, s in rows],
    }


# --- what a kernel does -----------------------------------------------------------------------
# Read off the kernel's root: its op name (jax's name stack: the torch op it lowers, "jvp(linear)"
# forward and "transpose(jvp(linear))" its backward, or a Flax module's path) and source line;
# then the opcodes fused into it. First match wins.
# (the step's own code outside the model: clipping, the skip of a non-finite update, optax)
_OPTIMIZER = re.compile(r"optax|optimizer\.py|backends/jax/step\.py|clip_by_global_norm|adam", re.I)
_ATTENTION = re.compile(r"attention|fmha", re.I)
_MATMUL = re.compile(
    r"\blinear\b|aten::(mm|bmm|addmm|matmul)|convolution|conv_general|\bconv\dd\b|Conv_|Dense|einsum"
)
_NORM = re.compile(r"norm", re.I)
_ACTIVATION = re.compile(r"gelu|silu|relu|sigmoid|tanh|softmax|erf|hardswish", re.I)
_LAYOUT = re.compile(
    r"permute|transpose|roll|pad|slice|\bcat\b|stack|reshape|view|expand|flatten|clone|"
    r"contiguous|index|select|gather|unfold|window|split|chunk|squeeze"
)
_LAYOUT_OPS = {
    "transpose", "copy", "pad", "slice", "concatenate", "dynamic-slice", "dynamic-update-slice",
    "reshape", "bitcast", "broadcast", "parameter", "gather", "reverse", "iota", "constant",
}  # fmt: skip
_CAST_OPS = {"convert", "bitcast", "parameter", "reshape", "broadcast", "constant"}


def op_path(made_by: str) -> str:
    """The op name without autodiff's wrappers: "transpose(jvp(aten::permute))/transpose" is
    "aten::permute/transpose" (autodiff's transpose is no transpose of data)."""
    return re.sub(r"\b(transpose|jvp|vmap|jit)\(|\)", "", made_by)


def group_of(kind: str, made_by: str, source: str, body: set[str]) -> str:
    """The GROUPS entry of a kernel: its kind, its root's op name and source line, and the
    opcodes fused into it."""
    path = op_path(made_by)
    if kind == "copy":  # a copy XLA made (a layout, a buffer), whatever it copies
        return "layout"
    if _OPTIMIZER.search(source) or _OPTIMIZER.search(path.split("/")[0]):
        return "optimizer update"
    if _ATTENTION.search(path) or "fmha" in kind:
        return "attention"
    if kind in ("cuBLAS", "convolution") or {"dot", "convolution"} & body or _MATMUL.search(path):
        return "matmul"
    if _NORM.search(path):
        return "normalization"
    if _ACTIVATION.search(path):
        return "activation"
    if body and body <= _CAST_OPS and "convert" in body:
        return "casts"
    if _LAYOUT.search(path) or (body and body <= _LAYOUT_OPS | {"convert"}):
        return "layout"
    return "other"
