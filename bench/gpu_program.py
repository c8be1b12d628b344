"""Benchmark: the program an H200 runs for a training step, compiled on this machine without a GPU.

XLA:GPU compiles for a device it is only told of. JAX's CUDA plugin (`pip install -e
".[gpu-program]"`: the plugin at jax's own version, ptxas, libdevice and cuDNN, no CUDA runtime)
makes a compile-only device from an H200's target configuration
(jax.experimental.topologies.get_topology_desc), and with JAX_PLATFORMS=cpu a step lowered for
'cuda' and placed on that device goes through XLA:GPU's whole pipeline: fusion, GEMM rewriting,
PTX to cubin. accel's step is `engine.lowered_step(images, targets, platforms=("cuda",))`,
lowered with the attention a GPU takes ("auto": cuDNN's flash attention for ViT-B's 197 tokens,
XLA's for Swin's biased windows); the plain Flax ViT-B/16 step (bench/memory_anatomy.py's, its
tokens padded to 208 for cuDNN's flash attention) is compiled the same way. Batch 128, O1.

What it tells is the GPU's: which ops fuse into which kernels, their dtypes, the buffers and
their sizes, XLA's memory analysis. What it cannot tell: time (nothing runs), nor which GEMM
configuration autotuning would pick (without a device each dot takes the first configuration
that compiles; --xla_gpu_enable_triton_gemm=false keeps every dot on cuBLAS, as the H200 ran
them, where XLA's own Triton GEMMs would take tiles too small for ViT-B). The target
configuration is bench/results/h200-target-config.txtpb where a GPU has written it (the card's
own), else H200_TARGET below, written from the card's public figures.

Per program: `kernels` (the launches of XLA's thunk sequence: fusions, cuBLAS and cuDNN calls,
copies) and `kernels_by_kind`; `memory_gib` (XLA's memory analysis: arguments + temporaries, the
figure set against the H200's measured peak) with its parts; `bytes_gb` (what the kernels read
and write: each kernel's operands and results, from the optimised module); the 20 largest
buffers live at the peak (shape, dtype, the op and the source line that made them) and the 20
largest kernels by bytes with their dtypes.

    python bench/gpu_program.py --program accel_vit_base_patch16_224
    python bench/gpu_program.py --program accel_swin_tiny_patch4_window7_224 --remat dots
    python bench/gpu_program.py --record h200-program   # every program, each in its own process

About 2 to 5 minutes a program on 2 cores (most of it ptxas).
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import versions, write_result  # noqa: E402
from bench.memory_anatomy import Program, accel_batch, peak_buffers  # noqa: E402
from bench.step_anatomy import Op, computations, marker, target  # noqa: E402

ACCEL = ("vit_base_patch16_224", "swin_tiny_patch4_window7_224")
FLAX = "flax_vit_base_patch16_224"
PROGRAMS = (*(f"accel_{m}" for m in ACCEL), FLAX)
BATCH, TOP = int(os.environ.get("GPU_PROGRAM_BATCH", 128)), 20
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

    engine, remat = accel_engine(name.removeprefix("accel_"), remat, attention="auto")
    exported = engine.lowered_step(*accel_batch(BATCH), platforms=("cuda",))
    args, kwargs = on_device(jax.tree.unflatten(exported.in_tree, exported.in_avals), device)
    # The state (weights, optimizer state, EMA, count, constants) is donated, as the step is.
    call = jax.jit(exported.call, donate_argnums=tuple(range(5)))
    lowered = call.lower(*args, **kwargs)
    return lowered.compile(), remat, time.perf_counter() - started


# --- reading the program ----------------------------------------------------------------------
def nbytes(type_: str) -> int:
    """Bytes of an HLO type, a tuple's summed."""
    type_ = re.sub(r"\{[\d,:A-Z()]*\}", "", type_)  # layouts
    return sum(
        DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in ARRAYS.findall(type_)
    )


def kernel_kind(op: Op) -> str:
    if op.opcode == "fusion":
        return f"fusion {op.attribute('kind') or '?'}"
    if op.opcode == "custom-call":
        name = target(op)
        return "cuBLAS" if "cublas" in name else "cuDNN" if "cudnn" in name else name
    return op.opcode


def launches(thunks: str) -> Counter[str]:
    """Kernel launches of the thunk sequence, by thunk kind (containers left out)."""
    kinds = re.findall(r"^\s*\d+: (k\w+)", thunks, re.M)
    return Counter(k for k in kinds if k not in CONTAINERS)


