"""What holds on a GPU machine, fitted to one command of at most 9 minutes on an H200.

    python bench/gpu_check.py                   # profile, remat, bench, tests, in this order:
    python bench/gpu_check.py --stage profile   # Swin-T's and ViT-B/16's fed steps, jax and
                                                #   compile: img/s, peak memory, top device ops
    python bench/gpu_check.py --stage remat     # the same jax steps with remat dots and full
    python bench/gpu_check.py --stage bench     # Swin-T and ViT-B/16, batch 128, O1: compile
                                                #   and jax (--backends to change), one launch
    python bench/gpu_check.py --stage tests     # the GPU test tier (pytest -m gpu, 6 workers)
    python bench/gpu_check.py --stage decode    # nvJPEG against PIL: the decode and the resize
    python bench/gpu_check.py --stage attention # jax's attention per shape, XLA against cuDNN
    python bench/gpu_check.py --stage data      # Swin-T from 2000 real 400-px JPEGs, eager and jax,
                                                #   decoded on the GPU and by CPU workers
    python bench/gpu_check.py --smoke           # every stage on CPU with the micro models

Runs from the source tree as the machine has it, with no install step: wheels it lacks (torchax)
are read from the ignored `.whl/` folder (docs/benchmarks.md, "Checking a GPU machine"). It
prints the versions it finds and names each missing piece in one line first. Every stage appends
to one results file, bench/results/gpu-check-<device>.json (or under --results DIR), with a
Markdown twin; the file holds the device, driver and versions, and the ratios computed in the
same run. A stage that runs past its budget, or past what is left of --total, is stopped: what
it has is written, and the part that did not finish is named. Every process shares one compile
cache (ACCEL_COMPILE_CACHE), so the profile's step reuses what the bench's jax run compiled.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import math
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
STAGES = ("profile", "remat", "bench", "tests", "decode", "attention", "data")
# What a plain run does, the first first (where the step's time goes); the rest by name.
EVERY = STAGES[:4]
STAGE_BUDGET_S = {"profile": 240, "remat": 150, "bench": 330, "tests": 150, "decode": 60,
                  "attention": 90, "data": 480}  # fmt: skip
SMOKE_BUDGET_S = {"profile": 60, "remat": 60, "bench": 45, "tests": 20, "decode": 10,
                  "attention": 15, "data": 25}  # fmt: skip
TOTAL_S = 560  # one device command of at most 10 minutes, with the machine's start beside it
BENCH_MODELS = "swin_tiny_patch4_window7_224,vit_base_patch16_224"
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
    env.setdefault("ACCEL_COMPILE_CACHE", str(Path(tempfile.gettempdir()) / "gpu-check-cache"))
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
def stage_tests(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """The GPU tier: each test passes on CUDA, or is skipped with its reason elsewhere."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider"]
    if not smoke and importlib.util.find_spec("xdist"):
        # 6 pytest-xdist workers share the card: none takes most of its memory
        cmd += ["-n", "6"]
        env = {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    code, output = run([*cmd, "tests/gpu"], budget, env, "pytest -m gpu")
    failures = re.findall(r"^(?:FAILED|ERROR) (.*)$", output, re.MULTILINE)
    counts = {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", output)
    }
    reasons = sorted(set(re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", output)))
    lines = [f"{k}: {v}" for k, v in counts.items()] + [f"skipped because: {r}" for r in reasons]
    lines += [f"failed: {f[:400]}" for f in failures]
    if code is None:
        lines.append("unfinished: pytest -m gpu ran past the budget")
    return {"exit_code": code, "counts": counts, "lines": lines, "output_tail": output[-6000:]}


def stage_decode(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """The device's JPEG path against the CPU workers', split into the decode and the resize."""
    cmd = [sys.executable, "bench/jpeg_decode_diff.py"]
    cmd += ["--device", "cpu", "--sizes", "40"] if smoke else []
    code, output = run(cmd, budget, env, "jpeg_decode_diff")
    if code != 0:
        return {"lines": [f"unfinished: jpeg_decode_diff ({output.strip()[-300:]})"]}
    record = json.loads(output.strip().splitlines()[-1])
    lines = [
        f"{size}: {r['decoder']} decode {r['decode_mean_abs']:.2f} levels from PIL's (worst "
        f"image {r['decode_max_image_mean_abs']:.2f}); resize bilinear "
        f"{r['resize_bilinear_mean_abs']:.2f}, bicubic {r['resize_bicubic_mean_abs']:.2f}"
        for size, r in record.items()
        if size.endswith("px")
    ]
    return {**record, "lines": lines}


def stage_attention(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """jax's attention per shape (bench/attention_shapes.py): XLA's ops against cuDNN."""
    tag = "gpu-check-attention"
    cmd = [sys.executable, "bench/attention_shapes.py", "--tag", tag]
    if smoke:
        cmd += ["--models", "vit_base_patch32_224", "--batch_size", "1", "--iters", "1"]
    code, output = run(cmd, budget, env, "attention_shapes")
    written = ROOT / "bench" / "results" / f"{tag}.json"
    if not written.is_file():
        return {"lines": [f"unfinished: attention_shapes ({output.strip()[-300:]})"]}
    record = json.loads(written.read_text())
    written.unlink()  # folded into this stage's record
    lines = [
        f"{r['model']} {r['name']} ({r['sequences']} x {r['tokens']} tokens, {r['heads']} heads,"
        f" bias {r['bias']}): xla {_ms(r['xla'])}, cudnn {_ms(r['cudnn'])}"
        for r in record["results"]
    ]
    lines += [
        f"{model}: a step's attention xla {t['xla']:.1f} ms, cudnn {t['cudnn']:.1f} ms"
        for model, t in record["per_step_ms"].items()
    ]
    if code is None:
        lines.append("unfinished: attention_shapes ran past the budget")
    return {"rows": record["results"], "per_step_ms": record["per_step_ms"], "lines": lines}


def _ms(result: dict) -> str:
    if "error" in result:
        return f"failed ({result['error'][:120]})"
    ran = f" ran {result['ran']}" + (f", refused: {result['refused']}" if result["refused"] else "")
    return f"{result['train_ms']:.2f} ms{ran}"


def fed_steps(smoke: bool, env: dict, budget: Budget, runs: list[tuple], top: int) -> dict:
    """bench/fed_step.py for each (model, backend, remat): a batch on the device stepped again
    and again; its img/s and peak memory, and with `top` the device's top ops over 5 steps.
    Every process shares the compile caches: the bench stage's launches reuse these programs."""
    rows, lines = [], []
    batch, amp = ("8", "O0") if smoke else ("128", "O1")
    # --smoke checks the harness, not the numbers: one step to warm up, two timed
    steps, warmup = ("2", "1") if smoke else ("20", "3")
    for model, backend, remat in runs:
        out = Path(tempfile.mkdtemp()) / "fed.json"
        cmd = [sys.executable, "bench/fed_step.py", "--backend", backend, "--model", model,
               "--batch_size", batch, "--amp_level", amp, "--steps", steps, "--warmup", warmup,
               "--remat", remat, "--profile", str(top), "--profile_out", str(out)]  # fmt: skip
        code, output = run(cmd, budget, env, f"fed_step {model} {backend} remat {remat}")
        if code != 0 or not out.is_file():
            lines.append(f"unfinished: {model} {backend} remat {remat} ({output.strip()[-300:]})")
            if code is None:
                break  # out of time: the rest would be too
            continue
        record = {**json.loads(out.read_text()), "remat": remat, "batch_size": int(batch)}
        rows.append(record)
        peak = record.get("peak_memory_bytes")
        lines.append(
            f"{model} {backend} remat {remat} fed step: {record['fed_images_per_sec']:.0f} img/s"
            + (f", peak {peak / 2**30:.1f} GiB" if peak else "")
        )
        for name, line in record.get("profile", {}).items():
            lines.append(f"  {name}: {line['ms_per_step']:.2f} ms a step")
            kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in line.get("by_kind", {}).items())
            lines += [f"    by kind (ms): {kinds}"] if kinds else []
            lines += [f"    {op['ms_per_step']:.3f} ms {op['name'][:100]}" for op in line["top"]]
    return {"rows": rows, "lines": lines}


def stage_profile(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """Where the step's time goes: Swin-T's and ViT-B/16's fed steps on jax and compile, each
    with its device's top ops (jax.profiler; torch's profiler for compile)."""
    if smoke:  # the harness, each profiler once: eager's compiles nothing
        runs = [("swin_micro", "jax", "none"), ("swin_micro", "eager", "none")]
    else:
        runs = [(m, b, "none") for m in BENCH_MODELS.split(",") for b in ("jax", "compile")]
    return fed_steps(smoke, env, budget, runs, top=12)


def stage_remat(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """The jax steps with each block's activations recomputed (remat dots, full): img/s and
    peak memory beside the profile stage's remat none."""
    if smoke:
        runs = [("swin_micro", "jax", "dots")]
    else:
        runs = [(m, "jax", remat) for m in BENCH_MODELS.split(",") for remat in ("dots", "full")]
    return fed_steps(smoke, env, budget, runs, top=0)


def stage_bench(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """Each backend's loop (bench/compare_backends.py), each model's first backend the baseline;
    `--launches` of each job (a second shows what the compile caches save), `--fed` adds each
    backend's fed step (one more compile on compile and eager)."""
    if smoke:
        jobs = [("vit_micro", "eager,jax", "16", "1", "O0")]  # the harness, not the numbers
    else:
        jobs = [(BENCH_MODELS, args.backends, "128", str(args.launches), "O1")]
    rows, lines = [], []
    for models, backends, batch, launches, amp in jobs:
        tag = f"gpu-check-bench-{batch}"
        # --smoke's loops make their synthetic batches in process: the data stage starts workers
        cmd = [sys.executable, "bench/compare_backends.py", "--models", models, "--backends",
               backends, "--batch_size", batch, "--launches", launches, "--amp_level", amp,
               "--tag", tag, "--steps", "3" if smoke else "30",
               "--warmup", "1" if smoke else "5", "--workers", "0" if smoke else "12",
               *(["--fed"] if smoke or args.fed else [])]  # fmt: skip
        code, _ = run(cmd, budget, env, f"bench batch {batch}")
        written = ROOT / "bench" / "results" / f"{tag}.json"
        if written.is_file():  # every row it finished, also when cut short
            results = json.loads(written.read_text())["results"]
            rows += [{**r, "batch_size": int(batch)} for r in results]
            written.unlink()  # folded into this stage's record
        if code is None or code != 0:
            lines.append(f"unfinished: {models} on {backends} at batch {batch}")
            break
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


def stage_data(smoke: bool, env: dict, budget: Budget, args: argparse.Namespace) -> dict:
    """A JPEG folder decoded on the GPU (nvJPEG) and by CPU workers, on eager and jax."""
    sys.path.insert(0, str(ROOT))
    from accel.cli.data.prepare import prepare_mock_imagenet
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
                         "--data_device", where, "--steps", "3" if smoke else "40",
                         "--batch_size", "8" if smoke else "128", "--amp_level",
                         "O0" if smoke else "O1", "--workers", "2" if smoke else "14",
                         "--mixup", "0.8", "--cutmix", "1.0", "--no-eval", "--no-save"]  # fmt: skip
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


RUNNERS = {
    "profile": stage_profile,
    "remat": stage_remat,
    "bench": stage_bench,
    "tests": stage_tests,
    "decode": stage_decode,
    "attention": stage_attention,
    "data": stage_data,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="all", help=f"comma-separated, of {', '.join(STAGES)}; "
                   f"all: {', '.join(EVERY)}")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="on CPU, micro models, under 2 minutes")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="folder")
    p.add_argument("--budget", type=float, help="seconds per stage (default: each stage's own)")
    p.add_argument("--total", type=float, help=f"seconds for every stage (default {TOTAL_S}; "
                   "none with --smoke)")  # fmt: skip
    p.add_argument("--launches", type=int, default=1, help="launches of each bench job")
    p.add_argument("--backends", default="compile,jax", help="the bench stage's backends")
    p.add_argument("--fed", action="store_true", help="the bench stage times fed steps too")
    args = p.parse_args(argv)
    every = STAGES if args.smoke else EVERY  # the smoke run tries every stage's harness
    stages = every if args.stage == "all" else tuple(args.stage.split(","))
    if unknown := [s for s in stages if s not in STAGES]:
        p.error(f"no stage {', '.join(unknown)}: the stages are {', '.join(STAGES)}")
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
    total = Budget(args.total or (math.inf if args.smoke else TOTAL_S))
    for stage in stages:
        seconds = args.budget or (SMOKE_BUDGET_S if args.smoke else STAGE_BUDGET_S)[stage]
        if total.left() < 5:
            results.add(stage, {"lines": ["unfinished: no time left of --total"]})
            continue
        started = time.monotonic()
        result = RUNNERS[stage](args.smoke, env, Budget(min(seconds, total.left())), args)
        results.add(stage, {**result, "seconds": round(time.monotonic() - started, 1)})
        print(f"gpu_check: {stage}\n  " + "\n  ".join(result["lines"]), flush=True)
    print(f"gpu_check: results in {results.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
