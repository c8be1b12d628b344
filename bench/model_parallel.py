"""Benchmark: splitting the model itself, on synthetic data through launch_single_task.

- Tensor-parallel classifier: a ViT of width 192 with a 1,000,000-class head at `--tp_head` 1, 2
  and 4; per rank, the bytes of the classifier's weights, gradients and AdamW state (measured
  from the tensors by the run) and the step time.
- Pipeline: `--pp 2` with the GPipe, 1F1B and interleaved schedules at 4 and 8 micro-batches;
  the step time shows each schedule's bubble (and, on CPU processes, its messages).

Written to bench/results/<tag>.json with the device and versions.

    python bench/model_parallel.py
    python bench/model_parallel.py --pp_model vit_large_patch16_224 --pp_img_size 0 \\
        --pp_batch 64 --tag h100x2-pipeline   # on a GPU host
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import launch_summary, write_result  # noqa: E402


def step_ms(summary: dict) -> float:
    return 1000 * summary["global_batch_size"] / summary["images_per_sec"]


def tp_rows(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for tp in (int(n) for n in args.tp.split(",")):
        flags = [
            *("--model", args.tp_model, "--img_size", str(args.tp_img_size)),
            *("--num_classes", str(args.classes), "--batch_size", str(args.tp_batch)),
            *("--steps", str(args.steps), "--workers", "0", "--no-eval"),
            *("--nproc_per_node", str(tp), "--tp_head", str(tp), "--log_every", str(args.steps)),
        ]
        summary = launch_summary(flags, out, f"tp{tp}")
        row = {"tp_head": tp, "classes": args.classes}
        if summary is not None:
            row["classifier_mib_per_rank"] = summary["state_bytes"]["classifier"] / 2**20
            row["step_ms"] = step_ms(summary)
        rows.append(row)
        print(row, flush=True)
    return rows


def pp_rows(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for micro in (int(n) for n in args.microbatches.split(",")):
        for schedule in ("gpipe", "1f1b", "interleaved"):
            flags = [
                *("--model", args.pp_model, "--batch_size", str(args.pp_batch)),
                *("--steps", str(args.steps), "--workers", "0", "--no-eval"),
                *("--nproc_per_node", "2", "--pp", "2", "--pp_schedule", schedule),
                *("--pp_microbatches", str(micro), "--log_every", str(args.steps)),
                *(("--img_size", str(args.pp_img_size)) if args.pp_img_size else ()),
            ]
            summary = launch_summary(flags, out, f"pp-{schedule}-{micro}")
            row = {"schedule": schedule, "microbatches": micro}
            if summary is not None:
                row["step_ms"] = step_ms(summary)
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp_model", default="vit_tiny_patch16_224", help="width 192")
    p.add_argument("--tp_img_size", type=int, default=32)
    p.add_argument("--classes", type=int, default=1_000_000)
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--tp_batch", type=int, default=8)
    p.add_argument("--pp_model", default="vit_small_patch16_224")
    p.add_argument("--pp_img_size", type=int, default=64, help="0: the model's own")
    p.add_argument("--pp_batch", type=int, default=16)
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tag", default="cpu-model-parallel")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tp = tp_rows(args, Path(tmp) / "tp")
        pp = pp_rows(args, Path(tmp) / "pp")
    note = "one run each; step_ms: global batch / steady img/s (warm-up steps excluded)"
    write_result(args.tag, {"settings": vars(args), "note": note, "tp_head": tp, "pipeline": pp})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
