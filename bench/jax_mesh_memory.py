"""Benchmark: each device's share of the training state on the jax backend's mesh.

A timm ViT (ViT-L/16 at 32 px; ViT-H/14 at 28 px where the host's memory allows) goes through
`accel.prepare(..., backend="jax")` with AdamW and no EMA at five layouts over 4 CPU devices
(XLA's forced host devices): one device; data 4 (replicated); fsdp 4 (shard="full"); data 2 x
model 2 (tp=2); fsdp 2 x model 2 (tp=2, shard="full"). Each layout runs in a process of its
own and takes two training steps on the same seeded model and batch. Reported per layout: the
bytes of weights and AdamW moments one device holds (`engine.stats().state_bytes`, read from
the arrays' shardings) and their ratio to the whole state (fp32 weights x 3, from the parameter
shapes), the loss of step 1 (equal across layouts up to fp32 reduction order), the second
step's time and the process's peak resident memory. The 4 devices share one host, so a
replicated layout holds the state 4 times over, and each device gathers weights and computes
gradients in the step: against the host memory /proc/meminfo reports available (waiting up to
`--wait_s` for it), a layout whose state would not fit is skipped with a note, one whose step
would not fit reports its share after prepare without steps, and one the kernel kills in its
step keeps the share it reported. Written to bench/results/<tag>.json with the device and
versions.

    python bench/jax_mesh_memory.py
    python bench/jax_mesh_memory.py --models vit_large_patch16_224:32 --tag cpu-jax-mesh-vitl
"""

from __future__ import annotations

import os

# XLA reads its flags once, when jax first loads: the forced device count must come first.
FORCE = "--xla_force_host_platform_device_count=4"
if FORCE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FORCE}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import write_result  # noqa: E402

# layout: (devices, tp, shard, how many whole copies of the state the 4 devices hold together)
LAYOUTS: dict[str, tuple[int, int, str, int]] = {
    "one device": (1, 1, "none", 1),
    "data 4": (4, 1, "none", 4),
    "fsdp 4": (4, 1, "full", 1),
    "data 2 x model 2": (4, 2, "none", 2),
    "fsdp 2 x model 2": (4, 2, "full", 1),
}
GIB = 2**30


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def available_bytes() -> int:
    return meminfo("MemAvailable")


def total_bytes() -> int:
    return meminfo("MemTotal")


def param_bytes(model_name: str, img_size: int) -> int:
    """fp32 bytes of the model's weights, from its shapes alone (built on the meta device)."""
    import timm
    import torch

    with torch.device("meta"):
        model = timm.create_model(model_name, img_size=img_size, num_classes=10)
    return 4 * sum(p.numel() for p in model.parameters())


def state_need(weights: int, copies: int) -> int:
    """Host memory a layout needs to hold its state after prepare, estimated: the torch model
    the child builds, the copies of the weights and two AdamW moments the 4 devices hold
    together, and the libraries."""
    return weights * (1 + 3 * copies) + 2 * GIB


def step_need(weights: int, devices: int, tp: int, copies: int) -> int:
    """Host memory of a layout's step, estimated: its state, the gradients and update, and what
    the devices gather for the step (their 1/tp part of the weights each), with XLA's compile
    and temporaries. Fitted to ViT-L/16 at 32 px, whose peaks were: one device 10.3-11.4 GiB (a
    cold compile the higher), fsdp 4 15.6 GiB, fsdp 2 x model 2 13.5 GiB."""
    return weights * (5 + 6 * copies + 3 * devices // tp) // 2 + 7 * GIB // 2


def wait_for_memory(need: int, wait_s: float) -> int:
    """MemAvailable once it reaches `need`, or after `wait_s`: other work on the host comes
    and goes, and a layout started short of memory is killed part-way."""
    if need > total_bytes():  # it never will
        return available_bytes()
    deadline = time.monotonic() + wait_s
    while (free := available_bytes()) < need and time.monotonic() < deadline:
        time.sleep(10)
    return free


# --- one layout, in its own process ---------------------------------------------------------
def resident_mib() -> int:
    return round(
        int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    )


def report(**values) -> None:
    """One JSON line per phase on stdout: what a child got to survives its being killed."""
    print(json.dumps(values), flush=True)


def child(model_name: str, img_size: int, layout: str, batch: int, prepare_only: bool) -> None:
    import resource

    import timm
    import torch
    from torch import nn

    import accel

    devices, tp, shard, _ = LAYOUTS[layout]

    def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels)

    torch.manual_seed(0)  # the same starting weights at every layout
    model = timm.create_model(model_name, img_size=img_size, num_classes=10)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, img_size, img_size, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    engine = accel.prepare(
        model, optimizer, loss_fn, backend="jax", devices=devices, tp=tp, shard=shard, quiet=True
    )
    stats = engine.stats()  # the weights and moments are placed by prepare
    report(
        state_bytes=stats.state_bytes,
        mesh_devices=stats.devices,
        mesh_tp=stats.details.get("tp"),
        prepare_s=time.perf_counter() - started,
        rss_after_prepare_mib=resident_mib(),
    )
    if prepare_only:
        return
    started = time.perf_counter()
    first = engine.fetch([engine.step(images, labels)])[0]  # compiles the step
    report(loss_step1=float(first.loss), first_step_s=time.perf_counter() - started)
    started = time.perf_counter()
    second = engine.fetch([engine.step(images, labels)])[0]
    step_ms = 1000 * (time.perf_counter() - started)
    report(
        loss_step2=float(second.loss),
        step_ms=step_ms,
        state_bytes_after_steps=engine.stats().state_bytes,
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    )


