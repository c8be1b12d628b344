"""Benchmark: the program an H200 runs for a training step, compiled on this machine without a GPU,
and its estimated time.

XLA:GPU compiles for a device it is only told of. JAX's CUDA plugin (`pip install -e
".[gpu-program]"`: the plugin at jax's own version, ptxas, libdevice and cuDNN pinned to the
target's CUDA 13.0 and cuDNN 9.12, no CUDA runtime) makes a compile-only device from an H200's
target configuration (jax.experimental.topologies.get_topology_desc), and with JAX_PLATFORMS=cpu a
step lowered for 'cuda' and placed on that device goes through XLA:GPU's whole pipeline: fusion,
GEMM rewriting, PTX to cubin. accel's step is `engine.lowered_step(images, targets,
platforms=("cuda",))`, lowered with the attention a GPU takes ("auto": cuDNN's flash attention
for ViT-B's 197 tokens, the fused Pallas window kernel for Swin's biased windows); the plain Flax
ViT-B/16 step (bench/memory_anatomy.py's, its tokens padded to 208 for cuDNN's flash attention)
is compiled the same way. Batch 128, O1.

What it tells is the GPU's: which ops fuse into which kernels, their dtypes, the buffers and
their sizes, XLA's memory analysis; and from those, each kernel's estimated time
(bench/gpu_estimate.py: a roofline of its bytes and matmul flops at calibrated shares of the
H200's peaks, plus a launch). What it cannot tell: a measured time (nothing runs), nor which GEMM
configuration autotuning would pick (without a device each dot takes the first configuration
that compiles; --xla_gpu_enable_triton_gemm=false keeps every dot on cuBLAS, where XLA's own
Triton GEMMs would take tiles too small for ViT-B). The target configuration is
bench/results/h200-target-config.txtpb where a GPU has written it (the card's own), else
H200_TARGET below, written from the card's public figures.

Per program: `kernels` (the launches of XLA's thunk sequence) and `kernels_by_kind`;
`memory_gib` (XLA's memory analysis: arguments + temporaries) with its parts; `bytes_gb` (what
the kernels read and write); `estimated_ms` and `by_group` (time and bytes by what the kernels
do: matmul, attention, normalization, activation, casts, layout, optimizer update, other); the 20
largest buffers live at the peak and the 20 slowest kernels; every kernel, one a row, in
TAG-kernels.json beside the record.

    python bench/gpu_program.py --program accel_swin_tiny_patch4_window7_224
    python bench/gpu_program.py --record h200-program   # every program, each in its own process
    python bench/gpu_program.py --record h200-program --remats none \
        --programs accel_swin_tiny_patch4_window7_224 --change "what it does"  # a change, kept
    python bench/gpu_program.py --record h200-program --calibrate 3de8c44  # against the H200
    python bench/gpu_program.py --record h200-program --estimate   # estimated again, no compile

10 s to 1 minute a program on 2 cores (most of it ptxas).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import versions, write_result  # noqa: E402
from bench.gpu_estimate import (  # noqa: E402
    CALIBRATED,
    CALIBRATION_FACTOR,
    GROUPS,
    H200,
    NOMINAL,
    Efficiency,
    Kernel,
    best_factor,
    estimate,
    group_of,
    scaled,
)
from bench.memory_anatomy import Program, accel_batch, peak_buffers  # noqa: E402
from bench.step_anatomy import Op, marker, target  # noqa: E402

LIBRARY = "GPU_PROGRAM_LIBRARY"  # a folder holding another commit's accel package (calibration)
if os.environ.get(LIBRARY):  # that accel before this checkout's (the imports above put it first)
    sys.path.insert(0, os.environ[LIBRARY])

ACCEL = ("vit_base_patch16_224", "swin_tiny_patch4_window7_224")
FLAX = "flax_vit_base_patch16_224"
PROGRAMS = (*(f"accel_{m}" for m in ACCEL), FLAX)
BATCH, TOP = int(os.environ.get("GPU_PROGRAM_BATCH", 128)), 20
# accel's attention choice for its steps: "auto", as a GPU run takes by default.
ATTENTION = os.environ.get("GPU_PROGRAM_ATTENTION", "auto")
FLAGS = ("--xla_gpu_enable_triton_gemm=false",)  # cuBLAS for every dot (no autotuning here)
CARD_CONFIG = ROOT / "bench" / "results" / "h200-target-config.txtpb"
# An H200 SXM from its public figures (132 SMs at 1.98 GHz, 4.8 TB/s, 50 MiB of L2, 228 KiB of
# shared memory an SM, compute capability 9.0, 141 GB), with the CUDA 13 and cuDNN 9.12 the
# plugin's wheels bring: the versions decide which kernels XLA may use.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  name: "NVIDIA H200"
  dnn_version: "9.12.0"
  runtime_version: "13.0.0"
  driver_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 patch: 0 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""
# Thunks that hold others (their launches are counted inside them).
CONTAINERS = {"kCommandBuffer", "kSequential", "kWhile", "kConditional", "kDynamicSlice"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
DTYPE_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ARRAYS = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


# --- the device and the steps -----------------------------------------------------------------
def target_config() -> tuple[str, str]:
    """The H200's target configuration, and where it came from."""
    if CARD_CONFIG.exists():
        return CARD_CONFIG.read_text(), str(CARD_CONFIG.relative_to(ROOT))
    return H200_TARGET, "public figures (bench/gpu_program.py)"


