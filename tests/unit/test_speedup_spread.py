"""Every speed-up comes with the runs it rests on and their spread: the report's aggregate over run
trees of known images/s, the words a single run gets, and `--compare --repeats N` (its validation,
its interleaved runs and its table) without training anything."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from accel.cli import compare
from accel.report.figures import throughput
from accel.report.run_records import aggregate, find_runs
from accel.report.summary import RunSummary
from accel.report.tables import README_BEGIN, README_END, update_readme
from accel.report.tables import main as report_main
from tests.helpers import launch


def write_run(root: Path, backend: str, name: str, images_per_sec: float) -> None:
    """A finished run's summary.json where accel-report looks for it, with these images/s."""
    summary = RunSummary(
        backend=backend,
        model="vit_micro",
        global_batch_size=8,
        steps=4,
        images_per_sec=images_per_sec,
        losses=[2.3, 2.1],
        device="CPU, 2 cores",
    )
    run_dir = root / "vit_micro" / backend / name
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict()))
    steps = [{"kind": "step", "step": s, "loss": loss, "step_time_s": 8 / images_per_sec}
             for s, loss in enumerate(summary.losses, start=1)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))


def run_tree(root: Path, each: dict[str, list[float]]) -> Path:
    for backend, values in each.items():
        for number, ips in enumerate(values, start=1):
            write_run(root, backend, f"r{number}", ips)
    return root


def rows(root: Path) -> dict[str, dict]:
    runs, problems = find_runs(root)
    assert not problems
    return {row["backend"]: row for row in aggregate(runs)}


def test_the_spread_is_each_run_against_the_base_backends_median(tmp_path):
    # eager's median 100; xla's runs at 1.5x, 3x and 2x of it, their median 2x
    table = rows(run_tree(tmp_path, {"eager": [100, 80, 120], "xla": [150, 300, 200]}))
    xla, eager = table["xla"], table["eager"]
    assert xla["runs"] == 3 and xla["speedup"] == pytest.approx(2.0)
    assert (xla["speedup_low"], xla["speedup_high"]) == pytest.approx((1.5, 3.0))
    assert xla["speedup_spread"] == "1.50-3.00 over 3 runs"
    # the base's own runs against its median: how far a run of eager alone moves
    assert eager["speedup"] == 1 and eager["speedup_spread"] == "0.80-1.20 over 3 runs"


@pytest.mark.parametrize(
    ("each", "words"),
    [
        ({"eager": [100], "xla": [250]}, "1 run: spread unknown"),
        ({"eager": [100, 90, 110], "xla": [250]}, "1 run: spread unknown"),
        ({"eager": [100], "xla": [250, 200, 300]}, "1 eager run: spread unknown"),
    ],
)
def test_one_run_on_either_side_has_no_spread_and_says_so(tmp_path, each, words):
    xla = rows(run_tree(tmp_path, each))["xla"]
    assert xla["speedup"] == pytest.approx(2.5)
    assert xla["speedup_spread"] == words
    assert xla["speedup_low"] is None and xla["speedup_high"] is None  # not a spread of zero


def _report(root: Path, out: Path) -> tuple[str, list[dict]]:
    assert report_main([str(root), "--out", str(out)]) == 0
    with open(out / "report.csv") as f:
        return (out / "report.md").read_text(), list(csv.DictReader(f))


def test_the_report_prints_the_spread_and_keeps_each_runs_speedup(tmp_path, capsys):
    root = run_tree(tmp_path / "runs", {"eager": [100, 80, 120], "xla": [150, 300, 200]})
    markdown, every = _report(root, tmp_path / "report")
    assert "| speedup | speedup_spread |" in markdown
    assert "| 2 | 1.50-3.00 over 3 runs |" in markdown
    assert "From a single run" not in markdown and "spread unknown" not in markdown
    assert "| vit_micro | xla | 3 | 200 | 2 | 1.50-3.00 over 3 runs |" in capsys.readouterr().out
    xla = sorted((r for r in every if r["backend"] == "xla"), key=lambda r: r["run"])
    assert [float(r["speedup"]) for r in xla] == pytest.approx([1.5, 3.0, 2.0])
    assert {(r["runs"], r["speedup_spread"]) for r in xla} == {("3", "1.50-3.00 over 3 runs")}


def test_a_single_runs_speedup_is_called_one_in_words_beside_it(tmp_path, capsys):
    root = run_tree(tmp_path / "runs", {"eager": [100], "xla": [250]})
    markdown, every = _report(root, tmp_path / "report")
    assert "| 2.5 | 1 run: spread unknown |" in markdown
    assert "From a single run: the speed-up of xla over eager" in capsys.readouterr().out
    note = next(line for line in markdown.splitlines() if "From a single run" in line)
    assert "xla over eager (vit_micro)" in note and "--repeats 3" in note
    assert {r["speedup_spread"] for r in every} == {"1 run: spread unknown"}
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{README_BEGIN}\nold\n{README_END}\n")
    runs, _ = find_runs(root)
    update_readme(readme, aggregate(runs), runs, tmp_path / "report" / "throughput.png")
    block = readme.read_text()
    assert "| 2.5 | 1 run: spread unknown |" in block and "From a single run" in block
    picture = throughput(runs, aggregate(runs))
    try:  # the picture's label says it too
        assert "2.50x\n1 run: spread unknown" in [t.get_text() for t in picture.axes[0].texts]
    finally:
        plt.close(picture)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--compare", "eager,xla", "--repeats", "0"), "--repeats takes 1 or more"),
        (("--compare", "eager,xla", "--repeats", "-2"), "--repeats takes 1 or more"),
        (("--repeats", "3"), "give --compare too"),
    ],
)
def test_repeats_below_one_or_without_compare_is_one_line_and_exit_2(tmp_path, args, says):
    result = launch(*args, "--model", "vit_micro", "--steps", "1", "--output", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and says in result.stderr
    assert not any(tmp_path.iterdir())  # refused before any run started


def test_the_runs_options_leave_out_the_comparisons_own():
    argv = ["--compare", "eager,xla", "--repeats", "3", "--steps", "2", "--repeats=2"]
    assert compare.without_compare(argv) == ["--steps", "2"]
    assert compare.run_names("compare-x", 1) == ["compare-x"]
    assert compare.run_names("compare-x", 3) == ["compare-x-r1", "compare-x-r2", "compare-x-r3"]


def test_repeats_interleave_the_backends_and_table_their_medians(tmp_path, monkeypatch, capsys):
    speeds = {"eager": iter([100, 80, 120]), "xla": iter([150, 300, 200])}
    started: list[tuple[str, str]] = []

    def fake_run(argv: list[str], backend: str, name: str) -> int:
        """A run that only writes its summary.json, with the next of its backend's speeds."""
        started.append((backend, name))
        write_run(tmp_path, backend, name, next(speeds[backend]))
        return 0

    monkeypatch.setattr(compare, "run_one", fake_run)
    argv = ["--compare", "eager,xla", "--repeats", "3"]
    assert compare.run_comparison(argv, ["eager", "xla"], "vit_micro", str(tmp_path), 3) == 0
    assert [b for b, _ in started] == ["eager", "xla"] * 3  # load drift falls on both alike
    names = [n for _, n in started]
    assert [n[-3:] for n in names] == ["-r1", "-r1", "-r2", "-r2", "-r3", "-r3"]
    assert len({n[:-3] for n in names}) == 1  # one comparison's stamp
    out = capsys.readouterr().out
    assert "medians of 3 runs each" in out
    assert "| xla | 3 | 200 | 2 | 1.50-3.00 over 3 runs |" in out
    assert "From a single run" not in out
