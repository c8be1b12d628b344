"""Run outputs: human log, per-rank metrics.jsonl, TensorBoard events and summary.json."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from accel.distributed import DistContext


def metrics_filename(rank: int) -> str:
    """Rank 0 writes metrics.jsonl; other ranks metrics.rank<r>.jsonl beside it."""
    return "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN or inf: they become null, in lists (losses) and dicts too."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value if not isinstance(value, float) or math.isfinite(value) else None


class AboveTheBar(logging.Handler):
    """Log lines on stdout written above the progress bar (tqdm.write clears it, writes the
    line and draws it again), so that neither is glued onto the other on a terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # logging's contract: a handler's failure is reported, never raised
            self.handleError(record)


class RunLogger:
    def __init__(self, run_dir: Path, ctx: DistContext, tensorboard: bool = True):
        self.run_dir = run_dir
        self.ctx = ctx
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = open(  # noqa: SIM115 (kept open for the whole run, closed in close())
            run_dir / metrics_filename(ctx.rank), "a", buffering=1
        )
        self.log = logging.getLogger(f"accel.run.{ctx.rank}")
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        self.log.handlers.clear()
        if ctx.is_main:
            fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
            for handler in (logging.FileHandler(run_dir / "train.log"), AboveTheBar()):
                handler.setFormatter(fmt)
                self.log.addHandler(handler)
        self.tb = None
        if tensorboard and ctx.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def info(self, message: str) -> None:
        self.log.info(message)

    def record(self, kind: str, **fields: Any) -> None:
        """One JSON line (non-finite floats become null, so the file stays valid JSON)."""
        row = {
            "kind": kind,
            "rank": self.ctx.rank,
            **_finite_or_none(fields),
        }
        self.metrics.write(json.dumps(row) + "\n")

    def scalars(self, step: int, **values: float) -> None:
        if self.tb is not None:
            for name, value in values.items():
                self.tb.add_scalar(name, value, step)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        clean = _finite_or_none(summary)
        tmp.write_text(json.dumps(clean, indent=2, sort_keys=True, default=str))
        tmp.replace(path)
        return path

    def close(self) -> None:
        """Close every file; a failure (a full disk) does not hide the error that ended the run."""
        closers = [self.metrics.close, *(h.close for h in self.log.handlers)]
        if self.tb is not None:
            closers.append(self.tb.close)
        for close in closers:
            with contextlib.suppress(OSError):
                close()
        self.log.handlers.clear()


def utilisation(images_per_sec: float, flops_per_image: float, override: float, devices: int):
    """MFU and what it is computed from: the device name and its bf16 peak."""
    from accel.cli.flops import device_name, mfu, peak_tflops

    name = device_name()
    peak = peak_tflops(name, override or None)
    return {
        "flops_per_image": flops_per_image,
        "device_name": name,
        "peak_tflops": peak,
        "mfu": mfu(images_per_sec, flops_per_image, peak, devices),
    }


def describe_device(name: str) -> str:
    """The device a run's numbers were measured on, for reports ('cpu' gets its core count)."""
    return f"CPU, {os.cpu_count()} cores" if name == "cpu" else name


def steady_images_per_sec(images: int, steps: int, seconds: float) -> float:
    """img/s over the timed (post-warm-up) steps; 0 where none were timed."""
    return images * steps / seconds if steps > 0 and seconds > 0 else 0.0


def host_bytes_now() -> int:
    """This process's resident memory now (Linux /proc; 0 where unknown)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_host_bytes() -> int:
    """This process's peak resident memory so far (the kernel's high-water mark)."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024
