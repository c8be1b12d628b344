"""accel-report over real runs: three backends, two runs each."""

from __future__ import annotations

import csv
import re
import shutil
import statistics

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex
from matplotlib.ticker import MaxNLocator

from accel.cli.train import Trainer
from accel.report.figures import COLOURS, STATE_PARTS, figures, step_groups
from accel.report.tables import README_BEGIN, README_END, aggregate, find_runs, update_readme
from accel.report.tables import main as report_main
from tests.helpers import HAS_XLA, launch, micro_config, run_cli

pytestmark = pytest.mark.slow  # six runs: two each of eager, xla and jax, compiled

BACKENDS = ("eager", "xla" if HAS_XLA else "compile", "jax")
RUNS = ("first", "second")


@pytest.fixture(scope="module")
def run_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for backend in BACKENDS:
        for name in RUNS:
            cfg = micro_config(root, backend=backend, steps=4, run_name=name, eval=True)
            Trainer(cfg).train()
    return root


def _csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_one_row_per_backend_with_the_median_of_its_runs(run_tree, tmp_path):
    assert report_main([str(run_tree), "--out", str(tmp_path)]) == 0
    every = _csv(tmp_path / "report.csv")
    assert sorted((r["backend"], r["run"]) for r in every) == sorted(
        (b, n) for b in BACKENDS for n in RUNS
    )
    runs, _ = find_runs(run_tree)
    table = aggregate(runs)
    assert [(r["backend"], r["runs"]) for r in table] == [(b, 2) for b in BACKENDS]
    medians = {
        b: statistics.median(r.summary.images_per_sec for r in runs if r.backend == b)
        for b in BACKENDS
    }
    for row in table:
        assert row["images_per_sec"] == pytest.approx(medians[row["backend"]])
        assert row["speedup"] == pytest.approx(medians[row["backend"]] / medians["eager"])
        assert row["eval_acc"] is not None and row["step_time_ms"] > 0
    markdown = (tmp_path / "report.md").read_text()
    assert all(re.search(rf"\| vit_micro \| {b} \| 2 \|", markdown) for b in BACKENDS)
    for name in ("throughput", "timeline", "agreement", "memory"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _coloured(ax) -> dict[str, set[str]]:
    """Backend label -> colours of the lines and bars drawn under that label."""
    found: dict[str, set[str]] = {}
    for artist in [*ax.lines, *ax.patches]:
        label = artist.get_label()
        if label in COLOURS:
            colour = artist.get_color() if hasattr(artist, "get_xdata") else artist.get_facecolor()
            found.setdefault(label, set()).add(to_hex(colour, keep_alpha=False))
    return found


def test_every_figure_is_titled_labelled_and_keeps_each_backends_colour(run_tree):
    runs, _ = find_runs(run_tree)
    drawn = figures(runs, aggregate(runs))
    try:
        seen: dict[str, set[str]] = {}
        for name, fig in drawn.items():
            title = fig._suptitle.get_text()
            assert "?" in title and "batch 8" in title, name
            assert "2 run(s) of each job and backend" in title, name
            for ax in fig.axes:
                assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), name
                for backend, colours in _coloured(ax).items():
                    seen.setdefault(backend, set()).update(colours)
        assert seen == {b: {COLOURS[b]} for b in BACKENDS}  # one colour each, everywhere
        agreement = {ax.get_title(): ax for ax in drawn["agreement"].axes}
        difference = agreement["difference from eager"]
        assert difference.get_yscale() == "log"
        assert {line.get_label() for line in difference.lines} == set(BACKENDS) - {"eager"}
        steps_axes = [ax for ax in drawn["timeline"].axes if "optimizer step" in ax.get_xlabel()]
        steps_axes += [ax for ax in drawn["agreement"].axes if "optimizer step" in ax.get_xlabel()]
        assert len(steps_axes) == 3
        for ax in steps_axes:  # integer step ticks
            assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
            assert all(float(t).is_integer() for t in ax.get_xticks())
    finally:
        for fig in drawn.values():
            plt.close(fig)


