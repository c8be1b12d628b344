"""accel-report: turn a run tree (OUTPUT/<model>/<backend>/<run>/) into report.csv, report.md and
PNG plots: throughput per model and backend with the speed-up on the bars, loss curves overlaid.

It reads summary.json and metrics.jsonl only. Unfinished runs (no summary.json) and corrupt lines
are reported once and left out; the rest is still reported.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLUMNS = (
    "model",
    "backend",
    "run",
    "world_size",
    "amp_level",
    "global_batch_size",
    "steps",
    "images_per_sec",
    "speedup",
    "time_to_first_step_s",
    "compiles_after_warmup",
    "data_wait_fraction",
    "mfu",
    "peak_memory_bytes",
    "final_loss",
)


@dataclass
class Run:
    model: str
    backend: str
    name: str
    summary: dict[str, Any]
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) from metrics


def read_losses(path: Path, problems: list[str]) -> list[tuple[int, float]]:
    losses = []
    if not path.is_file():
        return losses
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"corrupt line {number} in {path}: left out")
            continue
        if row.get("kind") == "step" and row.get("loss") is not None:
            losses.append((int(row["step"]), float(row["loss"])))
    return losses


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    runs, problems = [], []
    for run_dir in sorted(p for p in root.glob("*/*/*") if p.is_dir()):
        model, backend, name = run_dir.parts[-3:]
        summary_path = run_dir / "summary.json"
        if not summary_path.is_file():
            problems.append(f"unfinished run (no summary.json): {run_dir}")
            continue
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError:
            problems.append(f"corrupt summary.json: {run_dir}")
            continue
        losses = read_losses(run_dir / "metrics.jsonl", problems)
        runs.append(Run(model, backend, name, summary, losses))
    return runs, problems


def rows(runs: list[Run], base_backend: str = "eager") -> list[dict[str, Any]]:
    """One row per run; speed-up against the model's `base_backend` run (else its first run)."""
    table = []
    for run in runs:
        same_model = [r for r in runs if r.model == run.model]
        base = next((r for r in same_model if r.backend == base_backend), same_model[0])
        base_ips = base.summary.get("images_per_sec") or 0.0
        row = {k: run.summary.get(k) for k in COLUMNS}
        row.update(model=run.model, backend=run.backend, run=run.name)
        row["speedup"] = (run.summary.get("images_per_sec") or 0.0) / base_ips if base_ips else None
        row["final_loss"] = run.summary["losses"][-1] if run.summary.get("losses") else None
        table.append(row)
    return table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def markdown_table(table: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in table]
    return "\n".join(lines)


def write_csv(table: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)


def plot_throughput(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in table})
    backends = sorted({r["backend"] for r in table})
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(models)), 4))
    for i, backend in enumerate(backends):
        for j, model in enumerate(models):
            row = next((r for r in table if r["model"] == model and r["backend"] == backend), None)
            if row is None or not row["images_per_sec"]:
                continue
            x = j + (i - (len(backends) - 1) / 2) * width
            ax.bar(
                x, row["images_per_sec"], width, color=f"C{i}", label=backend if j == 0 else None
            )
            ax.text(x, row["images_per_sec"], f"{row['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("images / s")
    ax.set_title("Throughput, speed-up over eager on the bars")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_losses(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r.model for r in runs})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for run in (r for r in runs if r.model == model and r.losses):
            steps, losses = zip(*run.losses, strict=True)
            ax.plot(steps, losses, label=f"{run.backend} ({run.name})")
        ax.set_title(model)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(root: Path, out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    runs, problems = find_runs(root)
    if not runs:
        raise ValueError(f"no finished runs under {root}")
    out.mkdir(parents=True, exist_ok=True)
    table = rows(runs)
    write_csv(table, out / "report.csv")
    plot_throughput(table, out / "throughput.png")
    plot_losses(runs, out / "losses.png")
    notes = "".join(f"- {p}\n" for p in problems)
    (out / "report.md").write_text(
        "# accel report\n\n" + markdown_table(table) + "\n\n"
        "data_wait_fraction near 1 means the input pipeline, not the device, sets the pace.\n\n"
        "![throughput](throughput.png)\n\n![losses](losses.png)\n"
        + (f"\n## Left out\n\n{notes}" if notes else "")
    )
    return table, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accel-report", description=__doc__)
    parser.add_argument("runs", help="the --output folder of launch_single_task")
    parser.add_argument("--out", required=True, help="folder for report.csv, report.md, PNGs")
    args = parser.parse_args(argv)
    try:
        table, problems = write_report(Path(args.runs), Path(args.out))
    except ValueError as err:
        print(f"accel-report: error: {err}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"accel-report: {problem}", file=sys.stderr)
    print(markdown_table(table, ("model", "backend", "images_per_sec", "speedup", "mfu")))
    print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
