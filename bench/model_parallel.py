"""Benchmark: splitting the model itself, on synthetic data through launch_single_task.

- Tensor-parallel classifier: a width-384 ViT with a 1,000,000-class head at `--tp_head` 1, 2
  and 4: per rank, the bytes of the classifier's weights, gradients and AdamW state (read off
  the tensors by the run), the peak resident memory (and what the run added over the memory it
  had after its imports), and the step time.
- Pipeline: ViT-L/16 at 32 px in 1, 2 and 4 stages (1F1B, 8 micro-batches): each rank's peak
  resident memory and the step time.
- Composed (`--hybrid`): ViT-L/16 at 32 px on 4 processes at tp 2 x pp 2, tp 4, fsdp 2 x tp 2
  and pp 4, against one process: each rank's peak resident memory, what it grew by over its
  imports, the bytes of weights, gradients and AdamW state it holds, and the worst rank's ratio
  to the one process.

Written to bench/results/<tag>.json with the device and versions.

    python bench/model_parallel.py
    python bench/model_parallel.py --pp_img_size 0 --pp_batch 64 --tag h100x4-pipeline  # GPUs
    python bench/model_parallel.py --only hybrid --tag cpu-hybrid-parallel
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


def memory(summary: dict) -> dict:
    """Per rank: the peak resident memory, and what the run added over its post-import memory."""
    peaks, starts = summary["peak_host_bytes"], summary["host_bytes_at_start"]
    return {
        "peak_host_mib": [round(p / 2**20) for p in peaks],
        "grown_host_mib": [round((p - s) / 2**20) for p, s in zip(peaks, starts, strict=True)],
    }


def tp_rows(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for tp in (int(n) for n in args.tp.split(",")):
        flags = [
            *("--model", args.tp_model, "--num_classes", str(args.classes)),
            *("--batch_size", str(args.tp_batch), "--steps", str(args.steps), "--workers", "0"),
            *("--no-eval", "--nproc_per_node", str(tp), "--log_every", str(args.steps)),
            *(("--tp_head", str(tp)) if tp > 1 else ()),
        ]
        summary = launch_summary(flags, out, f"tp{tp}")
        row = {"tp_head": tp, "classes": args.classes}
        if summary is not None:
            row["classifier_mib_per_rank"] = summary["state_bytes"]["classifier"] / 2**20
            row.update(memory(summary), step_ms=step_ms(summary))
        rows.append(row)
        print(row, flush=True)
    return rows


def pp_rows(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for stages in (int(n) for n in args.stages.split(",")):
        flags = [
            *("--model", args.pp_model, "--batch_size", str(args.pp_batch)),
            *("--steps", str(args.steps), "--workers", "0", "--no-eval"),
            *("--nproc_per_node", str(stages), "--log_every", str(args.steps)),
            *("--synthetic_length", str(4 * args.pp_batch), "--num_classes", "10"),
            *(("--pp", str(stages), "--pp_microbatches", "8") if stages > 1 else ()),
            *(("--img_size", str(args.pp_img_size)) if args.pp_img_size else ()),
        ]
        summary = launch_summary(flags, out, f"pp{stages}")
        row = {"stages": stages, "schedule": "1f1b" if stages > 1 else "-"}
        if summary is not None:
            row.update(memory(summary), step_ms=step_ms(summary))
        rows.append(row)
        print(row, flush=True)
    return rows


FOUR = ("--nproc_per_node", "4")
HYBRID = {  # layout: (its options, the data groups the global batch is split over)
    "one process": ((), 1),
    "tp 2 x pp 2": ((*FOUR, "--tp", "2", "--pp", "2", "--pp_microbatches", "8"), 1),
    "tp 4": ((*FOUR, "--tp", "4"), 1),
    "fsdp 2 x tp 2": ((*FOUR, "--tp", "2", "--shard", "full"), 2),
    "pp 4": ((*FOUR, "--pp", "4", "--pp_microbatches", "8"), 1),
}


def hybrid_rows(args: argparse.Namespace, out: Path) -> list[dict]:
    """Each composed layout of ViT-L/16 on 4 processes against one process (same global
    batch): per rank, its peak memory and the training state it holds."""
    rows: list[dict] = []
    one: dict = {}
    for name, (extra, data) in HYBRID.items():
        flags = [
            *("--model", args.pp_model, "--batch_size", str(args.pp_batch // data)),
            *("--steps", str(args.steps), "--workers", "0", "--no-eval"),
            *("--log_every", str(args.steps), "--num_classes", "10"),
            *("--synthetic_length", str(4 * args.pp_batch)),
            *(("--img_size", str(args.pp_img_size)) if args.pp_img_size else ()),
            *extra,
        ]
        summary = launch_summary(flags, out, name.replace(" ", ""))
        row: dict = {"layout": name, "global_batch": args.pp_batch}
        if summary is not None:
            state = summary["state_bytes"]
            held = sum(state.get(k, 0) for k in ("params", "grads", "optimizer"))
            row.update(memory(summary), state_mib_rank0=round(held / 2**20))
            row["step_ms"] = step_ms(summary)
            if not extra:
                one = row
            elif one:
                row["worst_peak_vs_one"] = round(
                    max(row["peak_host_mib"]) / one["peak_host_mib"][0], 3
                )
                row["worst_grown_vs_one"] = round(
                    max(row["grown_host_mib"]) / one["grown_host_mib"][0], 3
                )
                row["state_vs_one"] = round(row["state_mib_rank0"] / one["state_mib_rank0"], 3)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp_model", default="vit_micro_wide", help="width 384, two blocks")
    p.add_argument("--classes", type=int, default=1_000_000)
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--tp_batch", type=int, default=2)
    p.add_argument("--pp_model", default="vit_large_patch16_224")
    p.add_argument("--pp_img_size", type=int, default=32, help="0: the model's own")
    p.add_argument("--pp_batch", type=int, default=16)
    p.add_argument("--stages", default="1,2,4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tag", default="cpu-model-parallel")
    p.add_argument("--only", choices=("all", "hybrid"), default="all")
    args = p.parse_args(argv)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only == "all":
            results["tp_head"] = tp_rows(args, Path(tmp) / "tp")
            results["pipeline"] = pp_rows(args, Path(tmp) / "pp")
        results["hybrid"] = hybrid_rows(args, Path(tmp) / "hybrid")
    note = (
        "one run each; step_ms: global batch / steady img/s (warm-up steps excluded); "
        "peak_host_mib: each rank's peak resident memory (construction, steps and the final "
        "checkpoint); grown_host_mib: that peak less the memory the rank had after its imports; "
        "state_mib_rank0: the weights, gradients and AdamW state rank 0 holds (its parts where "
        "split)"
    )
    write_result(args.tag, {"settings": vars(args), "note": note, **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
