"""Benchmark: the same model and batch on several backends, each launch in its own process.

Each backend runs through launch_single_task (what a user runs) on synthetic data; a backend may
carry `+kernel_opt` or `+attention_xla` (`_cudnn`, `_auto`), e.g. `--backends
compile,jax,jax+attention_cudnn`. `--launches 2` starts every job twice into one output folder, so
the second launch shows what the compilation caches save. Reported per launch: steady-state
img/s (warm-up excluded) and its ratio to the first backend, time to first step and where it
went, peak device memory. Written to bench/results/<tag>.json with the device and versions.

    python bench/compare_backends.py --models vit_micro,swin_micro --backends eager,compile
    python bench/compare_backends.py --models vit_base_patch16_224,swin_tiny_patch4_window7_224 \
        --backends eager,compile,jax --amp_level O1 --batch_size 128 --workers 12 --launches 2 \
        --tag h100-vitb-swint-O1
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def write_result(name: str, record: dict, quiet: bool = False) -> Path:
    """bench/results/<name>.json: the record with the date, device and library versions."""
    stamped = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        **record,
    }
    path = ROOT / "bench" / "results" / f"{name}.json"
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    if not quiet:
        print(f"\nwritten {path}")
    return path


def launch_summary(flags: list[str], out: Path, run_name: str) -> dict | None:
    """Run launch_single_task with `flags` (which name --model, and --backend where not eager)
    into `out`; its summary.json, or None (with the end of its stderr printed) if it failed."""
    argv = [sys.executable, "-m", "accel.launch_single_task", *flags]
    argv += ["--output", str(out), "--run_name", run_name]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(next(out.glob(f"*/*/{run_name}/summary.json")).read_text())


KEEP = (
    "images_per_sec",
    "time_to_first_step_s",
    "startup_s",
    "compile_phases_s",
    "persistent_cache_hits",
    "compiles_after_warmup",
    "data_wait_fraction",
    "peak_memory_bytes",
    "attention",
    "flash_attention_refused",
    "mfu",
)


def job_flags(model: str, spec: str, args: argparse.Namespace) -> list[str]:
    """The flags that make the job: the same for the loop's launch and the fed step."""
    backend, _, option = spec.partition("+")
    return [
        *("--backend", backend, "--model", model, "--batch_size", str(args.batch_size)),
        *("--steps", str(args.steps), "--amp_level", args.amp_level),
        *("--num_classes", str(args.num_classes)),
        *(["--kernel-opt"] if option == "kernel_opt" else []),
        *(["--attention", option.partition("_")[2]] if option.startswith("attention_") else []),
    ]


def launch(model: str, spec: str, launch_index: int, args: argparse.Namespace, out: Path) -> dict:
    """One launch_single_task process; its summary.json, trimmed to what the table needs."""
    backend = spec.partition("+")[0]
    run_name = f"{spec}-{launch_index}"
    argv = [
        *(sys.executable, "-m", "accel.launch_single_task", *job_flags(model, spec, args)),
        *("--synthetic_length", str(args.batch_size * (args.steps + 1))),
        *("--workers", str(args.workers), "--timing_warmup_steps", str(args.warmup)),
        *("--log_every", str(args.steps), "--no-eval", "--no-save", "--output", str(out)),
        *("--run_name", run_name),
    ]
    result = subprocess.run(argv, cwd=ROOT)
    if result.returncode != 0:
        return {"model": model, "backend": spec, "launch": launch_index, "error": result.returncode}
    summary = json.loads((out / model / backend / run_name / "summary.json").read_text())
    row = {"model": model, "backend": spec, "launch": launch_index}
    return {**row, **{k: summary[k] for k in KEEP if k in summary}}


def fed(model: str, spec: str, args: argparse.Namespace) -> float | None:
    """img/s of the same step with the batch already on the device (bench/fed_step.py)."""
    argv = [
        *(sys.executable, str(ROOT / "bench" / "fed_step.py"), *job_flags(model, spec, args)),
        *("--warmup", str(args.warmup)),
    ]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])["fed_images_per_sec"]


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<30}{'backend':<18}{'launch':>7}{'img/s':>9}{'x first':>9}"
    print(f"\n{head}{'first step s':>14}{'peak GiB':>10}{'loop eff':>10}")
    for row in rows:
        if "error" in row:
            print(f"{row['model']:<30}{row['backend']:<18}{row['launch']:>7}  failed")
            continue
        peak = row.get("peak_memory_bytes")
        print(
            f"{row['model']:<30}{row['backend']:<18}{row['launch']:>7}"
            f"{row['images_per_sec']:>9.1f}{row['speedup']:>9.2f}"
            f"{row['time_to_first_step_s']:>14.1f}"
            f"{(peak / 2**30 if peak else float('nan')):>10.1f}"
            f"{row.get('loop_efficiency', float('nan')):>10.2f}"
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
    p.add_argument("--launches", type=int, default=1, help="launches of each job (cache reuse)")
    p.add_argument(
        "--fed",
        action="store_true",
        help="also time each backend's step fed with a batch already on the device, and "
        "report loop efficiency (the loop's img/s over the fed step's)",
    )
    p.add_argument("--tag", default="", help="results file name (default: derived)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for model in args.models.split(","):
            first = None
            for spec in args.backends.split(","):
                for index in range(1, args.launches + 1):
                    row = launch(model, spec, index, args, Path(out))
                    rows.append(row)
                    if "error" in row:
                        break
                    first = first or row["images_per_sec"]
                    row["speedup"] = row["images_per_sec"] / first
                    write_rows(rows, args, quiet=True)  # a run cut short keeps what it measured
                if args.fed and "error" not in rows[-1]:
                    rows[-1]["fed_images_per_sec"] = fed_ips = fed(model, spec, args)
                    if fed_ips:
                        rows[-1]["loop_efficiency"] = rows[-1]["images_per_sec"] / fed_ips
    print_table(rows)
    write_rows(rows, args)
    return 0


def write_rows(rows: list[dict], args: argparse.Namespace, quiet: bool = False) -> Path:
    record = {
        "settings": vars(args),
        "note": "one run per row, each launch its own process; speedup is the ratio to the "
        "first launch of the model's first backend",
        "results": rows,
    }
    tag = args.tag or f"{args.backends.replace(',', '-').replace('+', '_')}-{args.amp_level}"
    return write_result(tag, record, quiet)


if __name__ == "__main__":
    raise SystemExit(main())
