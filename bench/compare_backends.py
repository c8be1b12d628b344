"""Benchmark: the same model and batch on several backends, back to back in one invocation.

Synthetic data, steady-state img/s (warm-up excluded) and the ratio to the first backend. A backend
may carry `+kernel_opt`, e.g. `--backends eager,compile,jax,jax+kernel_opt`. Results are printed and
written to bench/results/<tag>.json with the device and library versions.

    python bench/compare_backends.py --models vit_micro,swin_micro --backends eager,compile
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel.config import OptimConfig, RunConfig  # noqa: E402
from accel.distributed import DistContext  # noqa: E402
from accel.train import Trainer  # noqa: E402
from data.loaders import DataConfig  # noqa: E402
from models.factory import ModelConfig  # noqa: E402

PACKAGES = ("torch", "torchvision", "timm", "torch_xla", "jax", "jaxlib", "torchax", "optax")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return found


def write_result(name: str, record: dict) -> Path:
    """bench/results/<name>.json: the record with the date, device and library versions."""
    stamped = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        **record,
    }
    path = ROOT / "bench" / "results" / f"{name}.json"
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    print(f"\nwritten {path}")
    return path


def bench_one(model: str, spec: str, args: argparse.Namespace, out: Path) -> dict:
    backend, _, option = spec.partition("+")
    cfg = RunConfig(
        backend=backend,
        model=ModelConfig(model, num_classes=args.num_classes),
        data=DataConfig(
            num_classes=args.num_classes,
            workers=args.workers,
            synthetic_length=args.batch_size * (args.steps + 1),
        ),
        optim=OptimConfig(),
        batch_size=args.batch_size,
        steps=args.steps,
        amp_level=args.amp_level,
        kernel_opt=option == "kernel_opt",
        output=str(out),
        run_name=spec,
        eval=False,
        log_every=args.steps,
        timing_warmup_steps=args.warmup,
    )
    summary = Trainer(cfg, DistContext()).train()
    keep = (
        "images_per_sec",
        "time_to_first_step_s",
        "compiles_after_warmup",
        "data_wait_fraction",
        "peak_memory_bytes",
    )
    return {"model": model, "backend": spec, **{k: summary[k] for k in keep if k in summary}}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<32}{'backend':<20}{'img/s':>10}{'x first':>9}{'first step s':>14}")
    for row in rows:
        print(
            f"{row['model']:<32}{row['backend']:<20}{row['images_per_sec']:>10.1f}"
            f"{row['speedup']:>9.2f}{row['time_to_first_step_s']:>14.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="vit_micro,swin_micro")
    p.add_argument("--backends", default="eager,compile")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of img/s")
    p.add_argument("--amp_level", default="O0")
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tag", default="", help="results file name (default: derived)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for model in args.models.split(","):
            first = None
            for spec in args.backends.split(","):
                row = bench_one(model, spec, args, Path(out))
                first = first or row["images_per_sec"]
                row["speedup"] = row["images_per_sec"] / first
                rows.append(row)
    print_table(rows)
    record = {
        "settings": vars(args),
        "note": "one run per row; speedup is the ratio to the first backend of the model",
        "results": rows,
    }
    tag = args.tag or f"{args.backends.replace(',', '-').replace('+', '_')}-{args.amp_level}"
    write_result(tag, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
