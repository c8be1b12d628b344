"""Benchmark: what a second launch of the same jax job pays before its first step, against the
first launch, with one compilation cache (a fresh one for the first).

Each launch is a fresh process (launch_single_task), as a user would run it twice. Reported from
each summary.json: the time to the first step and where it went (`startup_s`: imports, FLOP
count, setup, loader, the first step itself), the step's compile phases (`compile_phases_s`:
tracing through torchax, lowering to StableHLO, XLA's compile) and the persistent-cache hits.

    python bench/second_launch.py --model swin_tiny_patch4_window7_224 --batch_size 8
    python bench/second_launch.py --record cpu-second-launch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import write_result  # noqa: E402

PHASES = ("trace_s", "lower_s", "compile_s")


def launch(args: argparse.Namespace, out: Path, cache: Path, run: str) -> dict:
    """One launch, in a process of its own; its summary.json."""
    cmd = [
        sys.executable, "-m", "accel.launch_single_task", "--backend", "jax",
        "--model", args.model, "--steps", str(args.steps), "--batch_size", str(args.batch_size),
        "--workers", "0", "--output", str(out), "--run_name", run, "--compile_cache", str(cache),
        "--no-eval", "--no-save",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads((out / args.model / "jax" / run / "summary.json").read_text())


def figures(summary: dict) -> dict:
    phases = summary.get("compile_phases_s", {})
    return {
        "time_to_first_step_s": round(summary["time_to_first_step_s"], 2),
        "startup_s": {k: round(v, 2) for k, v in summary.get("startup_s", {}).items()},
        "compile_phases_s": {k: round(phases.get(k, 0.0), 2) for k in PHASES},
        "trace_lower_compile_s": round(sum(phases.get(k, 0.0) for k in PHASES), 2),
        "persistent_cache_hits": summary.get("persistent_cache_hits", 0),
        "images_per_sec": round(summary.get("images_per_sec") or 0.0, 2),
    }


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out, cache = Path(tmp) / "runs", Path(tmp) / "cache"
        first, second = (figures(launch(args, out, cache, run)) for run in ("first", "second"))
    ratio = second["trace_lower_compile_s"] / max(first["trace_lower_compile_s"], 1e-9)
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "first": first,
        "second": second,
        "second_over_first_trace_lower_compile": round(ratio, 3),
    }


def show(record: dict) -> None:
    for name in ("first", "second"):
        run = record[name]
        print(
            f"{name:6s} launch: {run['time_to_first_step_s']:6.1f} s to first step; "
            f"trace {run['compile_phases_s']['trace_s']:.1f} s, lower "
            f"{run['compile_phases_s']['lower_s']:.1f} s, compile "
            f"{run['compile_phases_s']['compile_s']:.1f} s; startup {run['startup_s']}"
        )
    print(f"second / first (trace + lower + compile): "
          f"{record['second_over_first_trace_lower_compile']:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="swin_tiny_patch4_window7_224")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--record", metavar="TAG", help="write bench/results/TAG.json")
    args = p.parse_args(argv)
    record = measure(args)
    show(record)
    if args.record:
        write_result(args.record, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
