"""Benchmark: what a user's DataLoader costs to start, pass after pass, on each backend.

examples/classic_loop.py (plain PyTorch) and examples/classic_loop_accel.py on eager and on jax,
at the same command (`--steps 120 --batch_size 32` with its 2 workers: 20 epochs, each a pass
over the training loader and one over the validation loader, 40 passes that each start their
workers afresh). Taken in turn, `--repeats` times over: the wall time of each command as a user
types it, and, from a second run of the same command with DataLoader's iterator timed (this
script's `--timed`), the seconds from each pass's first request to its first batch, which is
mostly the workers' start. Written to bench/results/<tag>.json with the device, the versions and
the load average before each run (the machine may be shared).

    python bench/loader_start.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {  # name: (script, environment)
    "plain": ("examples/classic_loop.py", {}),
    "eager": ("examples/classic_loop_accel.py", {"ACCEL_BACKEND": "eager"}),
    "jax": ("examples/classic_loop_accel.py", {"ACCEL_BACKEND": "jax"}),
}


def timed(out: str, script: str, args: list[str]) -> None:
    """Run `script` with `args` as `python script args` would (runpy, as __main__), every
    DataLoader's passes timed to their first batch; the seconds are written to `out`."""
    from torch.utils.data import DataLoader

    seconds: list[float] = []
    original = DataLoader.__iter__

    def first_batch_timed(self):  # a pass's first next() to its first batch
        start = time.perf_counter()
        for i, batch in enumerate(original(self)):
            if i == 0:
                seconds.append(time.perf_counter() - start)
            yield batch

    DataLoader.__iter__ = first_batch_timed  # type: ignore[method-assign,assignment]
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        Path(out).write_text(json.dumps(seconds))


def run(name: str, args: list[str], out: Path, first_batches: Path | None = None) -> dict:
    script, env = COMMANDS[name]
    argv = [sys.executable, script, *args, "--out", str(out)]
    if first_batches is not None:
        argv = [sys.executable, __file__, "--timed", str(first_batches), script, *args]
        argv += ["--out", str(out)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return {"wall_s": round(wall, 2), "load_before": round(load, 2)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per command: the median wall time over the repeats, its ratio to the plain script's, and
    the median time to a pass's first batch over all passes of all repeats."""
    summary: dict[str, dict] = {
        name: {
            "runs": len(records),
            "median_wall_s": round(statistics.median(r["wall_s"] for r in records), 2),
            "median_first_batch_s": round(
                statistics.median(s for r in records for s in r["first_batch_s"]), 3
            ),
        }
        for name, records in runs.items()
        if records
    }
    if "plain" in summary:
        for name in summary:
            summary[name]["wall_vs_plain"] = round(
                summary[name]["median_wall_s"] / summary["plain"]["median_wall_s"], 2
            )
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", default=",".join(COMMANDS), help="commands to run: plain,eager,jax")
    p.add_argument("--tag", default="cpu-loader-start", help="results file name")
    p.add_argument("--note", default="", help="how the machine was loaded, recorded as is")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.compare_backends import write_result

    names = args.only.split(",")
    flags = ["--steps", str(args.steps), "--batch_size", str(args.batch_size)]
    flags += ["--workers", str(args.workers)]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in names:  # interleaved: a change of load touches every command alike
                command = run(name, flags, Path(tmp) / f"{name}-{repeat}")
                seconds = Path(tmp) / f"{name}-{repeat}.json"
                command["timed_run"] = run(name, flags, Path(tmp) / f"{name}-t{repeat}", seconds)
                passes = json.loads(seconds.read_text())
                command["first_batch_s"] = [round(s, 3) for s in passes]
                runs[name].append(command)
                print(
                    f"{name} #{repeat}: {command['wall_s']:.1f} s (load {command['load_before']}), "
                    f"{len(passes)} passes: first batch after {statistics.median(passes):.2f} s "
                    f"(median), {max(passes[1:] or passes):.2f} s (slowest after the first)",
                    flush=True,
                )
                record = {  # written after each run: a long series interrupted keeps what it had
                    "settings": vars(args),
                    "cpus": os.cpu_count(),
                    "summary": summarize(runs),
                    "runs": runs,
                }
                write_result(args.tag, record)
    print(json.dumps(summarize(runs), indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--timed"]:
        timed(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        raise SystemExit(main())
