"""--compare: the same job on several backends, back to back, and a table of the results.

Each backend runs in its own process (as launch_single_task would run it alone): that keeps one
backend's runtime state out of the next one's numbers, and torch_xla must start before any
autograd backward of a process. `--repeats N` runs each backend N times, interleaved (eager, xla,
eager, xla, ...), each run in a folder of its own, and the table gives the medians with the run
count and the spread of the speed-up: one run says nothing of its noise, and a speed-up measured
once on a busy machine can be off by several times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from accel.config import BACKENDS, AccelError
from accel.report.run_records import Run, aggregate, read_steps
from accel.report.summary import RunSummary
from accel.report.tables import markdown_table, spread_note

COLUMNS = (
    "backend",
    "runs",
    "images_per_sec",
    "speedup",
    "speedup_spread",
    "step_time_ms",
    "time_to_first_step_s",
    "compile_s",
    "compiles_after_warmup",
    "peak_device_mib",
    "data_wait_fraction",
    "mfu",
)


def parse_backends(text: str) -> list[str]:
    backends = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or len(backends) < 2:
        raise AccelError(f"--compare takes two or more of {', '.join(BACKENDS)}, got '{text}'")
    return backends


def parse_repeats(repeats: int | None, compare: str) -> int:
    """--repeats as given: how many runs of each backend --compare makes (1 when not given)."""
    if repeats is None:
        return 1
    if not compare:
        raise AccelError(
            f"--repeats {repeats} repeats the runs of --compare: give --compare too "
            "(e.g. --compare eager,xla --repeats 3)"
        )
    if repeats < 1:
        raise AccelError(f"--repeats takes 1 or more runs of each backend, got {repeats}")
    return repeats


# The options of the comparison itself, which the runs it starts do not take.
OWN_OPTIONS = ("--compare", "--repeats")


def without_compare(argv: list[str]) -> list[str]:
    """The command line less the comparison's own options (`--compare X`, `--repeats=N`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OWN_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in OWN_OPTIONS)):
            out.append(arg)
    return out


def run_names(stamp: str, repeats: int) -> list[str]:
    """One run folder a repeat: `compare-<stamp>`, or `compare-<stamp>-r1` ... `-rN`."""
    return [stamp] if repeats == 1 else [f"{stamp}-r{i}" for i in range(1, repeats + 1)]


def run_one(argv: list[str], backend: str, name: str) -> int:
    """One run of the comparison, in a process of its own: its exit code."""
    cmd = [
        sys.executable,
        "-m",
        "accel.launch_single_task",
        *without_compare(argv),
        "--backend",
        backend,
        "--run_name",
        name,
    ]
    return subprocess.run(cmd).returncode


def read_run(output: str, model: str, backend: str, name: str) -> Run:
    run_dir = Path(output) / model / backend / name
    summary = RunSummary.from_dict(json.loads((run_dir / "summary.json").read_text()))
    return Run(model, backend, name, summary, read_steps(run_dir / "metrics.jsonl", []))


def run_comparison(
    argv: list[str], backends: list[str], model: str, output: str, repeats: int = 1
) -> int:
    """Each backend `repeats` times, the backends interleaved within each repeat so that a
    change in the machine's load over the comparison falls on all of them alike; then one table
    of medians, with the runs and the spread of the speed-up over the first backend."""
    stamp = datetime.now().strftime("compare-%Y%m%d-%H%M%S")
    runs = []
    for name in run_names(stamp, repeats):
        for backend in backends:
            code = run_one(argv, backend, name)
            if code != 0:
                print(
                    f"launch_single_task: error: the {backend} run of the comparison "
                    f"({name}) failed (exit {code})",
                    file=sys.stderr,
                )
                return code
            runs.append(read_run(output, model, backend, name))
    table = aggregate(runs, base_backend=backends[0])
    each = "1 run" if repeats == 1 else f"medians of {repeats} runs"
    print(
        f"\ncomparison of {model} ({', '.join(backends)}), {each} each, speed-up over "
        f"{backends[0]}:\n"
    )
    print(markdown_table(table, COLUMNS))
    note = spread_note(table)
    if note:
        print(f"\n{note}")
    return 0
