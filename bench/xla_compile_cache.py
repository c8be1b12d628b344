"""Benchmark: time to first step of the same xla job launched twice with one compilation cache.

The second launch should take its executables from the persistent cache instead of compiling.
Each launch is a fresh process (launch_single_task), as a user would run it.

    python bench/xla_compile_cache.py --model vit_micro
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import write_result  # noqa: E402


def launch(args: argparse.Namespace, out: Path, cache: Path, run: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "accel.launch_single_task",
        "--backend",
        "xla",
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--batch_size",
        str(args.batch_size),
        "--output",
        str(out),
        "--run_name",
        run,
        "--compile_cache",
        str(cache),
        "--no-eval",
        "--no-save",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((out / args.model / "xla" / run / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="vit_micro")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=32)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out, cache = Path(tmp) / "runs", Path(tmp) / "cache"
        first, second = (launch(args, out, cache, run) for run in ("first", "second"))
    ratio = first["time_to_first_step_s"] / second["time_to_first_step_s"]
    print(
        f"first launch:  {first['time_to_first_step_s']:.1f} s to first step, "
        f"{first['graphs_compiled']} graphs compiled"
    )
    print(
        f"second launch: {second['time_to_first_step_s']:.1f} s to first step, "
        f"persistent cache used: {second['persistent_cache']}, "
        f"hits: {second['persistent_cache_hits']}"
    )
    print(f"ratio: {ratio:.2f}x")
    write_result(
        f"xla-compile-cache-{args.model}",
        {
            "settings": vars(args),
            "note": "one pair of launches",
            "first": first["time_to_first_step_s"],
            "second": second["time_to_first_step_s"],
            "ratio": ratio,
            "persistent_cache": second["persistent_cache"],
            "persistent_cache_hits": second["persistent_cache_hits"],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
