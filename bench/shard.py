"""Benchmark: what --shard saves per rank, and what it costs a step.

Each job is a launch_single_task run (eager by default) on synthetic data at 1, 2 and 4
processes, replicated (--shard none) and sharded (--shard full). Reported per job: the bytes one
rank holds of weights, gradients and AdamW state (measured from the tensors by the run), the step
time, and peak device memory where the backend reads one (CUDA). Written to
bench/results/<tag>.json with the device and versions.

    python bench/shard.py --models vit_micro,vit_small_patch16_224 --img_size 64 --procs 1,2,4
    python bench/shard.py --models vit_large_patch16_224 --batch_size 32 --amp_level O1 \\
        --procs 8 --shards none,full --tag h100x8-vitl  # on a GPU host
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import launch_summary, write_result  # noqa: E402


def run_job(model: str, procs: int, shard: str, args: argparse.Namespace, out: Path) -> dict:
    flags = [
        *("--backend", args.backend, "--model", model),
        *("--nproc_per_node", str(procs), "--shard", shard),
        *("--batch_size", str(args.batch_size), "--steps", str(args.steps)),
        *("--amp_level", args.amp_level, "--workers", "0", "--no-eval"),
        *("--log_every", str(args.steps)),
        *(("--img_size", str(args.img_size)) if args.img_size else ()),
    ]
    summary = launch_summary(flags, out, f"{model}-{procs}-{shard}")
    row = {"model": model, "procs": procs, "shard": shard}
    if summary is None:
        return {**row, "error": True}
    state = summary["state_bytes"]
    return {
        **row,
        "state_bytes_per_rank": state,
        "state_mib_per_rank": sum(state.values()) / 2**20,
        "step_ms": 1000 * summary["global_batch_size"] / summary["images_per_sec"],
        "images_per_sec": summary["images_per_sec"],
        "peak_memory_bytes": summary.get("peak_memory_bytes"),
        "peak_host_mib": [round(b / 2**20) for b in summary["peak_host_bytes"]],
    }


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<26}{'procs':>6}{'shard':>7}{'state MiB/rank':>16}"
    print(f"\n{head}{'x none':>8}{'step ms':>9}")
    replicated = {(r["model"], r["procs"]): r for r in rows if r["shard"] == "none"}
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<26}{r['procs']:>6}{r['shard']:>7}  failed")
            continue
        base = replicated.get((r["model"], r["procs"]), r)
        ratio = r["state_mib_per_rank"] / base.get("state_mib_per_rank", float("nan"))
        r["state_vs_none"] = ratio
        print(
            f"{r['model']:<26}{r['procs']:>6}{r['shard']:>7}{r['state_mib_per_rank']:>16.2f}"
            f"{ratio:>8.2f}{r['step_ms']:>9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="vit_micro,vit_small_patch16_224")
    p.add_argument("--img_size", type=int, default=64, help="input side (0: the model's own)")
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--shards", default="none,full")
    p.add_argument("--backend", default="eager")
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--amp_level", default="O0")
    p.add_argument("--tag", default="cpu-shard")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for procs in (int(n) for n in args.procs.split(",")):
                for shard in args.shards.split(","):
                    rows.append(run_job(model, procs, shard, args, Path(tmp)))
                    print(rows[-1], flush=True)
    print_table(rows)
    note = "one run each; step_ms: global batch / steady img/s (warm-up steps excluded)"
    write_result(args.tag, {"settings": vars(args), "note": note, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
