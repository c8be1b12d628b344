"""accel-report: a run tree (OUTPUT/<model>/<backend>/<run>/) as a table and four pictures.

    accel-report runs --out report       # report.md, report.csv, and one PNG per question

Each picture answers one question: which backend is faster (throughput.png), where the time goes
(timeline.png), whether the backends agree (agreement.png), and what they cost in memory
(memory.png); accel/figures.py draws them. The table has one row per backend and configuration
(model, AMP level, global batch, world size) with the median over repeated runs and their count,
and the speed-up with its spread over those runs (`speedup_spread`, "0.98-1.30 over 3 runs"; one
run has none, and the report says so in words); report.csv keeps every run. `--readme FILE` also
writes the table and the throughput picture into FILE, a Markdown page (`make plot` fills
docs/benchmarks.md), between `<!-- accel-report:begin -->` and `<!-- accel-report:end -->`, with
where the numbers came from.

It reads summary.json and metrics.jsonl only. Unfinished runs (no summary.json) and corrupt lines
are reported once and left out; the rest is still reported.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from accel.report.run_records import (
    LAYOUT,
    RUN_COLUMNS,
    Run,
    aggregate,
    find_runs,
    fmt,
    repeats,
    run_row,
    single_run_speedups,
)

README_BEGIN, README_END = "<!-- accel-report:begin -->", "<!-- accel-report:end -->"
# The table: medians over a backend's runs of one configuration.
TABLE_COLUMNS = (
    "model", "backend", "runs", "amp_level", "global_batch_size", "world_size", "steps",
    "images_per_sec", "speedup", "speedup_spread", "step_time_ms", "time_to_first_step_s",
    "compile_s", "eval_acc", "eval_loss", "final_loss", "peak_device_mib", "peak_host_mib",
    "compiles_after_warmup",
)  # fmt: skip
# What accel-report prints: which backend is faster, by how much, and how sure that is.
PRINTED_COLUMNS = ("model", "backend", "runs", "images_per_sec", "speedup", "speedup_spread")


def markdown_table(table: list[dict[str, Any]], columns: tuple[str, ...] = TABLE_COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in table]
    return "\n".join(lines)


def write_csv(runs: list[Run], table: list[dict[str, Any]], path: Path) -> None:
    """Every run's row, its speed-up taken against the base backend's median (from `table`) of
    its job, with the run count and spread of its job and backend's row beside it."""
    rows = {(row["config"], row["backend"]): row for row in table}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_COLUMNS)
        writer.writeheader()
        for run in runs:
            row, group = run_row(run), rows[(run.config, run.backend)]
            base = group["base_images_per_sec"]
            row["speedup"] = (
                row["images_per_sec"] / base if base and row["images_per_sec"] else None
            )
            row.update(runs=group["runs"], speedup_spread=group["speedup_spread"])
            writer.writerow(row)


def spread_note(table: list[dict[str, Any]]) -> str:
    """A sentence under a table whose speed-ups rest on a single run, saying so: without it a
    single run's figure reads like a measurement, though a busy machine can move it several
    times over. Empty where every speed-up rests on two or more runs a side."""
    single = single_run_speedups(table)
    if not single:
        return ""
    which = " and ".join(f"{r['backend']} over {r['base_backend']} ({r['model']})" for r in single)
    return (
        f"From a single run: the speed-up of {which} rests on one run (of one backend or "
        "both), so its spread is unknown: one run on a busy machine can be off by several "
        "times. Run each backend three times or more (`launch_single_task --compare ... "
        "--repeats 3`) before quoting it."
    )


def paragraph(text: str) -> str:
    """`text` as a Markdown paragraph of its own; nothing where it is empty."""
    return f"{text}\n\n" if text else ""


def provenance(runs: list[Run]) -> str:
    """Where the numbers came from: device, versions, date."""
    devices = sorted({r.summary.device or "unknown device" for r in runs})
    versions = runs[0].summary.versions or {}
    stack = ", ".join(f"{k} {v}" for k, v in versions.items())
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    runs_each = f"{repeats(runs)} run(s) of each job and backend"
    return f"{'; '.join(devices)}; {stack}; {runs_each}; reported {date}"


def update_readme(readme: Path, table: list[dict], runs: list[Run], picture: Path) -> None:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_BEGIN} ... {README_END} block to fill")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    relative = Path(os.path.relpath(picture.resolve(), readme.resolve().parent)).as_posix()
    columns = (
        "model",
        "backend",
        "runs",
        "images_per_sec",
        "speedup",
        "speedup_spread",
        "step_time_ms",
        "time_to_first_step_s",
        "compile_s",
        "eval_acc",
        "final_loss",
    )
    block = (
        f"\n_Made by `make plot` ({provenance(runs)})._\n\n"
        f"{markdown_table(table, columns)}\n\n{paragraph(spread_note(table))}"
        f"![which backend is faster]({relative})\n"
    )
    readme.write_text(head + README_BEGIN + block + README_END + tail)


def write_report(root: Path, out: Path) -> tuple[list[dict[str, Any]], list[str], list[Run]]:
    from accel.report.figures import save_figures

    runs, problems = find_runs(root)
    if not runs:
        raise ValueError(f"no finished runs under {root}: accel-report expects {LAYOUT}")
    out.mkdir(parents=True, exist_ok=True)
    table = aggregate(runs)
    write_csv(runs, table, out / "report.csv")
    pictures = save_figures(runs, table, out)
    notes = "".join(f"- {p}\n" for p in problems)
    images = "\n\n".join(f"![{p.stem}]({p.name})" for p in pictures)
    (out / "report.md").write_text(
        f"# accel report\n\n{provenance(runs)}\n\n{markdown_table(table)}\n\n"
        "Medians over each backend's runs (`runs`); report.csv lists every run. "
        "`speedup` is against eager's median of the same configuration (its first backend "
        "where eager did not run), and `speedup_spread` is its slowest to fastest run against "
        "that median.\n\n"
        f"{paragraph(spread_note(table))}"
        f"{images}\n" + (f"\n## Left out\n\n{notes}" if notes else "")
    )
    return table, problems, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="accel-report", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("runs", help="the --output folder of launch_single_task (or above it)")
    parser.add_argument("--out", required=True, help="folder for report.md, report.csv, PNGs")
    parser.add_argument("--readme", type=Path, help="a Markdown file whose report block to fill")
    args = parser.parse_args(argv)
    try:
        table, problems, runs = write_report(Path(args.runs), Path(args.out))
        if args.readme:
            update_readme(args.readme, table, runs, Path(args.out) / "throughput.png")
    except (ValueError, OSError) as err:
        print(f"accel-report: error: {err}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"accel-report: {problem}", file=sys.stderr)
    print(markdown_table(table, PRINTED_COLUMNS))
    print(paragraph(spread_note(table)), end="")
    print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
