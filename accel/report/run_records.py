"""Finished runs read from a run tree (OUTPUT/<model>/<backend>/<run>/): summary.json and the
step records of metrics.jsonl, one row per run, and the medians over a backend's repeats with the
spread of the speed-up over them. What accel-report's tables and accel/figures.py's pictures are
made from."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel.config import BACKENDS
from accel.report.summary import RunSummary

LAYOUT = "<output>/<model>/<backend>/<run>/summary.json (launch_single_task's --output folder)"
# Every run's numbers, one CSV row each.
RUN_COLUMNS = (
    "model", "backend", "run", "device", "world_size", "amp_level", "global_batch_size", "steps",
    "images_per_sec", "speedup", "step_time_ms", "time_to_first_step_s", "compile_s",
    "compiles_after_warmup", "data_wait_fraction", "eval_acc", "eval_loss", "final_loss",
    "peak_device_mib", "peak_host_mib", "mfu", "runs", "speedup_spread",
)  # fmt: skip
# What a speed-up from one run says of its spread (one run on either side of the ratio).
UNKNOWN = "spread unknown"
# Medians over a backend's repeats of one job.
MEDIANS = (
    "images_per_sec", "step_time_ms", "time_to_first_step_s", "compile_s", "eval_acc",
    "eval_loss", "final_loss", "peak_device_mib", "peak_host_mib", "data_wait_fraction", "mfu",
)  # fmt: skip


@dataclass
class Run:
    model: str
    backend: str
    name: str
    summary: RunSummary
    steps: list[dict] = field(default_factory=list)  # metrics.jsonl's step records, in order
    num_classes: int | None = None  # from config.json, where it is there: chance is 1 / this

    @property
    def config(self) -> tuple:
        """What makes two runs the same job (the backend aside)."""
        s = self.summary
        return (self.model, s.amp_level, s.global_batch_size, s.world_size)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one step-record field, where recorded."""
        points = [(r["step"], r[key]) for r in self.steps if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]


def read_steps(path: Path, problems: list[str]) -> list[dict]:
    steps: list[dict] = []
    if not path.is_file():
        return steps
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"corrupt line {number} in {path}: left out")
            continue
        if row.get("kind") == "step" and row.get("loss") is not None:
            steps.append(row)
    return steps


def read_run(run_dir: Path, problems: list[str]) -> Run | None:
    try:
        record = json.loads((run_dir / "summary.json").read_text())
    except json.JSONDecodeError:
        problems.append(f"corrupt summary.json: {run_dir}")
        return None
    if record.get("eval_only"):
        return None  # an evaluation, not a training run to compare
    summary = RunSummary.from_dict(record)
    model, backend = run_dir.parts[-3:-1]
    model, backend = summary.model or model, summary.backend or backend
    steps = read_steps(run_dir / "metrics.jsonl", problems)
    return Run(model, backend, run_dir.name, summary, steps, _num_classes(run_dir))


