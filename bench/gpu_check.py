"""What holds on a GPU machine, in stages of at most 8 minutes each on an H100.

    python bench/gpu_check.py --stage tests     # the GPU test tier (pytest -m gpu)
    python bench/gpu_check.py --stage bench     # ViT-B/16 and Swin-T, batch 128, O1: eager,
                                                #   compile, jax, each with its fed step, 2 launches
    python bench/gpu_check.py --stage data      # Swin-T from 2000 real 400-px JPEGs, eager and jax,
                                                #   decoded on the GPU and by CPU workers
    python bench/gpu_check.py --smoke           # every stage on CPU with the micro models (< 90 s)

Runs from the source tree as the machine has it, with no install step: wheels it lacks (torchax)
are read from the ignored `.whl/` folder (docs/benchmarks.md, "Checking a GPU machine"). It
prints the versions it finds and names each missing piece in one line first. Every stage appends
to one results file, bench/results/gpu-check-<device>.json (or under --results DIR), with a
Markdown twin; the file holds the device, driver and versions, and the ratios computed in the
same run. A stage that runs past its budget is stopped: what it has is written, and the part that
did not finish is named.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
STAGES = ("tests", "bench", "data")
STAGE_BUDGET_S = 480
SMOKE_BUDGET_S = {"tests": 20, "bench": 45, "data": 25}  # shares of --smoke's 90 s
NEEDED = ("torch", "torchvision", "timm", "jax", "torchax", "optax")
REPORTED = (*NEEDED, "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch_xla")
REPORTED += ("nvidia-nvimgcodec-cu13",)
WHEEL_HINT = (
    "pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
    "--platform manylinux2014_x86_64 -d .whl {name}"
)


def wheel_paths() -> list[str]:
    """Pure-Python wheels in .whl/, importable as they are (a wheel is a zip archive)."""
    return [str(p) for p in sorted(WHEELS.glob("*.whl"))]


def environment(smoke: bool) -> dict[str, str]:
    """The environment of every process a stage starts: the source tree and the copied
    wheels in .whl/ importable; on CPU (--smoke), XLA and JAX on their CPU platforms."""
    paths = [*wheel_paths(), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    env["PYTHONUNBUFFERED"] = "1"
    if smoke:
        env.update(PJRT_DEVICE="CPU", JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def versions() -> dict[str, str | None]:
    sys.path[:0] = [p for p in wheel_paths() if p not in sys.path]
    found = {}
    for name in REPORTED:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def device() -> dict[str, str]:
    import torch

    if not torch.cuda.is_available():
        return {"device": "CPU", "driver": "-", "cuda": "-"}
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        driver = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = "unknown"
    return {
        "device": torch.cuda.get_device_name(0),
        "driver": driver,
        "cuda": str(torch.version.cuda),
    }


class Results:
    """One JSON file (and its Markdown twin) that every stage appends to."""

    def __init__(self, info: dict, smoke: bool, folder: Path):
        slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-")
        self.path = folder / f"gpu-check-{'smoke' if smoke else slug}.json"
        self.record = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.record.update(info)
        self.record.setdefault("stages", {})

    def add(self, stage: str, result: dict) -> None:
        self.record["stages"][stage] = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            **result,
        }
        self.path.write_text(json.dumps(self.record, indent=2) + "\n")
        self.path.with_suffix(".md").write_text(self.markdown())

    def markdown(self) -> str:
        r = self.record
        stack = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if v)
        lines = [f"# gpu_check: {r['device']} (driver {r['driver']}, CUDA {r['cuda']})", "", stack]
        for stage, result in r["stages"].items():
            lines += ["", f"## {stage} ({result['date']})", ""]
            lines += [f"- {line}" for line in result.get("lines", [])]
        return "\n".join(lines) + "\n"


class Budget:
    """The seconds a stage has left; its parts take what remains."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def run(cmd: list[str], budget: Budget, env: dict, part: str) -> tuple[int | None, str]:
    """(exit code, or None past the budget; its output)."""
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget.left() or 1
        )
    except subprocess.TimeoutExpired as err:
        output = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        print(f"gpu_check: {part} did not finish within the stage's budget", flush=True)
        return None, output
    return done.returncode, done.stdout + done.stderr