def kernels(text: str) -> list[dict]:
    """Each instruction of the entry computation that becomes work on the device (fusions,
    library calls, copies): its kind, bytes read and written, and dtypes."""
    entry = computations(text).get("ENTRY", [])
    types = {op.name: op.type for op in entry}
    free = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
    rows = []
    for op in entry:
        if op.opcode in free or marker(op):
            continue
        read = sum(nbytes(types.get(name, "")) for name in op.operands())
        dtypes = sorted({d for d, _ in ARRAYS.findall(op.type)})
        rows.append(
            {
                "name": op.name,
                "kind": kernel_kind(op),
                "bytes": read + nbytes(op.type),
                "result": re.sub(r"\{[\d,:A-Z()]*\}", "", op.type)[:120],
                "operand_dtypes": sorted(
                    {d for n in op.operands() for d, _ in ARRAYS.findall(types.get(n, ""))}
                ),
                "dtypes": dtypes,
                "op": op,
            }
        )
    return rows


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
    program = Program(text, BATCH, bf16_matmuls=True)
    largest = sorted(rows, key=lambda r: -r["bytes"])[:TOP]
    for row in largest:
        row["made_by"], row["source"] = program.made_by(row["op"])
    by_kind = launches(thunks)
    peak = peak_buffers(text, live, BATCH, TOP, bf16_matmuls=True)
    return {
        "program": name,
        "batch": BATCH,
        "amp": "O1",
        "remat": remat,
        "target": source,
        "xla_flags": " ".join(FLAGS),
        "kernels": sum(by_kind.values()),
        "kernels_by_kind": dict(by_kind.most_common()),
        "instructions_by_kind": dict(Counter(r["kind"] for r in rows).most_common()),
        "memory_gib": round((memory["argument"] + memory["temp"]) / 2**30, 2),
        "memory_bytes": memory,
        "bytes_gb": round(sum(r["bytes"] for r in rows) / 1e9, 2),
        "largest_buffers": peak["largest"],
        "peak_by_category": peak["by_category"],
        "largest_kernels": [
            {k: v for k, v in row.items() if k != "op"} | {"bytes": row["bytes"]} for row in largest
        ],
        "lower_compile_s": round(lower_s, 1),
    }


# --- the record -------------------------------------------------------------------------------
def key_of(name: str, remat: str) -> str:
    return name if remat == "none" else f"{name}-remat_{remat}"


def gib(n: float) -> str:
    return f"{n:6.2f} GiB"


def show(records: dict[str, dict]) -> None:
    """The programs side by side, then each one's largest buffers and kernels."""
    print(f"\n{'program':<48} {'kernels':>8} {'memory':>10} {'bytes':>9}  by kind")
    for key, r in records.items():
        kinds = ", ".join(f"{k} {v}" for k, v in r["kernels_by_kind"].items())
        print(
            f"{key:<48} {r['kernels']:>8} {gib(r['memory_gib'])} {r['bytes_gb']:>6.1f} GB  {kinds}"
        )
    for key, r in records.items():
        print(f"\n{key}: largest buffers at the peak")
        for row in r["largest_buffers"][:10]:
            print(
                f"  {row['bytes'] / 2**20:9.1f} MiB {row['count']:>3} x {row['type']:<26} ", end=""
            )
            print(f"{row['made_by'][:60]} @ {row['source']}")
        print(f"{key}: largest kernels by bytes")
        for row in r["largest_kernels"][:10]:
            print(
                f"  {row['bytes'] / 1e6:9.1f} MB {row['kind']:<14} {','.join(row['dtypes']):<10} ",
                end="",
            )
            print(f"{row['made_by'][:60]} @ {row['source']}")


def run_one(name: str, remat: str, folder: Path) -> dict:
    """One program in a process of its own (XLA reads its flags once, and its dump is its)."""
    out = folder / f"{key_of(name, remat)}.json"
    with tempfile.TemporaryDirectory() as dump:
        flags = [*FLAGS, f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
        argv = [sys.executable, __file__, "--program", name, "--remat", remat, "--json", str(out)]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name} (remat {remat}) failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def record(tag: str, remats: list[str]) -> int:
    path = ROOT / "bench" / "results" / f"{tag}.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in PROGRAMS:
            for remat in remats if name != FLAX else ["none"]:
                started = time.perf_counter()
                records[key_of(name, remat)] = run_one(name, remat, Path(tmp))
                print(f"{key_of(name, remat)}: {time.perf_counter() - started:.0f} s", flush=True)
    show(records)
    # What earlier records kept beside the programs (the figures before a change) stays.
    extra = {k: v for k, v in kept.items() if k not in ("date", "device", "versions", "programs")}
    note = "compiled on this CPU for an H200 target (deviceless: no autotuning, nothing run)"
    write_result(tag, {"compiled_for": "NVIDIA H200", "how": note, **extra, "programs": records})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", choices=PROGRAMS)
    parser.add_argument("--remat", default="none", choices=("none", "dots", "full"))
    parser.add_argument("--record", metavar="TAG", help="every program into bench/results/TAG.json")
    parser.add_argument("--remats", default="none,dots", help="remat choices --record compiles")
    parser.add_argument("--json", help="(one program) where to write its figures")
    args = parser.parse_args(argv)
    if args.record:
        return record(args.record, args.remats.split(","))
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
