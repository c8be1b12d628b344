"""The report's pictures, one question each, drawn with matplotlib:

- throughput.png, which backend is faster: median img/s with the spread over runs, speed-ups;
- timeline.png, where the time goes: img/s step by step (compile and warm-up marked), and the
  time to the first step in its phases beside the steady step time;
- agreement.png, whether they agree: the loss per backend, each backend's distance from eager's
  (log scale), and validation top-1 where recorded;
- memory.png, what it costs: peak memory and the training state per backend.

Every figure keeps one colour per backend, a subtitle saying device, model, batch, AMP level,
steps and runs, short legends and integer step ticks; one column of panels per configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none opened
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from accel.run_records import Run, backend_order, fmt, repeats

COLOURS = {"eager": "#1f77b4", "compile": "#2ca02c", "xla": "#d62728", "jax": "#9467bd"}
STYLES = {"eager": "-", "compile": "--", "xla": "-.", "jax": ":"}  # coinciding lines stay visible
PHASES = ("imports", "backend", "setup", "flops", "loader", "logger", "first_step")


def colour(backend: str) -> str:
    return COLOURS.get(backend, "#7f7f7f")


def subtitle(runs: list[Run]) -> str:
    s = runs[0].summary
    device = s.get("device") or "unknown device"
    models = ", ".join(sorted({r.model for r in runs}))
    return (
        f"{device} | {models} | batch {s.get('global_batch_size')} | {s.get('amp_level')} | "
        f"{s.get('steps')} steps | {repeats(runs)} run(s) of each job and backend"
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
        for x, row in enumerate(rows):
            mine = [
                r.summary["images_per_sec"]
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
            ax.text(
                x,
                high,
                f"{row['speedup']:.2f}x" if row["speedup"] else "",
                ha="center",
                va="bottom",
                fontsize=9,
            )
        ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
        ax.set(xlabel="backend", ylabel="images / s", title=_config_label(config), ylim=(0, None))
        ax.margins(y=0.15)
    fig.text(
        0.5,
        0.01,
        "bars: median over runs; whiskers: slowest to fastest; dots: each run; "
        "labels: speed-up over eager",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def _first_run(runs: list[Run], config: tuple, backend: str) -> Run | None:
    return next((r for r in runs if r.config == config and r.backend == backend), None)


def timeline(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    fig, axes = _panels(2, len(configs), "Where does the time go?", runs)
    for column, config in enumerate(configs):
        backends = [b for b in _backends(runs) if _first_run(runs, config, b)]
        _rate_lines(axes[0][column], runs, config, backends)
        _startup_bars(axes[1][column], runs, config, backends)
    fig.tight_layout()
    return fig


def _rate_lines(ax, runs: list[Run], config: tuple, backends: list[str]) -> None:
    """img/s at every logged step of every run (log scale), the warm-up's end marked."""
    for backend in backends:
        mine = [r for r in runs if r.config == config and r.backend == backend]
        for i, run in enumerate(mine):
            steps, ips = run.series("images_per_sec")
            style = STYLES.get(backend, "-")
            label = backend if i == 0 else None
            ax.plot(steps, ips, style, color=colour(backend), marker="o", ms=3, label=label)
        warm = mine[0].summary.get("warm_step")
        if warm:
            ax.axvline(warm, color=colour(backend), alpha=0.4, lw=1)
    ax.set_yscale("log")
    ax.set(
        xlabel="optimizer step (vertical lines: end of warm-up)",
        ylabel="images / s (log)",
        title=f"{_config_label(config)}: step by step (step 1 compiles)",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)


