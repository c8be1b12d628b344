"""summary.json: a finished training run's numbers, one typed record on both sides: the Trainer
fills a RunSummary and writes it flat (the backend's stats and the final evaluation beside the
loop's own fields, by their names); accel-report reads one back, older or partial files
included (a field a file lacks keeps its default)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from accel.backends.base import BackendStats

EVAL_PREFIX = "eval_"  # the final evaluation's fields: eval_loss, eval_acc, ..., and _ema twins


@dataclass
class RunSummary:
    """What a training run reports at its end (--eval_only writes a smaller record of its own,
    which the report leaves out)."""

    backend: str = ""
    model: str = ""
    run_dir: str = ""
    world_size: int = 1  # devices the step ran on: data replicas x tensor x pipeline ranks
    amp_level: str = "O0"
    global_batch_size: int = 0
    steps: int = 0
    seed: int = 0
    kernel_opt: bool = False
    losses: Sequence[float | None] = field(default_factory=list)  # per step; None: not finite
    nonfinite_steps: list[int] = field(default_factory=list)
    images_per_sec: float | None = None  # steady state, after warm_step
    warm_step: int = 0
    time_to_first_step_s: float | None = None
    startup_s: dict[str, float] = field(default_factory=dict)  # where time to first step went
    data_wait_fraction: float | None = None
    # MFU and what it is computed from
    flops_per_image: float | None = None
    device_name: str = ""
    peak_tflops: float | None = None
    mfu: float | None = None
    device: str = ""  # the device as reports name it ("CPU, 2 cores")
    versions: dict[str, str] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)  # --eval_every's, by epoch
    skipped_images: int = 0
    peak_host_bytes: list[int] = field(default_factory=list)  # one a rank
    host_bytes_at_start: list[int] = field(default_factory=list)
    backend_stats: BackendStats = field(default_factory=BackendStats)
    evaluation: dict[str, float] = field(default_factory=dict)  # the final one: eval_* fields

    def to_dict(self) -> dict[str, Any]:
        """summary.json's object: the loop's fields, then the backend's stats and the final
        evaluation, flat."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        stats, evaluation = own.pop("backend_stats"), own.pop("evaluation")
        return {**own, **stats.to_summary(), **evaluation}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        """A summary.json object read back; keys of neither the loop nor the stats (a
        backend's own details) go to the stats' `details`."""
        own = {f.name for f in dataclasses.fields(cls)} - {"backend_stats", "evaluation"}
        stat_fields = {f.name for f in dataclasses.fields(BackendStats)} - {"details"}
        values, stats, details, evaluation = {}, {}, {}, {}
        for key, value in data.items():
            if key in own:
                values[key] = value
            elif key in stat_fields:
                stats[key] = value
            elif key.startswith(EVAL_PREFIX) and key != "eval_only":
                evaluation[key] = value
            else:
                details[key] = value
        return cls(**values, backend_stats=BackendStats(**stats, details=details),
                   evaluation=evaluation)  # fmt: skip

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def eval_acc(self) -> float | None:
        return self.evaluation.get("eval_acc")