def run_layout(model_name: str, img_size: int, layout: str, batch: int, prepare_only: bool) -> dict:
    argv = [sys.executable, __file__, "--child", layout, "--batch", str(batch)]
    argv += ["--models", f"{model_name}:{img_size}", *(["--prepare_only"] if prepare_only else [])]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    row: dict = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            row.update(json.loads(line))
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        killed = result.returncode == -9
        row["error"] = "killed (SIGKILL: host memory)" if killed else f"exit {result.returncode}"
        row["stderr_tail"] = result.stderr[-1000:]
    return row


def model_rows(model_name: str, img_size: int, args: argparse.Namespace) -> list[dict]:
    weights = param_bytes(model_name, img_size)
    whole = 3 * weights  # fp32 weights and AdamW's two moments
    rows: list[dict] = []
    one_total = None
    for layout in args.layouts.split(","):
        devices, tp, shard, copies = LAYOUTS[layout]
        row: dict = {"model": model_name, "img_size": img_size, "layout": layout}
        row.update(devices=devices, tp=tp, shard=shard, whole_state_mib=round(whole / 2**20, 1))
        state, step = state_need(weights, copies), step_need(weights, devices, tp, copies)
        # A step that can never fit is not waited for: its share is read after prepare.
        free = wait_for_memory(step if step <= total_bytes() else state, args.wait_s)
        row.update(
            est_state_gib=round(state / GIB, 2),
            est_step_gib=round(step / GIB, 2),
            available_gib=round(free / GIB, 2),
        )
        if state > free:
            row["skipped"] = (
                f"holding the state needs about {state / GIB:.1f} GiB of host memory (the 4 "
                f"devices hold {copies} whole copies), {free / GIB:.1f} GiB available"
            )
        else:
            prepare_only = step > free
            if prepare_only:
                row["steps_not_run"] = (
                    f"the step needs about {step / GIB:.1f} GiB of host memory, "
                    f"{free / GIB:.1f} GiB available of {total_bytes() / GIB:.1f} GiB"
                )
            row.update(run_layout(model_name, img_size, layout, args.batch, prepare_only))
        if "state_bytes" in row:
            share = sum(row["state_bytes"].values())
            row["share_mib"] = round(share / 2**20, 1)
            row["share_vs_whole"] = round(share / whole, 4)
            if layout == "one device":
                one_total = share
            if one_total:
                row["share_vs_one_device"] = round(share / one_total, 4)
        rows.append(row)
        print(row, flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<24}{'layout':<20}{'MiB/device':>11}{'x whole':>9}{'step ms':>9}  loss 1")
    for r in rows:
        head = f"{r['model']:<24}{r['layout']:<20}"
        if "share_mib" not in r:
            print(f"{head}  {r.get('skipped') or r.get('error')}")
            continue
        step = f"{r['step_ms']:>9.0f}" if "step_ms" in r else f"{'-':>9}"
        loss = repr(r["loss_step1"]) if "loss_step1" in r else r.get("error", "steps not run")
        print(f"{head}{r['share_mib']:>11.1f}{r['share_vs_whole']:>9.4f}{step}  {loss}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--models",
        default="vit_large_patch16_224:32,vit_huge_patch14_224:28",
        help="timm name:input side, comma-separated",
    )
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--wait_s", type=float, default=300, help="for host memory, per layout")
    p.add_argument("--tag", default="cpu-jax-mesh-memory")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one layout, from run_layout
    p.add_argument("--prepare_only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models = [(name, int(side)) for name, side in (m.split(":") for m in args.models.split(","))]
    if args.child:
        child(*models[0], args.child, args.batch, args.prepare_only)
        return 0
    rows = [row for name, side in models for row in model_rows(name, side, args)]
    print_table(rows)
    note = (
        "one run each, 4 XLA host devices on one CPU; share: params + AdamW moments one device "
        "holds (engine.stats().state_bytes, its shard of split arrays); share_vs_whole: that "
        "over 3 x the fp32 weights' bytes; step_ms: the second step, fetch included; "
        "loss_step1: the loss before any update (same seed and batch at every layout); "
        "peak_rss_mib: the layout's process; a layout is skipped where its estimated host "
        "memory exceeds MemAvailable"
    )
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "prepare_only")}
    write_result(args.tag, {"settings": settings, "note": note, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
