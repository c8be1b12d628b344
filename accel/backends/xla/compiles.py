"""Compile accounting on the xla backend, read from torch_xla's metrics (per process, not per run):
the graphs compiled since the backend started and since warm-up (evaluation's own graphs not
counted), their compile time, the persistent cache, and the aten ops that ran outside the graph."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accel.backends.base import SinceStart
from accel.backends.xla.runtime import init_compile_cache, met


def compile_count() -> int:
    return met.counter_value("UncachedCompile") or 0


def counters() -> dict[str, float]:
    """The process's compile counters that BackendStats reports."""
    compile_time = met.metric_data("CompileTime")
    return {
        "compiles": compile_count(),
        "compile_time_s": compile_time[1] / 1e9 if compile_time else 0.0,
        "cache_hits": met.counter_value("PersistentCacheHit") or 0,
    }


def fallback_ops() -> dict[str, float]:
    """aten ops that ran on the CPU outside the XLA graph, with their call counts (this
    process's)."""
    return {name: met.counter_value(name) or 0 for name in met.executed_fallback_ops()}


class XlaCompiles:
    """The graphs compiled since the backend started, the step's apart from evaluation's."""

    def __init__(self, cache_dir: Path, readonly: bool):
        # The persistent cache is set before the first computation.
        self.persistent_cache = init_compile_cache(cache_dir, readonly)
        self.since_start = SinceStart(counters)  # the counters are per process, not per run
        self.fallbacks = SinceStart(fallback_ops)  # likewise: this backend's own
        self.evaluation = 0  # graphs compiled by evaluation

    def step_compiles(self) -> int:
        return int(self.since_start()["compiles"]) - self.evaluation

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """Graphs compiled inside (evaluation's own) are not recompiles of the step."""
        before = compile_count()
        try:
            yield
        finally:
            self.evaluation += compile_count() - before

    def stats(self) -> dict[str, Any]:
        """BackendStats' compile fields."""
        spent = self.since_start()
        return {
            "graphs_compiled": int(spent["compiles"]),
            "compile_time_s": spent["compile_time_s"],
            "persistent_cache": self.persistent_cache,
            "persistent_cache_hits": int(spent["cache_hits"]),
            "fallback_ops": {op: int(n) for op, n in self.fallbacks().items() if n > 0},
        }
