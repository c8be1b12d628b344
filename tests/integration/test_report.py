"""accel-report over real runs of three backends."""

import csv
import json
import re
import shutil

import pytest

from accel.distributed import DistContext
from accel.report import main as report_main
from accel.train import Trainer
from tests.helpers import HAS_XLA, micro_config, run_cli

BACKENDS = ("eager", "xla" if HAS_XLA else "compile", "jax")


@pytest.fixture(scope="module")
def run_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for backend in BACKENDS:
        Trainer(micro_config(root, backend=backend, steps=4), DistContext()).train()
    return root


def test_report_numbers_equal_the_summaries(run_tree, tmp_path, capsys):
    assert report_main([str(run_tree), "--out", str(tmp_path)]) == 0
    summaries = {
        b: json.loads((run_tree / "vit_micro" / b / "t" / "summary.json").read_text())
        for b in BACKENDS
    }
    with open(tmp_path / "report.csv") as f:
        table = {row["backend"]: row for row in csv.DictReader(f)}
    assert set(table) == set(BACKENDS)
    eager_ips = summaries["eager"]["images_per_sec"]
    for backend, summary in summaries.items():
        row = table[backend]
        assert float(row["images_per_sec"]) == pytest.approx(summary["images_per_sec"])
        assert float(row["speedup"]) == pytest.approx(summary["images_per_sec"] / eager_ips)
        assert float(row["final_loss"]) == pytest.approx(summary["losses"][-1])
        assert int(row["compiles_after_warmup"]) == summary["compiles_after_warmup"]
        assert float(row["data_wait_fraction"]) == pytest.approx(summary["data_wait_fraction"])
    markdown = (tmp_path / "report.md").read_text()
    for backend, summary in summaries.items():
        assert f"| vit_micro | {backend} | t |" in markdown
        assert f"{summary['images_per_sec']:.2f}" in markdown
    for png in ("throughput.png", "losses.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unfinished_runs_and_corrupt_lines_are_reported_once_and_left_out(
    run_tree, tmp_path, capsys
):
    tree = tmp_path / "runs"
    shutil.copytree(run_tree, tree)
    (tree / "vit_micro" / "compile" / "crashed").mkdir(parents=True)  # no summary.json
    with open(tree / "vit_micro" / BACKENDS[1] / "t" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 99, "lo\n')
    assert report_main([str(tree), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err.count("unfinished run") == 1 and err.count("corrupt line") == 1
    with open(tmp_path / "out" / "report.csv") as f:
        assert {row["backend"] for row in csv.DictReader(f)} == set(BACKENDS)
    assert "Left out" in (tmp_path / "out" / "report.md").read_text()


def test_an_empty_tree_is_one_line_exit_2(tmp_path, capsys):
    assert report_main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no finished runs" in err


def test_compare_runs_each_backend_and_prints_one_row_each(tmp_path):
    result = run_cli(
        "--compare",
        "eager,jax",
        "--model",
        "vit_micro",
        "--steps",
        "4",
        "--batch_size",
        "8",
        "--workers",
        "0",
        "--no-eval",
        "--output",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout[result.stdout.index("comparison of vit_micro") :]
    assert re.search(r"\| eager \| [\d.]+ \| 1\.00 \|", table)
    assert re.search(r"\| jax \| [\d.]+ \| [\d.]+ \|", table)
    for backend in ("eager", "jax"):
        assert len(list((tmp_path / "vit_micro" / backend).glob("compare-*/summary.json"))) == 1


def test_compare_refuses_unknown_backends_in_one_line(tmp_path):
    result = run_cli("--compare", "eager,tpu", "--steps", "1", "--output", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "tpu" in result.stderr
