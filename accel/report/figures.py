"""The report's pictures, one question each, drawn with matplotlib:

- throughput.png, which backend is faster: median img/s with the spread over runs, speed-ups
  with theirs (or the words saying one run has none);
- timeline.png, where the time goes: the time a step at the resolution it was measured (a step
  timed alone, or a group's mean drawn across the group), and the time to the first step in its
  phases beside the steady step time, medians over the runs;
- agreement.png, whether they agree: the loss per backend, each backend's distance from eager's
  (log scale), and validation top-1 where recorded, with the chance level;
- memory.png, what it costs: the training state a rank holds by part, and peak device memory
  (where the backend reports it) or host memory with what the process held before training apart.

Every figure keeps one colour per backend, a subtitle saying device, model, batch, AMP level,
steps and runs, short legends and integer step ticks; one column of panels per configuration.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, cast

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none opened
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from accel.report.run_records import Run, backend_order, fmt, repeats

COLOURS = {"eager": "#1f77b4", "compile": "#2ca02c", "xla": "#d62728", "jax": "#9467bd"}
STYLES = {"eager": "-", "compile": "--", "xla": "-.", "jax": ":"}  # coinciding lines stay visible
PHASES = ("imports", "backend", "setup", "flops", "loader", "logger", "first_step")


def colour(backend: str) -> str:
    return COLOURS.get(backend, "#7f7f7f")


def subtitle(runs: list[Run]) -> str:
    s = runs[0].summary
    device = s.device or "unknown device"
    models = ", ".join(sorted({r.model for r in runs}))
    return (
        f"{device} | {models} | batch {s.global_batch_size} | {s.amp_level} | "
        f"{s.steps} steps | {repeats(runs)} run(s) of each job and backend"
    )


def _configs(runs: list[Run]) -> list[tuple]:
    return sorted({r.config for r in runs}, key=str)


def _panels(rows: int, columns: int, title: str, runs: list[Run]) -> tuple[Figure, Any]:
    fig, axes = plt.subplots(rows, columns, figsize=(7.5 * columns, 3.6 * rows), squeeze=False)
    fig.suptitle(f"{title}\n{subtitle(runs)}", fontsize=10)
    return fig, axes


def _config_label(config: tuple) -> str:
    model, amp, batch, world = config
    return f"{model}, {amp}, batch {batch}, {world} replica(s)"


def _backends(runs: list[Run]) -> list[str]:
    return sorted({r.backend for r in runs}, key=backend_order)


def throughput(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    fig, axes = _panels(1, len(configs), "Which backend is faster?", runs)
    for ax, config in zip(axes[0], configs, strict=True):
        rows = [r for r in table if r["config"] == config]
        top = 0.0
        for x, row in enumerate(rows):
            mine = [
                r.summary.images_per_sec or 0.0
                for r in runs
                if r.config == config and r.backend == row["backend"]
            ]
            low, high = min(mine), max(mine)
            median = row["images_per_sec"]
            ax.bar(
                x,
                median,
                0.6,
                color=colour(row["backend"]),
                label=row["backend"],
                yerr=[[median - low], [high - median]],
                capsize=4,
            )
            ax.scatter([x] * len(mine), mine, color="black", s=8, zorder=3)
            ax.annotate(
                speedup_label(row),
                (x, high),
                xytext=(0, 5),  # clear of the whisker's cap
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
            top = max(top, high)
        ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
        ax.set(xlabel="backend", ylabel="images / s", title=_config_label(config))
        ax.set_ylim(0, 1.35 * top or 1)  # room above the fastest run for its two-line label
    fig.text(
        0.5,
        0.01,
        "bars: median over runs; whiskers: slowest to fastest; dots: each run\n"
        "labels: speed-up over eager's median, then its runs' slowest to fastest against it",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def speedup_label(row: dict) -> str:
    """A bar's speed-up and what it rests on, on a second line: '1.12x' over '0.98-1.30 over 3
    runs', or over '1 run: spread unknown'."""
    if not row["speedup"]:
        return ""
    return f"{row['speedup']:.2f}x\n{row['speedup_spread']}"


def _first_run(runs: list[Run], config: tuple, backend: str) -> Run | None:
    return next((r for r in runs if r.config == config and r.backend == backend), None)


def _mine(runs: list[Run], config: tuple, backend: str) -> list[Run]:
    return [r for r in runs if r.config == config and r.backend == backend]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def step_groups(run: Run) -> list[tuple[int, int, float]]:
    """(first step, last step, seconds a step) as measured: the loop times the steps between two
    loss fetches together (--log_every), and writes that group's mean on each of its steps.
    Consecutive steps with the same recorded time are one group."""
    groups: list[list] = []
    for step, seconds in zip(*run.series("step_time_s"), strict=True):
        if groups and groups[-1][2] == seconds and groups[-1][1] == step - 1:
            groups[-1][1] = step
        else:
            groups.append([step, step, seconds])
    return [tuple(g) for g in groups]