def h200(config: str) -> Any:
    """A compile-only H200: nothing runs on it, XLA:GPU compiles for it."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
    return topology.devices[0]


def on_device(specs: Any, device: Any) -> Any:
    import jax

    placed = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placed), specs)


def compiled_program(name: str, remat: str, device: Any) -> tuple[Any, str, float]:
    """(the compiled step, remat it ran with, seconds to lower) for program `name`."""
    import jax

    started = time.perf_counter()
    if name == FLAX:
        from bench.memory_anatomy import flax_step

        fn, args = flax_step(BATCH, implementation="cudnn", pad_to=208)
        lowered = fn.lower(*on_device(args, device))
        return lowered.compile(), "none", time.perf_counter() - started
    from bench.memory_anatomy import accel_engine

    engine, remat = accel_engine(name.removeprefix("accel_"), remat, attention=ATTENTION)
    exported = exported_step(engine, accel_batch(BATCH))
    args, kwargs = on_device(jax.tree.unflatten(exported.in_tree, exported.in_avals), device)
    # The state (weights, optimizer state, EMA, count, constants) is donated, as the step is.
    call = jax.jit(exported.call, donate_argnums=tuple(range(5)))
    lowered = call.lower(*args, **kwargs)
    return lowered.compile(), remat, time.perf_counter() - started


def exported_step(engine: Any, batch: tuple) -> Any:
    """The engine's step exported for CUDA: `engine.lowered_step(..., platforms=)`, or, for a
    library from before it (a calibration's commit), the same done through that library's own
    parts: its jitted step traced with cuDNN's attention allowed, then jax.export."""
    import inspect

    import jax

    if "platforms" in inspect.signature(engine.lowered_step).parameters:
        return engine.lowered_step(*batch, platforms=("cuda",))
    runner, step = engine.runner, engine.runner.step
    stacked = runner.stacked(engine.steps.micro_batches(tuple(batch)))
    # cuDNN's attention calls, forward and backward, with and without a bias and dropout (the
    # library of then named none: jax.export refuses them unless told)
    calls = [f"__cudnn$fmha{b}Softmax{d}" for b in ("", "ScaleBias") for d in ("", "Dropout")]
    unchecked = [
        jax.export.DisabledSafetyCheck.custom_call(c + w) for c in calls for w in ("", "Backward")
    ]
    step.attention.flash = True  # the kernels a GPU would take, as lowered_step(platforms=)
    with step.tracer.tracing():
        args = step.arguments(stacked, engine.rates(engine.state.step), 0.0)
        return jax.export.export(step._jit(), platforms=("cuda",), disabled_checks=unchecked)(*args)


# --- reading the program ----------------------------------------------------------------------
def nbytes(type_: str) -> int:
    """Bytes of an HLO type, a tuple's summed."""
    type_ = re.sub(r"\{[\d,:A-Z()]*\}", "", type_)  # layouts
    return sum(
        DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in ARRAYS.findall(type_)
    )


def arrays(type_: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of each array of an HLO type, a tuple's in order."""
    type_ = re.sub(r"\{[\d,:A-Z()]*\}", "", type_)
    return [(d, [int(n) for n in dims.split(",") if n]) for d, dims in ARRAYS.findall(type_)]


def kernel_kind(op: Op) -> str:
    if op.opcode == "fusion":
        return f"fusion {op.attribute('kind') or '?'}"
    if op.opcode == "custom-call":
        name = target(op)
        if "cublas" in name:
            return "cuBLAS"
        if "fmha" in name:
            return "cuDNN fmha"
        if "cudnn" in name and "conv" in name:
            return "convolution"
        return "cuDNN" if "cudnn" in name else "Triton" if "triton" in name else name
    return op.opcode


def launches(thunks: str) -> Counter[str]:
    """Kernel launches of the thunk sequence, by thunk kind (containers left out)."""
    kinds = re.findall(r"^\s*\d+: (k\w+)", thunks, re.M)
    return Counter(k for k in kinds if k not in CONTAINERS)


def _contracted(operand: list[int], spec: str) -> int:
    dims = [int(d) for d in re.findall(r"\d+", spec)]
    return math.prod(operand[d] for d in dims)


def matmul_work(op: Op, shapes: dict[str, str], body: list[Op]) -> tuple[float, str]:
    """(flops, operand dtype) of what a kernel multiplies: a cuBLAS call, a convolution, a
    fused attention (its tokens as the kernel pads them), or dots fused into it; (0, "")
    for a kernel that only moves or combines values elementwise."""
    operands = [arrays(shapes.get(n, "")) for n in op.operands()]
    first = [a[0] for a in operands if a]
    if not first:
        return 0.0, ""
    dtype, lhs = first[0]
    out = arrays(op.type)[0][1] if arrays(op.type) else []
    kind = kernel_kind(op)
    if kind == "cuBLAS":
        spec = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.rest)
        return 2.0 * math.prod(out) * _contracted(lhs, spec.group(1) if spec else ""), dtype
    if kind == "convolution":
        return conv_flops(op, [a for _, a in first], out), dtype
    if kind in ("cuDNN fmha", "Triton") and len(lhs) == 4:
        return attention_flops(op, lhs), dtype
    dots = [o for o in body if o.opcode == "dot"]
    if dots:
        inner = {o.name: o.type for o in body}
        total = 0.0
        for dot in dots:
            left = arrays(inner.get(dot.operands()[0], ""))
            spec = dot.attribute("lhs_contracting_dims") or "{}"
            total += 2.0 * math.prod(dot.dims) * (_contracted(left[0][1], spec) if left else 0)
        return total, dtype
    return 0.0, ""


def conv_flops(op: Op, operands: list[list[int]], out: list[int]) -> float:
    """2 x the forward convolution's outputs x its window x its input features; the forward
    convolution read off the dimension labels (a backward's operands and result are its)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", op.rest)
    window = re.search(r"window=\{size=([\dx]+)", op.rest)
    if labels is None or len(operands) < 2:
        return 0.0
    taps = math.prod(int(n) for n in window.group(1).split("x")) if window else 1
    lhs_labels, _, out_labels = labels.groups()
    name = target(op)
    if "BackwardFilter" in name:
        image, grads = operands[0], operands[1]
    elif "BackwardInput" in name:
        image, grads = out, operands[0]
    else:
        image, grads = operands[0], out
    features = image[lhs_labels.index("f")]
    return 2.0 * math.prod(grads) * taps * features if out_labels else 0.0


def attention_flops(op: Op, query: list[int]) -> float:
    """A fused attention's matmul work, [B, T, heads, D] queries: two matmuls of T x T x D a
    head forward, five backward (the scores again, dV, dP, dQ, dK); T as the kernel tiles it
    (cuDNN's 208 arrives padded; a Pallas kernel pads 49 tokens to 64 in its registers)."""
    batch, tokens, heads, dim = query
    tile = 2 ** math.ceil(math.log2(tokens)) if "triton" in target(op) else tokens
    matmuls = 5 if re.search(r"[Bb]ackward|bwd|transpose\(", op.rest) else 2
    return 2.0 * matmuls * batch * heads * tile * tile * dim


def kernel_names(entry: list[Op]) -> dict[str, str]:
    """The kernel each instruction launches, by the name a profile shows: XLA:GPU compiles
    identical fusions once and says so (`deduplicated_name`), '.' written as '_'."""
    names = {}
    for op in entry:
        shared = re.search(r'deduplicated_name="([^"]+)"', op.rest)
        names[op.name] = (shared.group(1) if shared else op.name).replace(".", "_")
    return names


def kernels(text: str) -> list[dict]:
    """Each instruction of the entry computation that becomes work on the device (fusions,
    library calls, copies): its kind, the group of what it does, bytes read and written, the
    flops of its matmuls, its dtypes and what made it."""
    program = Program(text, BATCH, bf16_matmuls=True)
    entry = program.comps.get("ENTRY", [])
    shapes = {op.name: op.type for op in entry}
    free = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
    work = [op for op in entry if op.opcode not in free and not marker(op)]
    names = kernel_names(work)
    rows = []
    for op in work:
        body = program.body(op)
        made_by, source = program.made_by(op)
        kind = kernel_kind(op)
        flops, matmul_dtype = matmul_work(op, shapes, body)
        rows.append(
            {
                "name": op.name,
                "kernel": names[op.name],
                "kind": kind,
                "group": group_of(kind, made_by, source, {o.opcode for o in body}),
                "bytes": sum(nbytes(shapes.get(n, "")) for n in op.operands()) + nbytes(op.type),
                "flops": flops,
                "matmul_dtype": matmul_dtype,
                "result": re.sub(r"\{[\d,:A-Z()]*\}", "", op.type)[:120],
                "operand_dtypes": sorted(
                    {d for n in op.operands() for d, _ in ARRAYS.findall(shapes.get(n, ""))}
                ),
                "dtypes": sorted({d for d, _ in ARRAYS.findall(op.type)}),
                "made_by": made_by,
                "source": source,
                "fused": ",".join(sorted({o.opcode for o in body})),
            }
        )
    return rows


def as_kernels(rows: list[dict]) -> list[Kernel]:
    return [
        Kernel(r["kernel"], r["kind"], r["group"], r["bytes"], r["flops"], r["matmul_dtype"])
        for r in rows
    ]


# The columns of a program's kernel table (one row a kernel, in the order the step runs them):
# enough to estimate it again with other efficiencies, without compiling.
TABLE = ("name", "kernel", "kind", "group", "bytes", "flops", "matmul_dtype", "made_by", "source")
TABLE += ("fused",)  # the opcodes fused into it, comma-separated


def table_rows(table: list[list]) -> list[dict]:
    """A kernel table's rows as dicts, each grouped again by this file's rules (a table of an
    earlier record, without a source or opcodes, keeps the group it was written with)."""
    rows = [dict(zip(TABLE, row, strict=False)) for row in table]
    for row in rows:
        if "fused" in row:
            ops = set(filter(None, row["fused"].split(",")))
            row["group"] = group_of(row["kind"], row["made_by"], row["source"], ops)
    return rows


def estimated(rows: list[dict], launched: int, share: Efficiency = CALIBRATED) -> dict:
    """The program's estimate: its instructions' rooflines, plus a launch for each of the
    thunk sequence's kernels that no instruction accounts for (a fusion that launches two)."""
    found = estimate(as_kernels(rows), H200, share)
    extra = max(0, launched - len(rows)) * share.launch_s * 1e3
    if extra:
        found["estimated_ms"] = round(found["estimated_ms"] + extra, 2)
        other = found["by_group"].setdefault("other", {"ms": 0.0, "gb": 0.0, "kernels": 0})
        other["ms"] = round(other["ms"] + extra, 3)
    return found


def read_dump(folder: Path) -> tuple[str, str, str]:
    """The optimised module's text, its live ranges and its thunk sequence."""
    found = sorted(folder.glob("*.jit_*.sm_*_gpu_after_optimizations.txt"))
    if not found:
        raise SystemExit(f"no GPU program in XLA's dump at {folder}")
    text = max(found, key=lambda p: p.stat().st_size)  # the step, not a small helper
    stem = text.name.split(".sm_")[0]
    thunks = text.with_name(f"{stem}.thunk_sequence_after_thunk_passes.txt")
    live = text.with_name(text.stem + "-live-range.txt")
    return text.read_text(), live.read_text(), thunks.read_text()


def anatomy(name: str, remat: str, dump: Path) -> dict:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # compiled here, so it dumps
    config, source = target_config()
    compiled, remat, lower_s = compiled_program(name, remat, h200(config))
    stats = compiled.memory_analysis()
    memory = {
        key: getattr(stats, f"{key}_size_in_bytes")
        for key in ("argument", "output", "alias", "temp")
    }
    text, live, thunks = read_dump(dump)
    rows = kernels(text)
    by_kind = launches(thunks)
    found = estimated(rows, sum(by_kind.values()))
    for row, us in zip(rows, found.pop("kernel_us"), strict=True):
        row["estimated_us"] = us
    largest = sorted(rows, key=lambda r: -r["bytes"])[:TOP]
    slowest = sorted(rows, key=lambda r: -r["estimated_us"])[:TOP]
    peak = peak_buffers(text, live, BATCH, TOP, bf16_matmuls=True)
    return {
        "program": name,
        "batch": BATCH,
        "amp": "O1",
        "remat": remat,
        "attention": ATTENTION if name != FLAX else "cudnn (padded to 208)",
        "target": source,
        "xla_flags": " ".join(FLAGS),
        "kernels": sum(by_kind.values()),
        "kernels_by_kind": dict(by_kind.most_common()),
        "instructions_by_kind": dict(Counter(r["kind"] for r in rows).most_common()),
        "memory_gib": round((memory["argument"] + memory["temp"]) / 2**30, 2),
        "memory_bytes": memory,
        "bytes_gb": round(sum(r["bytes"] for r in rows) / 1e9, 2),
        **found,
        "largest_buffers": peak["largest"],
        "peak_by_category": peak["by_category"],
        "largest_kernels": [brief(row) for row in largest],
        "slowest_kernels": [brief(row) for row in slowest],
        "kernel_table": [[row[k] for k in TABLE] for row in rows],
        "lower_compile_s": round(lower_s, 1),
    }


def brief(row: dict) -> dict:
    keep = ("name", "kernel", "kind", "group", "bytes", "estimated_us", "result", "dtypes")
    return {k: row[k] for k in (*keep, "operand_dtypes", "made_by", "source")}


# --- the record -------------------------------------------------------------------------------
# The profile an H200 measured (bench/results/gpu-check-nvidia-h200.json, 2026-11-27, fed steps,
# batch 128, O1): each step's device time, compile's beside jax's.
PROFILE = ROOT / "bench" / "results" / "gpu-check-nvidia-h200.json"
MEASURED_AT = "3de8c44"  # the commit that profile ran
MODEL_OF = {f"accel_{m}": m for m in ACCEL}


def measured_profile() -> dict[str, dict[str, dict]]:
    """{model: {backend: {"ms": device time a step, "top": [(kernel, ms a step, calls)]}}}
    from the H200's profile stage."""
    if not PROFILE.exists():
        return {}
    rows = json.loads(PROFILE.read_text())["stages"].get("profile", {}).get("rows", [])
    found: dict[str, dict[str, dict]] = {}
    for row in rows:
        streams = row.get("profile", {})
        main = max(streams.values(), key=lambda s: s["ms_per_step"], default=None)
        if main is not None:
            top = [(k["name"], k["ms_per_step"], k["calls"]) for k in main["top"]]
            entry = {"ms": main["ms_per_step"], "top": top}
            found.setdefault(row["model"], {})[row["backend"]] = entry
    return found


def key_of(name: str, remat: str) -> str:
    return name if remat == "none" else f"{name}-remat_{remat}"


def gib(n: float) -> str:
    return f"{n:6.2f} GiB"


def compile_ms(key: str) -> float | None:
    """torch.compile's measured device time a step for the program's model, where measured."""
    model = MODEL_OF.get(key.split("-remat_")[0])
    return measured_profile().get(model or "", {}).get("compile", {}).get("ms")


def show(records: dict[str, dict]) -> None:
    """The programs side by side, where each one's estimated time goes, then each one's
    largest buffers and slowest kernels."""
    print(f"\n{'program':<48} {'kernels':>8} {'memory':>10} {'bytes':>9} {'estimate':>9}")
    for key, r in records.items():
        line = f"{key:<48} {r['kernels']:>8} {gib(r['memory_gib'])} {r['bytes_gb']:>6.1f} GB"
        print(f"{line} {r.get('estimated_ms', float('nan')):>6.1f} ms")
    print(grouped_table(records))
    for key, r in records.items():
        print(f"\n{key}: largest buffers at the peak")
        for row in r["largest_buffers"][:8]:
            print(
                f"  {row['bytes'] / 2**20:9.1f} MiB {row['count']:>3} x {row['type']:<26} ", end=""
            )
            print(f"{row['made_by'][:60]} @ {row['source']}")
        print(f"{key}: slowest kernels (estimated)")
        for row in r.get("slowest_kernels", r["largest_kernels"])[:8]:
            print(
                f"  {row.get('estimated_us', 0):8.1f} us {row['bytes'] / 1e6:8.1f} MB "
                f"{row['kind']:<12} {row['made_by'][:60]} @ {row['source']}"
            )


def grouped_table(records: dict[str, dict]) -> str:
    """Estimated ms and GB by what the kernels do, one column a program (remat left out), with
    torch.compile's measured device time a step beside."""
    shown = {k: r for k, r in records.items() if "-remat_" not in k and "by_group" in r}
    if not shown:
        return ""
    short = {k: k.removeprefix("accel_").split("_patch")[0] for k in shown}
    lines = [f"\n{'estimated on an H200':<20}" + "".join(f"{short[k]:>22}" for k in shown)]
    lines.append(f"{'':<20}" + "".join(f"{'ms':>11}{'GB':>11}" for _ in shown))
    for group in GROUPS:
        cells = []
        for r in shown.values():
            g = r["by_group"].get(group, {"ms": 0.0, "gb": 0.0})
            cells.append(f"{g['ms']:>11.2f}{g['gb']:>11.2f}")
        lines.append(f"{group:<20}" + "".join(cells))
    lines.append(
        f"{'step':<20}"
        + "".join(f"{r['estimated_ms']:>11.2f}{r['bytes_gb']:>11.2f}" for r in shown.values())
    )
    measured = [compile_ms(k) for k in shown]
    lines.append(
        f"{'compile, measured':<20}"
        + "".join(f"{m:>11.2f}{'':>11}" if m else f"{'-':>11}{'':>11}" for m in measured)
    )
    return "\n".join(lines)


def run_one(name: str, remat: str, folder: Path, library: Path | None = None) -> dict:
    """One program in a process of its own (XLA reads its flags once, and its dump is its);
    `library`: the accel package to import instead of this checkout's."""
    out = folder / f"{key_of(name, remat)}.json"
    with tempfile.TemporaryDirectory() as dump:
        flags = [*FLAGS, f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
        if library is not None:
            env[LIBRARY] = str(library)
        argv = [sys.executable, __file__, "--program", name, "--remat", remat, "--json", str(out)]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name} (remat {remat}) failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def compiled_with() -> dict:
    """What compiled the record: the commit, the CUDA plugin, ptxas's and cuDNN's wheels, and
    what this machine cannot do as a GPU would."""
    import importlib.metadata as md

    wheels = {}
    for name in ("jax-cuda13-plugin", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cudnn-cu13"):
        try:
            wheels[name] = md.version(name)
        except md.PackageNotFoundError:
            wheels[name] = None
    return {
        "commit": commit_of(ROOT),
        "wheels": wheels,
        "gemm": "cuBLAS for every dot (--xla_gpu_enable_triton_gemm=false); no autotuning "
        "without a device, so each call takes cuBLAS's first algorithm; the H200 ran XLA's "
        "autotuned choice, some dots as Triton fusions (fusion_733, fusion_2253)",
        "cudnn_workspace": "0 bytes: cuDNN's calls compile deviceless with an empty workspace "
        "(memory_gib reads low by what a GPU's cuDNN asks for)",
        "bytes": "each kernel's operands and results whole, a cuBLAS call's 4 MiB scratch "
        "included; a kernel that reads a slice of an operand is counted for all of it",
    }


def commit_of(folder: Path) -> str:
    """The checkout's commit, '+changes' where its tracked files differ from it."""
    git = ["git", "-C", str(folder)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "accel", "bench"])
    return head.stdout.strip() + ("+changes" if dirty.returncode else "")


FIGURES = ("kernels", "bytes_gb", "memory_gib", "estimated_ms")


def tables_path(tag: str) -> Path:
    return ROOT / "bench" / "results" / f"{tag}-kernels.json"


def read_record(tag: str) -> dict:
    """bench/results/TAG.json with each program's kernel table (kept apart, TAG-kernels.json)
    put back."""
    path = ROOT / "bench" / "results" / f"{tag}.json"
    if not path.exists():
        return {}
    kept = json.loads(path.read_text())
    tables = json.loads(tables_path(tag).read_text()) if tables_path(tag).exists() else {}
    for where, programs in (
        ("", kept.get("programs", {})),
        ("calibration/", kept.get("calibration", {}).get("programs", {})),
    ):
        for key, program in programs.items():
            if f"{where}{key}" in tables:
                program.setdefault("kernel_table", tables[f"{where}{key}"])
    return kept


def write_record(tag: str, record: dict) -> None:
    """The record with write_result's stamp; its kernel tables apart, one kernel a line."""
    tables = {}
    for where, programs in (
        ("", record.get("programs", {})),
        ("calibration/", record.get("calibration", {}).get("programs", {})),
    ):
        for key, program in programs.items():
            if "kernel_table" in program:
                tables[f"{where}{key}"] = program.pop("kernel_table")
    write_result(tag, record)
    lines = [
        f"  {json.dumps(key)}: [\n" + ",\n".join(f"    {json.dumps(row)}" for row in rows) + "\n  ]"
        for key, rows in tables.items()
    ]
    tables_path(tag).write_text("{\n" + ",\n".join(lines) + "\n}\n")


def record(tag: str, remats: list[str], programs: list[str], change: dict | None = None) -> int:
    """The programs compiled into bench/results/TAG.json, the others kept as they were. With
    `change` ({"change": what, "kept": bool, "why": ...}): an entry of the record's "changes"
    with each compiled program's figures before and after; a change not kept leaves the
    programs as they were."""
    kept = read_record(tag)
    records = dict(kept.get("programs", {}))
    compiled = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in programs:
            for remat in remats if name != FLAX else ["none"]:
                started = time.perf_counter()
                compiled[key_of(name, remat)] = run_one(name, remat, Path(tmp))
                print(f"{key_of(name, remat)}: {time.perf_counter() - started:.0f} s", flush=True)
    if change is not None:
        entry = dict(change)
        for key, after in compiled.items():
            before = records.get(key, {})
            entry[key] = {
                "before": {f: before.get(f) for f in FIGURES},
                "after": {f: after.get(f) for f in FIGURES},
            }
        kept["changes"] = [*kept.get("changes", []), entry]
    if change is None or change.get("kept", True):
        records |= compiled
    show(records)
    # What earlier records kept beside the programs (the figures before a change) stays.
    skip = ("date", "device", "versions", "programs", "compiled_with", "grouped")
    extra = {k: v for k, v in kept.items() if k not in skip}
    note = "compiled on this CPU for an H200 target (deviceless: no autotuning, nothing run)"
    write_record(
        tag,
        {
            "compiled_for": "NVIDIA H200",
            "how": note,
            "compiled_with": compiled_with(),
            **extra,
            "grouped": grouped_table(records).strip().splitlines(),
            "programs": records,
        },
    )
    return 0


# --- calibration: the estimate against what the H200 measured ---------------------------------
def calibrate(tag: str, commit: str) -> int:
    """accel's programs compiled as they were at `commit` (the commit the H200's profile ran),
    estimated, and set against the measured step and kernels: the record's 'calibration'."""
    kept = read_record(tag)
    profile = measured_profile()
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(tmp) / "library"
        library.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "accel"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(library)], input=archive.stdout, check=True)
        for name in MODEL_OF:
            started = time.perf_counter()
            program = run_one(name, "none", Path(tmp), library)
            print(f"{name} at {commit}: {time.perf_counter() - started:.0f} s", flush=True)
            found[name] = program
    kept["calibration"] = calibration_block(commit, found, profile)
    write_record(tag, {k: v for k, v in kept.items() if k not in ("date", "device", "versions")})
    print(json.dumps({k: v["estimated_ms"] for k, v in found.items()}))
    return 0