def test_the_pictures_draw_what_was_measured(run_tree):
    runs, _ = find_runs(run_tree)
    for run in runs:  # steps timed together are one group; every timed step is in one
        groups = step_groups(run)
        assert groups[0][:2] == (1, 1)
        timed = run.series("step_time_s")[0]
        assert [s for first, last, _ in groups for s in range(first, last + 1)] == timed
    drawn = figures(runs, aggregate(runs))
    try:
        accuracy = [ax for ax in drawn["agreement"].axes if ax.get_ylabel() == "validation top-1"]
        assert any(list(line.get_ydata()) == [0.1, 0.1] for line in accuracy[0].lines)  # chance
        state = next(ax for ax in drawn["memory"].axes if "by part" in ax.get_title())
        held = {p for r in runs for p, n in r.summary.backend_stats.state_bytes.items() if n}
        legend = [t.get_text() for t in state.get_legend().get_texts()]
        assert legend == [p for p in STATE_PARTS if p in held]  # the parts the bars show
    finally:
        for fig in drawn.values():
            plt.close(fig)


def test_a_folder_above_the_runs_is_searched_and_a_wrong_one_names_the_layout(
    run_tree, tmp_path, capsys
):
    above = tmp_path / "above"
    shutil.copytree(run_tree, above / "experiments" / "output")
    assert report_main([str(above), "--out", str(tmp_path / "out")]) == 0
    assert len(_csv(tmp_path / "out" / "report.csv")) == 2 * len(BACKENDS)
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no finished runs" in err
    assert "<model>/<backend>/<run>/summary.json" in err


def test_unfinished_runs_and_corrupt_lines_are_reported_once_and_left_out(
    run_tree, tmp_path, capsys
):
    tree = tmp_path / "runs"
    shutil.copytree(run_tree, tree)
    crashed = tree / "vit_micro" / "eager" / "crashed"
    crashed.mkdir(parents=True)
    (crashed / "metrics.jsonl").write_text("")  # started, never finished
    with open(tree / "vit_micro" / BACKENDS[1] / "first" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 99, "lo\n')
    assert report_main([str(tree), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err.count("unfinished run") == 1 and err.count("corrupt line") == 1
    assert {r["backend"] for r in _csv(tmp_path / "out" / "report.csv")} == set(BACKENDS)
    assert "Left out" in (tmp_path / "out" / "report.md").read_text()


def test_the_readme_block_is_filled_from_the_same_runs(run_tree, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{README_BEGIN}\nold\n{README_END}\n\nrest\n")
    runs, _ = find_runs(run_tree)
    (tmp_path / "report").mkdir()
    update_readme(readme, aggregate(runs), runs, tmp_path / "report" / "throughput.png")
    text = readme.read_text()
    assert text.startswith("intro") and text.endswith("rest\n") and "old" not in text
    assert "CPU," in text and "torch 2." in text and "2 run(s) of each job and backend" in text
    assert "![which backend is faster](report/throughput.png)" in text
    assert all(f"| vit_micro | {b} | 2 |" in text for b in BACKENDS)


def test_compare_repeats_each_backend_in_turn_and_prints_medians_with_their_spread(tmp_path):
    result = run_cli(
        *("--compare", "eager,jax", "--repeats", "2", "--model", "vit_micro", "--steps", "4"),
        *("--batch_size", "8", "--workers", "0", "--no-eval", "--output", str(tmp_path)),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout[result.stdout.index("comparison of vit_micro") :]
    assert "medians of 2 runs each" in table
    assert re.search(r"\| eager \| 2 \| [\d.]+ \| 1 \| [\d.]+-[\d.]+ over 2 runs \|", table)
    assert re.search(r"\| jax \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+-[\d.]+ over 2 runs \|", table)
    assert "spread unknown" not in table
    for backend in ("eager", "jax"):  # a folder a run, the repeat in its name
        runs = sorted((tmp_path / "vit_micro" / backend).glob("compare-*/summary.json"))
        assert [p.parent.name[-3:] for p in runs] == ["-r1", "-r2"]


def test_compare_refuses_unknown_backends_in_one_line(tmp_path):
    result = launch("--compare", "eager,tpu", "--steps", "1", "--output", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "tpu" in result.stderr