def timeline(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    fig, axes = _panels(2, len(configs), "Where does the time go?", runs)
    for column, config in enumerate(configs):
        backends = [b for b in _backends(runs) if _first_run(runs, config, b)]
        _step_time_lines(axes[0][column], runs, config, backends)
        rows = {r["backend"]: r for r in table if r["config"] == config}
        _startup_bars(axes[1][column], runs, rows, config, backends)
    fig.text(
        0.5,
        0.01,
        "top: a dot is one step timed alone; a bar spans steps timed together\n"
        "between two loss fetches (--log_every), at their mean; all values medians over the runs",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def _step_time_lines(ax, runs: list[Run], config: tuple, backends: list[str]) -> None:
    """Milliseconds a step, at the resolution measured: a dot for a step timed alone, a bar
    across the steps of a group timed together (their mean); the median over the runs."""
    for order, backend in enumerate(backends):
        mine = _mine(runs, config, backend)
        per_run = [{(a, b): t for a, b, t in step_groups(r)} for r in mine]
        shared = [g for g in per_run[0] if all(g in other for other in per_run)]
        # Earlier backends wider and beneath: equal times stay visible.
        width = max(6 - 1.5 * order, 1.5)
        style = dict(color=colour(backend), lw=width, solid_capstyle="butt", zorder=2 + order)
        labelled = False
        for first, last in shared:
            ms = 1000 * _median([groups[(first, last)] for groups in per_run])
            label = None if labelled else backend
            labelled = True
            if first == last:
                ax.plot([first], [ms], "o", ms=max(width, 4), label=label, **style)
            else:  # the group's mean, drawn across the steps it covers
                ax.plot([first - 0.45, last + 0.45], [ms, ms], "-", label=label, **style)
    ax.set_yscale("log")
    ax.set(
        xlabel="optimizer step",
        ylabel="ms a step (log; median over runs)",
        title=f"{_config_label(config)}: time a step, as measured",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)


def _startup_bars(
    ax, runs: list[Run], rows: dict[str, dict], config: tuple, backends: list[str]
) -> None:
    """Time to the first step, phase by phase, median over the runs (hatched: the first step
    itself, with its compile), and the table's median steady step time written beside it."""
    for y, backend in enumerate(backends):
        mine = _mine(runs, config, backend)
        left = 0.0
        for phase in PHASES:
            width = _median([(r.summary.startup_s or {}).get(phase, 0.0) for r in mine])
            ax.barh(
                y,
                width,
                left=left,
                color=colour(backend),
                alpha=1.0 if phase == "first_step" else 0.45,
                hatch="//" if phase == "first_step" else None,
                edgecolor="white",
            )
            left += width
        step_ms = (rows.get(backend) or {}).get("step_time_ms")
        text = f"  then {step_ms:.0f} ms a step" if step_ms else ""
        ax.text(left, y, text, va="center", fontsize=8)
    ax.set_yticks(range(len(backends)), backends)
    ax.set(
        xlabel="seconds (light: imports, set-up, loader; hatched: first step with its compile)",
        ylabel="backend",
        title="time to the first step, then the steady step time (medians over runs)",
    )
    ax.margins(x=0.3)


def chance(runs: list[Run]) -> float | None:
    classes = {r.num_classes for r in runs if r.num_classes}
    return 1 / classes.pop() if len(classes) == 1 else None


def agreement(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    evals = any(r.summary.eval_acc is not None for r in runs)
    fig, axes = _panels(3 if evals else 2, len(configs), "Do the backends agree?", runs)
    for column, config in enumerate(configs):
        losses, diffs = axes[0][column], axes[1][column]
        reference = _first_run(runs, config, "eager")
        base = dict(zip(*reference.series("loss"), strict=True)) if reference else {}
        for backend in _backends(runs):
            run = _first_run(runs, config, backend)
            if run is None:
                continue
            steps, values = run.series("loss")
            eager = backend == "eager"
            losses.plot(
                steps,
                values,
                STYLES.get(backend, "-"),
                color=colour(backend),
                lw=4 if eager else 1.4,
                alpha=0.5 if eager else 1.0,
                zorder=1 if eager else 2,
                label=backend,
            )
            if backend != "eager" and base:
                pairs = [
                    (s, abs(v - base[s])) for s, v in zip(steps, values, strict=True) if s in base
                ]
                diffs.plot(
                    [p[0] for p in pairs],
                    [max(p[1], 1e-9) for p in pairs],
                    STYLES.get(backend, "-"),
                    color=colour(backend),
                    marker="o",
                    ms=3,
                    label=backend,
                )
        losses.set(
            xlabel="optimizer step",
            ylabel="training loss",
            title=f"{_config_label(config)}: loss, each backend's first run (eager wide)",
        )
        losses.title.set_fontsize(9)
        diffs.set_yscale("log")
        diffs.set(
            xlabel="optimizer step",
            ylabel="|loss - eager loss| (log; 1e-9 = equal)",
            title="difference from eager",
        )
        for ax in (losses, diffs):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=8)
        if evals:
            rows = [r for r in table if r["config"] == config]
            _eval_bars(axes[2][column], runs, rows, config)
    fig.tight_layout()
    return fig


def _eval_bars(ax, runs: list[Run], rows: list[dict], config: tuple) -> None:
    """Validation top-1: the median over runs (the table's), each run a dot, chance dotted."""
    for x, row in enumerate(rows):
        value = row.get("eval_acc")
        if value is None:
            continue
        ax.bar(x, value, 0.6, color=colour(row["backend"]), label=row["backend"])
        each = [r.summary.eval_acc for r in _mine(runs, config, row["backend"])]
        ax.scatter([x] * len(each), each, color="black", s=8, zorder=3)
        ax.text(x, value, f"{value:.3f}", ha="center", va="bottom", fontsize=8)
    level = chance([r for r in runs if r.config == config])
    if level:
        ax.axhline(level, color="black", ls=":", lw=1)
        ax.text(-0.45, level, f"chance {level:.2f}", va="bottom", ha="left", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
    ax.set(
        xlabel="backend",
        ylabel="validation top-1",
        ylim=(0, 1.05),
        title="validation top-1 after training (median over runs; dots: each run)",
    )


def memory(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    fig, axes = _panels(len(configs), 2, "What does it cost in memory?", runs)
    for row, config in enumerate(configs):
        rows = [r for r in table if r["config"] == config]
        _state_bars(axes[row][0], runs, rows, config)
        _peak_bars(axes[row][1], runs, rows, config)
    fig.tight_layout()
    return fig


STATE_PARTS = ("params", "masters", "grads", "optimizer", "ema")  # bottom to top
PART_ALPHA = dict(zip(STATE_PARTS, (1.0, 0.8, 0.6, 0.4, 0.25), strict=True))


def _state_bars(ax, runs: list[Run], rows: list[dict], config: tuple) -> None:
    """The training state a rank holds, part by part (darkest at the bottom: the weights); the
    legend lists only the parts some bar has."""
    drawn: list[str] = []
    for x, row in enumerate(rows):
        run = cast(Run, _first_run(runs, config, row["backend"]))  # each row is some run's
        state = run.summary.backend_stats.state_bytes or {}
        bottom = 0.0
        for part in STATE_PARTS:
            if not state.get(part):
                continue
            mib = state[part] / 2**20
            ax.bar(
                x,
                mib,
                0.6,
                bottom=bottom,
                color=colour(row["backend"]),
                alpha=PART_ALPHA[part],
                edgecolor="white",
            )
            bottom += mib
            drawn += [part] if part not in drawn else []
        ax.text(x, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
    ax.set(
        xlabel="backend",
        ylabel="MiB",
        title=f"{_config_label(config)}: training state a rank holds, by part",
    )
    ax.title.set_fontsize(9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.5)  # room for the legend above the bars
    parts = [p for p in STATE_PARTS if p in drawn]
    handles = [plt.Rectangle((0, 0), 1, 1, color="grey", alpha=PART_ALPHA[p]) for p in parts]
    ax.legend(handles, parts, fontsize=8, title="part (darker: lower)", ncol=len(parts) or 1)


def _peak_bars(ax, runs: list[Run], rows: list[dict], config: tuple) -> None:
    """Peak device memory where the backend reports it; else the process's peak resident memory,
    split into what it held before training (imports, runtimes) and what training added."""
    device = any(r["peak_device_mib"] for r in rows)
    for x, row in enumerate(rows):
        if device:
            peak = row["peak_device_mib"]
            ax.bar(x, peak or 0, 0.6, color=colour(row["backend"]))
            ax.text(x, peak or 0, fmt(peak), ha="center", va="bottom", fontsize=8)
            continue
        mine = _mine(runs, config, row["backend"])
        start = _median([max(r.summary.host_bytes_at_start or [0]) / 2**20 for r in mine])
        peak = row["peak_host_mib"] or 0
        ax.bar(x, start, 0.6, color=colour(row["backend"]), alpha=0.3, hatch="..")
        ax.bar(x, max(peak - start, 0), 0.6, bottom=start, color=colour(row["backend"]))
        ax.text(x, peak, f"+{peak - start:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
    if device:
        ax.set(xlabel="backend", ylabel="MiB", title="peak device memory (median over runs)")
        return
    ax.set(
        xlabel="backend",
        ylabel="MiB (median over runs)",
        title="host memory: before training (dotted: imports, runtimes) + what training added",
    )
    ax.title.set_fontsize(9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)


FIGURES = {"throughput": throughput, "timeline": timeline, "agreement": agreement, "memory": memory}


def figures(runs: list[Run], table: list[dict]) -> dict[str, Figure]:
    """Each question's figure (open: the caller saves and closes them)."""
    return {name: draw(runs, table) for name, draw in FIGURES.items()}


def save_figures(runs: list[Run], table: list[dict], out: Path) -> list[Path]:
    paths = []
    for name, fig in figures(runs, table).items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