def calibration_block(commit: str, programs: dict[str, dict], profile: dict) -> dict:
    """The estimate at `commit` against the H200's measured step: with NOMINAL's shares, with
    the one factor that fits both steps best, and with CALIBRATED's (the constants this file
    estimates with); and each measured top kernel against the estimate of the instructions
    that launch it here (matched by kernel name, per launch)."""
    measured = {n: profile.get(MODEL_OF[n], {}).get("jax", {}) for n in programs}
    tables = {n: table_rows(p["kernel_table"]) for n, p in programs.items()}

    def errors(share: Efficiency) -> dict[str, float]:
        return {
            n: estimated(tables[n], p["kernels"], share)["estimated_ms"] / measured[n]["ms"] - 1
            for n, p in programs.items()
            if measured[n]
        }

    fitted = best_factor(lambda f: list(errors(scaled(NOMINAL, f)).values()))
    block: dict[str, Any] = {
        "commit": commit,
        "measured": f"{PROFILE.relative_to(ROOT)} (profile stage, fed steps, batch 128, O1)",
        "nominal": asdict(NOMINAL),
        "factor_fitted": fitted,
        "factor_used": CALIBRATION_FACTOR,
        "efficiency": asdict(CALIBRATED),
        "error_nominal": {n: round(e, 3) for n, e in errors(NOMINAL).items()},
        "error": {n: round(e, 3) for n, e in errors(CALIBRATED).items()},
        "programs": {},
    }
    for name, program in programs.items():
        rows, mine_measured = tables[name], measured[name]
        found = estimated(rows, program["kernels"])
        times = dict(zip((r["name"] for r in rows), found.pop("kernel_us"), strict=True))
        block["programs"][name] = {
            "measured_ms": mine_measured.get("ms"),
            "estimated_ms": found["estimated_ms"],
            "kernels": program["kernels"],
            "bytes_gb": program["bytes_gb"],
            "memory_gib": program["memory_gib"],
            "by_group": found["by_group"],
            "top_kernels": matched_kernels(mine_measured.get("top", []), rows, times),
            "kernel_table": program["kernel_table"],
        }
    return block