# --- stages -----------------------------------------------------------------------------------
def stage_tests(smoke: bool, env: dict, budget: Budget, launches: int = 2) -> dict:
    """The GPU tier: each test passes on CUDA, or is skipped with its reason elsewhere."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider"]
    code, output = run([*cmd, "tests/gpu"], budget, env, "pytest -m gpu")
    counts = {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", output)
    }
    reasons = sorted(set(re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", output)))
    lines = [f"{k}: {v}" for k, v in counts.items()] + [f"skipped because: {r}" for r in reasons]
    if code is None:
        lines.append("unfinished: pytest -m gpu ran past the budget")
    return {"exit_code": code, "counts": counts, "lines": lines}


def stage_bench(smoke: bool, env: dict, budget: Budget, launches: int = 2) -> dict:
    """Each backend's loop and its fed step (bench/compare_backends.py); `launches` of each job
    (a second shows what the compile caches save)."""
    if smoke:
        jobs = [("vit_micro", "eager,jax", "16", "1", "O0")]  # the harness, not the numbers
    else:
        jobs = [
            ("vit_base_patch16_224,swin_tiny_patch4_window7_224", "eager,compile,jax", "128",
             str(launches), "O1"),
            ("vit_base_patch16_224,swin_tiny_patch4_window7_224", "jax", "256", "1", "O1"),
        ]  # fmt: skip
    rows, lines = [], []
    for models, backends, batch, launches, amp in jobs:
        tag = f"gpu-check-bench-{batch}"
        cmd = [sys.executable, "bench/compare_backends.py", "--models", models, "--backends",
               backends, "--batch_size", batch, "--launches", launches, "--amp_level", amp,
               "--fed", "--tag", tag, "--steps", "6" if smoke else "30",
               "--warmup", "2" if smoke else "5", "--workers", "2" if smoke else "12"]  # fmt: skip
        code, _ = run(cmd, budget, env, f"bench batch {batch}")
        written = ROOT / "bench" / "results" / f"{tag}.json"
        if code is None or not written.is_file():
            lines.append(f"unfinished: {models} on {backends} at batch {batch}")
            break
        rows += [
            {**r, "batch_size": int(batch)} for r in json.loads(written.read_text())["results"]
        ]
        written.unlink()  # folded into this stage's record
    lines += [_bench_line(r) for r in rows]
    return {"rows": rows, "lines": lines}


def _bench_line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']} {row['backend']} batch {row['batch_size']}: failed"
    peak = row.get("peak_memory_bytes")
    efficiency = row.get("loop_efficiency")
    return (
        f"{row['model']} {row['backend']} batch {row['batch_size']} launch {row['launch']}: "
        f"{row['images_per_sec']:.0f} img/s, first step {row['time_to_first_step_s']:.1f} s"
        + (f", loop efficiency {efficiency:.2f}" if efficiency else "")
        + (f", peak {peak / 2**30:.1f} GiB" if peak else "")
        + (f", MFU {row['mfu']:.2f}" if row.get("mfu") else "")
        + (f", attention {row['attention']}" if row.get("attention") else "")
    )


def stage_data(smoke: bool, env: dict, budget: Budget, launches: int = 2) -> dict:
    """A JPEG folder decoded on the GPU (nvJPEG) and by CPU workers, on eager and jax."""
    sys.path.insert(0, str(ROOT))
    from accel.data.prepare import prepare_mock_imagenet
    from bench.compare_backends import launch_summary

    model = "swin_micro" if smoke else "swin_tiny_patch4_window7_224"
    devices = ["cpu"] if smoke else ["gpu", "cpu"]
    rows, lines = [], [] if not smoke else ["skipped: --data_device gpu (no CUDA device)"]
    with tempfile.TemporaryDirectory() as tmp:
        per_class, size = (10, 48) if smoke else (100, 400)
        data = prepare_mock_imagenet(Path(tmp) / "jpegs", 20 if not smoke else 4, per_class,
                                     2, size, progress=False)  # fmt: skip
        for backend in ("eager", "jax"):
            for where in devices:
                if budget.left() < 5:
                    lines.append(f"unfinished: {backend} with --data_device {where}")
                    continue
                flags = ["--backend", backend, "--model", model, "--data", str(data),
                         "--data_device", where, "--steps", "6" if smoke else "40",
                         "--batch_size", "8" if smoke else "128", "--amp_level",
                         "O0" if smoke else "O1", "--workers", "2" if smoke else "14",
                         "--mixup", "0.8", "--cutmix", "1.0", "--no-eval"]  # fmt: skip
                os.environ.update(env)
                summary = launch_summary(flags, Path(tmp) / "runs", f"{backend}-{where}")
                row = {"backend": backend, "data_device": where, "ok": summary is not None}
                if summary:
                    row.update(images_per_sec=summary["images_per_sec"],
                               data_wait_fraction=summary["data_wait_fraction"])  # fmt: skip
                rows.append(row)
    lines += [
        f"{r['backend']} --data_device {r['data_device']}: "
        + (f"{r['images_per_sec']:.0f} img/s, data wait {r['data_wait_fraction']:.0%}"
           if r["ok"] else "failed")
        for r in rows
    ]  # fmt: skip
    return {"model": model, "rows": rows, "lines": lines}


RUNNERS = {"tests": stage_tests, "bench": stage_bench, "data": stage_data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=(*STAGES, "all"), default="all")
    p.add_argument("--smoke", action="store_true", help="on CPU, micro models, under 90 s")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="folder")
    p.add_argument("--budget", type=float, help=f"seconds per stage (default {STAGE_BUDGET_S})")
    p.add_argument("--launches", type=int, default=2, help="launches of each bench job")
    args = p.parse_args(argv)
    found = versions()
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in found.items() if v), flush=True)
    missing = [name for name in NEEDED if not found[name]]
    for name in missing:
        hint = WHEEL_HINT.format(name=name) if name == "torchax" else f"pip install {name}"
        print(f"gpu_check: missing {name}: put its wheel in .whl/ ({hint})", file=sys.stderr)
    if missing:
        return 2
    info = {**device(), "versions": found}
    if info["device"] == "CPU" and not args.smoke:
        print("gpu_check: no CUDA device visible: every stage needs one (--smoke runs on CPU)")
        return 2
    args.results.mkdir(parents=True, exist_ok=True)
    results = Results(info, args.smoke, args.results)
    env = environment(args.smoke)
    for stage in STAGES if args.stage == "all" else (args.stage,):
        seconds = SMOKE_BUDGET_S[stage] if args.smoke else STAGE_BUDGET_S
        result = RUNNERS[stage](args.smoke, env, Budget(args.budget or seconds), args.launches)
        results.add(stage, result)
        print(f"gpu_check: {stage}\n  " + "\n  ".join(result["lines"]), flush=True)
    print(f"gpu_check: results in {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