def _num_classes(run_dir: Path) -> int | None:
    try:
        config = json.loads((run_dir / "config.json").read_text())
        return int(config["model"]["num_classes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every finished run under `root`, however deep (a folder above --output works too)."""
    runs, problems = [], []
    for run_dir in sorted(
        {p.parent for p in root.rglob("metrics.jsonl")}
        | {p.parent for p in root.rglob("summary.json")}
    ):
        if not (run_dir / "summary.json").is_file():
            problems.append(f"unfinished run (no summary.json): {run_dir}")
            continue
        run = read_run(run_dir, problems)
        if run is not None:
            runs.append(run)
    return runs, problems


def _mib(value: Any) -> float | None:
    if isinstance(value, list):  # one value a rank
        value = max(value) if value else None
    return None if value is None else value / 2**20


def run_row(run: Run) -> dict[str, Any]:
    """One run's numbers, by RUN_COLUMNS."""
    s = run.summary
    ips = s.images_per_sec or None
    flat = s.to_dict()  # the columns by summary.json's names
    row = {k: flat.get(k) for k in RUN_COLUMNS}
    row.update(model=run.model, backend=run.backend, run=run.name)
    row["step_time_ms"] = 1000 * s.global_batch_size / ips if ips else None
    row["compile_s"] = s.backend_stats.compile_time_s  # on every backend that measures it
    row["final_loss"] = s.final_loss
    row["peak_device_mib"] = _mib(s.backend_stats.peak_memory_bytes)
    row["peak_host_mib"] = _mib(s.peak_host_bytes)
    return row


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def backend_order(backend: str) -> tuple[int, str]:
    return (BACKENDS.index(backend) if backend in BACKENDS else len(BACKENDS), backend)


def aggregate(runs: list[Run], base_backend: str = "eager") -> list[dict[str, Any]]:
    """One row per configuration and backend: medians over its runs, the run count, and the
    speed-up over `base_backend`'s median of the same configuration (else its first backend),
    with its spread over the runs (speedup_low, speedup_high, speedup_spread)."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.config, run.backend), []).append(run)
    table = []
    for (config, backend), members in groups.items():
        per_run = [run_row(r) for r in members]
        row = {**per_run[0], "runs": len(members), "backend": backend}
        row.update({k: _median([r[k] for r in per_run]) for k in MEDIANS})
        row["steps"] = max(r["steps"] or 0 for r in per_run)
        row["compiles_after_warmup"] = max(r["compiles_after_warmup"] or 0 for r in per_run)
        row["config"] = config
        row["each_images_per_sec"] = [r["images_per_sec"] for r in per_run]
        table.append(row)
    table.sort(key=lambda r: (r["config"], backend_order(r["backend"])))
    for row in table:
        same = [r for r in table if r["config"] == row["config"]]
        base = next((r for r in same if r["backend"] == base_backend), same[0])
        ips, base_ips = row["images_per_sec"], base["images_per_sec"]
        row["speedup"] = ips / base_ips if ips and base_ips else None
        row["base_backend"], row["base_images_per_sec"] = base["backend"], base_ips
        spread = speedup_spread(row["each_images_per_sec"], base_ips, base["runs"], base["backend"])
        row.update(spread)
    return table


def speedup_spread(
    each: list[float | None], base_ips: float | None, base_runs: int, base_backend: str
) -> dict[str, Any]:
    """The spread of a speed-up over its runs: each run's images/s against the base backend's
    median (speedup_low, speedup_high), and in words with the run count (speedup_spread).

    One run on either side has no spread to measure, and one run on a loaded machine can be off
    by several times: its low and high are left unknown and the words say so."""
    measured = [v for v in each if v]
    if not measured or not base_ips:
        return {"speedup_low": None, "speedup_high": None, "speedup_spread": None}
    if len(measured) == 1 or base_runs == 1:
        one = "1 run" if len(measured) == 1 else f"1 {base_backend} run"
        return {"speedup_low": None, "speedup_high": None, "speedup_spread": f"{one}: {UNKNOWN}"}
    low, high = min(measured) / base_ips, max(measured) / base_ips
    return {
        "speedup_low": low,
        "speedup_high": high,
        "speedup_spread": f"{low:.2f}-{high:.2f} over {len(measured)} runs",
    }


def single_run_speedups(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose speed-up over another backend rests on one run (of theirs, of the base
    backend's or both). A base backend's own row is left out: its 1 is so by definition."""
    return [
        r
        for r in table
        if (r.get("speedup_spread") or "").endswith(UNKNOWN) and r["backend"] != r["base_backend"]
    ]


def fmt(value: Any) -> str:
    """Three significant figures for every measured number."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def repeats(runs: list[Run]) -> str:
    """How many runs each (job, backend) has: '2', or '1-3' where they differ."""
    counts: dict[tuple[tuple, str], int] = {}
    for r in runs:
        counts[(r.config, r.backend)] = counts.get((r.config, r.backend), 0) + 1
    low, high = min(counts.values()), max(counts.values())
    return f"{low}" if low == high else f"{low}-{high}"