def matched_kernels(top: list, rows: list[dict], times: dict[str, float]) -> list[dict]:
    """Each kernel the profile measured, beside the instructions that launch a kernel of that
    name here: both per launch (the GPU's XLA may share a kernel among more instructions)."""
    found = []
    for kernel, ms, calls in top:
        launches = calls / PROFILED_STEPS
        mine = [r for r in rows if r["kernel"] == kernel]
        row: dict[str, Any] = {
            "kernel": kernel,
            "measured_ms": ms,
            "measured_ms_a_launch": round(ms / launches, 4),
        }
        if mine:
            here = sum(times[r["name"]] for r in mine) / 1e3 / len(mine)
            row |= {"estimated_ms_a_launch": round(here, 4), "what": mine[0]["made_by"]}
        else:
            row["what"] = "no kernel of that name here"
        found.append(row)
    return found


PROFILED_STEPS = 5  # the profile stage's steps (bench/gpu_check.py)


def reestimate(tag: str) -> int:
    """Every program of the record (and its calibration) estimated again from its kernel
    table, with this file's efficiencies: no compile."""
    kept = read_record(tag)
    for program in kept["programs"].values():
        if "kernel_table" in program:
            found = estimated(table_rows(program["kernel_table"]), program["kernels"])
            found.pop("kernel_us")
            program.update(found)
    if "calibration" in kept:
        cal = kept["calibration"]
        cal.update(calibration_block(cal["commit"], cal["programs"], measured_profile()))
    kept["grouped"] = grouped_table(kept["programs"]).strip().splitlines()
    show(kept["programs"])
    write_record(tag, {k: v for k, v in kept.items() if k not in ("date", "device", "versions")})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", choices=PROGRAMS)
    parser.add_argument("--remat", default="none", choices=("none", "dots", "full"))
    parser.add_argument("--record", metavar="TAG", help="every program into bench/results/TAG.json")
    parser.add_argument("--remats", default="none,dots", help="remat choices --record compiles")
    parser.add_argument(
        "--programs", default=",".join(PROGRAMS), help="which programs --record compiles again"
    )
    parser.add_argument(
        "--calibrate",
        metavar="COMMIT",
        help=f"with --record: accel's programs at COMMIT (the H200 profile's: {MEASURED_AT}) "
        "against its measured steps",
    )
    parser.add_argument(
        "--estimate", action="store_true", help="with --record: estimate again, no compile"
    )
    parser.add_argument(
        "--change", metavar="WHAT", help="with --record: a change's figures, before and after"
    )
    parser.add_argument(
        "--not-kept", metavar="WHY", help="with --change: the change was not kept, and why"
    )
    parser.add_argument("--json", help="(one program) where to write its figures")
    args = parser.parse_args(argv)
    if args.record and args.calibrate:
        return calibrate(args.record, args.calibrate)
    if args.record and args.estimate:
        return reestimate(args.record)
    if args.record:
        change = None
        if args.change:
            change = {"change": args.change, "kept": not args.not_kept}
            change |= {"why": args.not_kept} if args.not_kept else {}
        return record(args.record, args.remats.split(","), args.programs.split(","), change)
    if not args.program:
        parser.error("give --program NAME or --record TAG")
    dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if dump is None or not args.json:  # started by hand: in a process of its own, as --record
        with tempfile.TemporaryDirectory() as tmp:
            show({key_of(args.program, args.remat): run_one(args.program, args.remat, Path(tmp))})
        return 0
    result = anatomy(args.program, args.remat, Path(dump.group(1)))
    result["versions"] = versions()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