def _startup_bars(ax, runs: list[Run], config: tuple, backends: list[str]) -> None:
    """Time to the first step, phase by phase (hatched: the first step itself, with its
    compile), and the steady step time written beside each bar."""
    for y, backend in enumerate(backends):
        run = _first_run(runs, config, backend)
        startup, left = run.summary.get("startup_s") or {}, 0.0
        for phase in PHASES:
            width = startup.get(phase, 0.0)
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
        ips = run.summary.get("images_per_sec") or 0
        step_ms = 1000 * run.summary["global_batch_size"] / ips if ips else float("nan")
        ax.text(left, y, f"  then {step_ms:.0f} ms a step", va="center", fontsize=8)
    ax.set_yticks(range(len(backends)), backends)
    ax.set(
        xlabel="seconds (light: imports, set-up, loader; hatched: first step with its compile)",
        ylabel="backend",
        title="time to the first step, then the steady step time",
    )
    ax.margins(x=0.3)


def agreement(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    evals = any(r.summary.get("eval_acc") is not None for r in runs)
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
            losses.plot(
                steps,
                values,
                STYLES.get(backend, "-"),
                color=colour(backend),
                lw=2.4 if backend == "eager" else 1.4,
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
            title=f"{_config_label(config)}: loss (eager thick)",
        )
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
            _eval_bars(axes[2][column], runs, config)
    fig.tight_layout()
    return fig


def _eval_bars(ax, runs: list[Run], config: tuple) -> None:
    backends = [b for b in _backends(runs) if _first_run(runs, config, b)]
    for x, backend in enumerate(backends):
        value = _first_run(runs, config, backend).summary.get("eval_acc")
        if value is not None:
            ax.bar(x, value, 0.6, color=colour(backend), label=backend)
            ax.text(x, value, f"{value:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(backends)), backends)
    ax.set(
        xlabel="backend",
        ylabel="validation top-1",
        ylim=(0, 1.05),
        title="validation accuracy after training",
    )


def memory(runs: list[Run], table: list[dict]) -> Figure:
    configs = _configs(runs)
    fig, axes = _panels(len(configs), 2, "What does it cost in memory?", runs)
    for row, config in enumerate(configs):
        rows = [r for r in table if r["config"] == config]
        _peak_bars(axes[row][0], rows, config)
        _state_bars(axes[row][1], runs, rows, config)
    fig.tight_layout()
    return fig


def _peak_bars(ax, rows: list[dict], config: tuple) -> None:
    device = any(r["peak_device_mib"] for r in rows)
    for x, row in enumerate(rows):
        peak = row["peak_device_mib"] if device else row["peak_host_mib"]
        ax.bar(x, peak or 0, 0.6, color=colour(row["backend"]))
        ax.text(x, peak or 0, fmt(peak), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
    kind = "device memory" if device else "host memory (process RSS, the largest rank)"
    ax.set(xlabel="backend", ylabel="MiB", title=f"{_config_label(config)}: peak {kind}")


STATE_PARTS = ("params", "masters", "grads", "optimizer", "ema")  # bottom to top
PART_ALPHA = dict(zip(STATE_PARTS, (1.0, 0.8, 0.6, 0.4, 0.25), strict=True))


def _state_bars(ax, runs: list[Run], rows: list[dict], config: tuple) -> None:
    """The training state a rank holds, part by part (darkest at the bottom: the weights)."""
    for x, row in enumerate(rows):
        state = _first_run(runs, config, row["backend"]).summary.get("state_bytes") or {}
        bottom = 0.0
        for part in STATE_PARTS:
            mib = state.get(part, 0) / 2**20
            label = part if x == 0 or part not in state else None
            ax.bar(
                x,
                mib,
                0.6,
                bottom=bottom,
                color=colour(row["backend"]),
                alpha=PART_ALPHA[part],
                edgecolor="white",
                label=label,
            )
            bottom += mib
    ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
    ax.set(xlabel="backend", ylabel="MiB", title="training state a rank holds, by part")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.5)  # room for the legend above the bars
    handles = [plt.Rectangle((0, 0), 1, 1, color="grey", alpha=PART_ALPHA[p]) for p in STATE_PARTS]
    ax.legend(
        handles, STATE_PARTS, fontsize=8, title="part (darker: lower)", ncol=5, loc="upper center"
    )


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
