"""--compare: the same job on several backends, back to back, and a table of the results.

Each backend runs in its own process (as launch_single_task would run it alone): that keeps one
backend's runtime state out of the next one's numbers, and torch_xla must start before any
autograd backward of a process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from accel.config import BACKENDS, ConfigError
from accel.report.run_records import Run, aggregate, read_steps
from accel.report.summary import RunSummary
from accel.report.tables import markdown_table

COLUMNS = (
    "backend",
    "images_per_sec",
    "speedup",
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
        raise ConfigError(f"--compare takes two or more of {', '.join(BACKENDS)}, got '{text}'")
    return backends


def without_compare(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--compare":
            skip = True
        elif not arg.startswith("--compare="):
            out.append(arg)
    return out


def run_comparison(argv: list[str], backends: list[str], model: str, output: str) -> int:
    name = datetime.now().strftime("compare-%Y%m%d-%H%M%S")
    runs = []
    for backend in backends:
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
        code = subprocess.run(cmd).returncode
        if code != 0:
            print(
                f"launch_single_task: error: the {backend} run of the comparison failed "
                f"(exit {code})",
                file=sys.stderr,
            )
            return code
        run_dir = Path(output) / model / backend / name
        summary = RunSummary.from_dict(json.loads((run_dir / "summary.json").read_text()))
        runs.append(Run(model, backend, name, summary, read_steps(run_dir / "metrics.jsonl", [])))
    print(f"\ncomparison of {model} ({', '.join(backends)}), speed-up over {backends[0]}:\n")
    print(markdown_table(aggregate(runs, base_backend=backends[0]), COLUMNS))
    return 0
