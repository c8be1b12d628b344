"""The training step alone: one batch already on the device, the same step again and again, no
loader and no loop. What `compare_backends.py --fed` divides the loop's img/s by (loop
efficiency). Prints one JSON line.

    python bench/fed_step.py --backend jax --model vit_base_patch16_224 --batch_size 128 \\
        --amp_level O1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accel.cli.config import RunConfig  # noqa: E402
from accel.cli.job import build_engine  # noqa: E402
from accel.cli.models.factory import ModelConfig, input_size  # noqa: E402


def fed_images_per_sec(cfg: RunConfig, steps: int, warmup: int, profile: int = 0) -> dict:
    """{"fed_images_per_sec": ..., "peak_memory_bytes": ...}, and with `profile` the device's
    top ops over 5 more steps (jax: traced by jax.profiler; eager and compile: torch's
    profiler)."""
    engine = build_engine(cfg, schedule=lambda step: 1e-4)
    size = input_size(cfg.model)[-1]
    images = torch.randint(0, 256, (cfg.batch_size, 3, size, size), dtype=torch.uint8)
    targets = torch.full((cfg.batch_size, cfg.model.num_classes), 1.0 / cfg.model.num_classes)
    (batch,) = engine.loader([(images, targets)])

    def run(count: int) -> None:
        handles = [engine.step_micro_batches([batch]) for _ in range(count)]
        engine.fetch(handles)  # one host sync at the end, as the loop does per group
        engine.synchronize()

    run(warmup)
    start = time.perf_counter()
    run(steps)
    result: dict = {"fed_images_per_sec": cfg.batch_size * steps / (time.perf_counter() - start)}
    result["peak_memory_bytes"] = engine.stats().peak_memory_bytes
    if profile:
        work = lambda: run(PROFILED_STEPS)  # noqa: E731
        on_jax = cfg.backend == "jax"
        result["profile"] = (
            device_profile(work, profile) if on_jax else torch_profile(work, profile)
        )
    return result


def torch_profile(work, top: int) -> dict:
    """Device time of `work` per kernel (eager, compile), from torch's profiler: the same
    structure as device_profile's, one line for the CUDA device."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as traced:
        work()
    device = activities[0] == ProfilerActivity.CUDA
    rows = []
    for event in traced.key_averages():
        ms = (event.self_device_time_total if device else event.self_cpu_time_total) / 1e3
        if ms > 0:
            rows.append((event.key, ms / PROFILED_STEPS, event.count))
    rows.sort(key=lambda row: -row[1])
    name = "cuda kernels" if device else "cpu ops"
    return {
        name: {
            "ms_per_step": round(sum(r[1] for r in rows), 3),
            "by_kind": by_kind((k, ms) for k, ms, _ in rows),
            "top": [
                {"name": k[:160], "ms_per_step": round(ms, 3), "calls": calls, "stats": {}}
                for k, ms, calls in rows[:top]
            ],
        }
    }


PROFILED_STEPS = 5


def device_profile(work, top: int) -> dict:
    """Device time of `work` per op, from a jax.profiler trace read with jax.profiler.ProfileData:
    for each line of the device's plane ("XLA Ops", each stream's kernels), its total and the
    `top` names by summed duration, with one event's stats for each."""
    import jax

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            work()
        (trace,) = Path(folder).glob("**/*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(trace))
        lines: dict[str, dict] = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                totals: dict[str, list] = {}
                for event in line.events:
                    seen = totals.setdefault(event.name, [0.0, 0, event])
                    seen[0] += event.duration_ns / PROFILED_STEPS / 1e6
                    seen[1] += 1
                ranked = sorted(totals.items(), key=lambda item: -item[1][0])
                lines[f"{plane.name} {line.name}"] = {
                    "ms_per_step": round(sum(t[0] for t in totals.values()), 3),
                    "by_kind": by_kind((name, t[0]) for name, t in totals.items()),
                    "top": [
                        {
                            "name": name[:160],
                            "ms_per_step": round(ms, 3),
                            "calls": calls,
                            "stats": event_stats(event),
                        }
                        for name, (ms, calls, event) in ranked[:top]
                    ],
                }
        return lines


# What a kernel (or a CPU op) does, from its name: the first kind one of whose marks it holds.
# cuDNN's and PyTorch's attention kernels name themselves (sdpa, flash, fmha); cuBLAS's matmuls
# are nvjet or gemm kernels, CUTLASS's cutlass ones (convolutions too), inductor's Triton
# templates triton_tem; XLA names its fusions by their root (loop_: elementwise, input_: a
# reduction), inductor its Triton kernels (triton_poi: pointwise, triton_red and triton_per:
# reductions). XLA's own matmul fusions are plain fusion_N: "other fusion".
KINDS = (
    ("attention", ("fmha", "sdpa", "flash", "attention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "cublas", "triton_tem", "::mm", "addmm", "bmm")),
    ("elementwise", ("loop_", "triton_poi")),
    ("reduction", ("input_", "triton_red", "triton_per")),
    ("optimizer", ("multi_tensor_apply", "optimizer.step")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    """The kind of work a device kernel or CPU op named `name` does (KINDS)."""
    low = name.lower()
    for kind, marks in KINDS:
        if any(mark in low for mark in marks):
            return kind
    return "other fusion" if "fusion" in low else "other"


def by_kind(timed: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds a step by kind of work, the largest first, from (name, ms) pairs."""
    kinds: dict[str, float] = {}
    for name, ms in timed:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {k: round(ms, 3) for k, ms in sorted(kinds.items(), key=lambda item: -item[1])}


def event_stats(event) -> dict[str, str]:
    """An event's stats (the HLO op, its module, the kernel's details), as text."""
    try:
        return {str(k): str(v)[:300] for k, v in dict(event.stats).items()}
    except (TypeError, ValueError) as err:  # a ProfileData whose stats are not pairs
        return {"unread": f"{type(err).__name__}: {err}"[:300]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", required=True)
    p.add_argument("--model", default="vit_micro")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--amp_level", default="O0")
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--kernel-opt", dest="kernel_opt", action="store_true")
    p.add_argument("--attention", default="auto", help="jax: auto, cudnn or xla")
    p.add_argument("--profile", type=int, default=0, help="trace 5 more steps, print the "
                   "device's top N ops per line")  # fmt: skip
    p.add_argument("--remat", default="none", help="none, dots or full")
    p.add_argument("--profile_out", type=Path, help="also write the result as JSON here")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        cfg = RunConfig(
            model=ModelConfig(args.model, num_classes=args.num_classes),
            batch_size=args.batch_size,
            output=out,
        )
        step = dataclasses.replace(
            cfg.accel.step,
            amp=args.amp_level,
            kernel_opt=args.kernel_opt,
            attention=args.attention,
            remat=args.remat,
        )
        cfg = dataclasses.replace(
            cfg, accel=dataclasses.replace(cfg.accel, backend=args.backend, step=step)
        )
        result = fed_images_per_sec(cfg, args.steps, args.warmup, args.profile)
    record = {"backend": args.backend, "model": args.model, **result}
    if args.profile_out:
        args.profile_out.write_text(json.dumps(record, indent=1) + "\n")
    for name, line in record.pop("profile", {}).items():
        print(f"\n{name}: {line['ms_per_step']:.2f} ms a step")
        print("  by kind: " + ", ".join(f"{k} {ms:.2f} ms" for k, ms in line["by_kind"].items()))
        for op in line["top"]:
            print(
                f"  {op['ms_per_step']:8.3f} ms  x{op['calls'] // PROFILED_STEPS:<4} {op['name']}"
            )
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
