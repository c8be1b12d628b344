"""summary.json as one typed record: what the Trainer writes flat, the report reads back."""

from __future__ import annotations

from accel.backends.base import BackendStats
from accel.report.run_records import Run, run_row
from accel.report.summary import RunSummary


def test_a_partial_older_summary_reads_with_defaults_and_its_parts_in_place():
    old = {
        "backend": "jax",
        "model": "vit_micro",
        "global_batch_size": 16,
        "images_per_sec": 400.0,
        "losses": [2.3, None],  # a non-finite loss is written as null
        "compile_time_s": 3.5,
        "compile_phases_s": {"trace": 1.0},
        "eval_acc": 0.5,
        "eval_loss_ema": 1.2,
        "tp_head": 2,  # a backend's own detail
    }
    summary = RunSummary.from_dict(old)
    assert summary.amp_level == "O0" and summary.steps == 0 and summary.peak_host_bytes == []
    assert summary.backend_stats.compile_time_s == 3.5
    assert summary.backend_stats.compile_phases_s == {"trace": 1.0}
    assert summary.backend_stats.details == {"tp_head": 2}
    assert summary.evaluation == {"eval_acc": 0.5, "eval_loss_ema": 1.2}
    assert summary.eval_acc == 0.5 and summary.final_loss is None
    flat = summary.to_dict()
    assert {k: flat[k] for k in old} == old  # written back under the same names
    assert set(flat) >= {f for f in BackendStats.__dataclass_fields__ if f != "details"}


def test_the_report_row_reads_the_typed_fields():
    summary = RunSummary(global_batch_size=8, images_per_sec=4.0, losses=[1.0, 0.5])
    summary.backend_stats.compile_time_s = 2.0
    summary.backend_stats.peak_memory_bytes = 3 * 2**20
    summary.peak_host_bytes = [2**20, 5 * 2**20]
    row = run_row(Run("vit_micro", "xla", "r", summary))
    assert row["step_time_ms"] == 2000.0 and row["compile_s"] == 2.0
    assert row["final_loss"] == 0.5 and row["peak_device_mib"] == 3 and row["peak_host_mib"] == 5
