"""Benchmark: what XLA will run for the jax backend's training step, read from the compiled
program without running it.

The model goes through `accel.prepare(model, optimizer, loss_fn, backend="jax", ...)` as the
command line's job would: a timm model behind uint8 normalisation (1000 classes), AdamW with
weight decay on the weights (not on norms and biases), clipping at 1.0, the soft-target loss.
The engine's step is lowered for one batch of uint8 images and its soft targets (`.lower()`),
then compiled (`.compile()`); nothing runs. Reported:

- HLO ops by kind before XLA's passes (what the backend hands XLA: its matmuls, with their dtypes
  and flops per image) and after them (what the compiled program runs: fusions, dots,
  convolutions, custom calls, copies, transposes, ..., and what the fusions hold);
- the attention: which modules call scaled_dot_product_attention, and per shape what
  `--attention` chose and what ran. cuDNN cannot run on a CPU: there every shape runs on XLA,
  and the record says what a GPU would have taken and the tokens the cuDNN path pads to;
- XLA's cost analysis: flops, bytes accessed and transcendentals per image, before and after its
  passes.

After XLA's passes the figures are the platform's own (a CPU computes bf16 matmuls in fp32 and
fuses differently from a GPU): compare runs made on one platform. Swin-T at batch 8 takes about
40 s on a 2-core CPU (lowering a few seconds, XLA's compile the rest); the batch only scales
the per-image figures' denominator.

`--tree PATH` lowers the step of another checkout (`git worktree add PATH COMMIT`); a tree from
before `accel.prepare` existed (638c545) builds its backend as its own command line did
(`early_step`). `--record TAG --early PATH` runs Swin-T and ViT-B/16 on this tree and on PATH,
each in a process of its own, and writes bench/results/TAG.json with the device and versions.

    python bench/step_anatomy.py --model swin_tiny_patch4_window7_224
    python bench/step_anatomy.py --model vit_base_patch16_224 --attention xla --out vitb.json
    git worktree add /tmp/accel-early 638c545
    python bench/step_anatomy.py --model swin_tiny_patch4_window7_224 --tree /tmp/accel-early
    python bench/step_anatomy.py --record cpu-step-anatomy --early /tmp/accel-early
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import device_name, versions, write_result  # noqa: E402

MODELS = ("swin_tiny_patch4_window7_224", "vit_base_patch16_224")
# Instructions that move no data and run nothing (left out of the counts of what runs).
BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
SHARDING_MARKERS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
SHOWN = ("fusion", "dot", "convolution", "custom-call", "transpose", "copy", "gather", "scatter")


# --- the step, lowered ------------------------------------------------------------------------
def soft_targets(batch: int, classes: int):
    import torch

    return torch.full((batch, classes), 1.0 / classes)


def main_step(args: argparse.Namespace):
    """This tree's public API: accel.prepare, then the engine's compiled step lowered."""
    import torch

    import accel
    from accel.cli.models.factory import ModelConfig, create_model
    from accel.cli.task import classifier_loss

    model = create_model(ModelConfig(name=args.model, num_classes=args.num_classes))
    weights = [p for p in model.parameters() if p.ndim > 1]
    others = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": weights, "weight_decay": 0.05}, {"params": others, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    engine = accel.prepare(
        model,
        optimizer,
        classifier_loss,
        backend=args.backend,
        amp=args.amp_level,
        clip_grad=1.0,
        attention=args.attention,
        quiet=True,
    )
    images = torch.zeros(args.batch_size, *model.input_size, dtype=torch.uint8)
    started = time.perf_counter()
    lowered = engine.lowered_step(images, soft_targets(args.batch_size, args.num_classes))
    lower_s = time.perf_counter() - started
    details = engine.stats().details
    attention = {
        "choice": details["attention_choice"],
        "shapes": details["attention_shapes"],
    }
    return model, lowered, lower_s, attention


def early_step(args: argparse.Namespace):
    """638c545's jax backend, built as its command line built it (RunConfig, then
    JaxRunner.setup(model)); its step takes (params, opt_state, buffers, images, targets, lr).
    One adaptation: its AMP dtype was torch's bfloat16, which this jax no longer takes in
    astype, so the policy is given jnp's. Its attention has no choice: torch's SDPA runs through
    torchax's own lowering (its --kernel-opt off, as in its GPU figures)."""
    import jax.numpy as jnp
    from models.factory import ModelConfig, create_model

    from accel.backends import jax as backend
    from accel.config import RunConfig
    from accel.distributed import DistContext

    cfg = RunConfig(
        backend="jax",
        model=ModelConfig(name=args.model, num_classes=args.num_classes),
        amp_level=args.amp_level,
        batch_size=args.batch_size,
        compile_cache=tempfile.mkdtemp(prefix="accel-early-cache-"),
    )
    runner = backend.JaxRunner(cfg, DistContext())
    runner.amp = dataclasses.replace(runner.amp, dtype=jnp.bfloat16)
    model = create_model(cfg.model)
    runner.setup(model)
    shape = (1, args.batch_size)
    images = jnp.zeros((*shape, *model.input_size), jnp.uint8)
    targets = jnp.asarray(soft_targets(args.batch_size, args.num_classes).numpy())[None]
    step_args = (runner.params, runner.opt_state, runner.buffers, images, targets)
    started = time.perf_counter()
    with backend.attention_override(runner.env, cfg.kernel_opt):
        lowered = runner.step_fn.lower(*step_args, jnp.float32(1e-3))
    lower_s = time.perf_counter() - started
    attention = {"choice": None, "path": "torchax's own scaled_dot_product_attention lowering"}
    return model, lowered, lower_s, attention


# --- reading HLO text -------------------------------------------------------------------------
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
ARRAY = re.compile(r"^([a-z]\w*)\[([\d,]*)\]")


@dataclasses.dataclass
class Op:
    name: str
    type: str
    opcode: str
    rest: str  # operands and attributes

    @property
    def dtype(self) -> str:
        found = ARRAY.match(self.type)
        return found.group(1) if found else "tuple"

    @property
    def dims(self) -> list[int]:
        found = ARRAY.match(self.type)
        return [int(d) for d in found.group(2).split(",") if d] if found else []

    def attribute(self, key: str) -> str | None:
        found = re.search(rf"\b{key}=(\{{[^}}]*\}}|[^,\s]+)", self.rest)
        return found.group(1) if found else None

    def operands(self) -> list[str]:
        inside, depth = [], 0
        for char in self.rest:
            if char == ")" and depth == 0:
                break
            depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(char, 0)
            inside.append(char)
        names = []
        for part in "".join(inside).split(","):
            part = part.strip().split(" ")[-1]  # "f32[2]{0} %x" (compiled) or "x" (lowered)
            if part:
                names.append(part.lstrip("%"))
        return names


def computations(text: str) -> dict[str, list[Op]]:
    """HLO text as {computation: its instructions}; the entry computation is 'ENTRY'."""
    found: dict[str, list[Op]] = {}
    current: list[Op] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and " = " not in stripped.split("(")[0]:
            head = stripped.split("(")[0].split()
            if head and head[0] != "HloModule":
                name = "ENTRY" if head[0] == "ENTRY" else head[0].lstrip("%")
                current = found.setdefault(name, [])
            continue
        if stripped == "}":
            current = None
            continue
        match = INSTRUCTION.match(line)
        if current is not None and match:
            current.append(Op(*match.groups()))
    return found


def executed(comps: dict[str, list[Op]]) -> tuple[list[Op], list[Op]]:
    """(instructions the program runs, instructions inside fusions): fusion bodies and the
    scalar functions of reductions and sorts are not run on their own."""
    fused, applied = set(), set()
    for ops in comps.values():
        for op in ops:
            if op.opcode == "fusion":
                fused.add((op.attribute("calls") or "").lstrip("%"))
            elif op.opcode != "call" and op.attribute("to_apply"):
                applied.add((op.attribute("to_apply") or "").lstrip("%"))
    run = [op for name, ops in comps.items() if name not in fused | applied for op in ops]
    inside = [op for name in fused for op in comps.get(name, [])]
    return run, inside


def dot_flops(op: Op, types: dict[str, Op]) -> int:
    lhs = types.get(op.operands()[0])
    contracting = op.attribute("lhs_contracting_dims") or "{}"
    dims = [int(d) for d in contracting.strip("{}").split(",") if d]
    if lhs is None:
        return 0
    return 2 * math.prod(op.dims) * math.prod(lhs.dims[d] for d in dims)


def matmuls(ops: list[Op], batch: int) -> dict[str, dict]:
    """Dots by 'lhs x rhs -> out' dtypes: how many, and their flops per image."""
    types = {op.name: op for op in ops}
    out: dict[str, dict] = {}
    for op in ops:
        if op.opcode != "dot":
            continue
        sides = [types[n].dtype if n in types else "?" for n in op.operands()[:2]]
        key = f"{' x '.join(sides)} -> {op.dtype}"
        row = out.setdefault(key, {"count": 0, "gflops_per_image": 0.0})
        row["count"] += 1
        row["gflops_per_image"] += dot_flops(op, types) / batch / 1e9
    return {k: {**v, "gflops_per_image": round(v["gflops_per_image"], 3)} for k, v in out.items()}


def target(op: Op) -> str:
    return (op.attribute("custom_call_target") or "?").strip('"')


def marker(op: Op) -> bool:
    """A custom call that only annotates shardings (shard_map's, Shardy's): no kernel."""
    name = target(op)
    return op.opcode == "custom-call" and (name in SHARDING_MARKERS or name.startswith("xla.sdy."))


def custom_calls(ops: list[Op]) -> dict[str, int]:
    found = Counter(target(op) for op in ops if op.opcode == "custom-call" and not marker(op))
    return dict(found)


def by_kind(ops: list[Op]) -> dict[str, int]:
    counts = Counter(op.opcode for op in ops if op.opcode not in BOOKKEEPING and not marker(op))
    return dict(counts.most_common())


def costs(analysis, batch: int) -> dict[str, float]:
    analysis = analysis[0] if isinstance(analysis, list | tuple) else analysis
    keys = {"flops": "gflops", "bytes accessed": "gbytes_accessed", "transcendentals": "gtrans"}
    return {
        f"{short}_per_image": round(analysis[key] / batch / 1e9, 4)
        for key, short in keys.items()
        if key in (analysis or {})
    }


# --- one run ----------------------------------------------------------------------------------
def tree_facts(tree: Path) -> dict:
    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *argv], capture_output=True, text=True)
        return done.stdout

    status = git("status", "--porcelain", "--", "accel").splitlines()
    changed = [line[3:] for line in status]  # "XY path"
    return {
        "path": str(tree),
        "commit": git("rev-parse", "HEAD").strip(),
        "uncommitted_in_accel": changed,
    }


def anatomy(args: argparse.Namespace) -> dict:
    import jax

    # Compile afresh (a program from the persistent cache would say nothing of XLA's time).
    jax.config.update("jax_enable_compilation_cache", False)
    import accel

    early = not hasattr(accel, "prepare")
    if early and args.attention != "auto":
        raise SystemExit("--attention: the tree at --tree has no choice of attention")
    model, lowered, lower_s, attention = (early_step if early else main_step)(args)
    attention["modules_through_sdpa"] = sum(
        getattr(m, "fused_attn", None) is True for m in model.modules()
    )
    attention["attention_modules"] = sum(hasattr(m, "fused_attn") for m in model.modules())
    started = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    before = [op for ops in computations(lowered.as_text(dialect="hlo")).values() for op in ops]
    run, fused = executed(computations(compiled.as_text()))
    batch = args.batch_size
    return {
        "model": args.model,
        "backend": args.backend,
        "batch_size": batch,
        "amp_level": args.amp_level,
        "tree": tree_facts(args.tree),
        "api": "638c545's JaxRunner" if early else "accel.prepare",
        "platform": jax.devices()[0].platform,
        "lower_s": round(lower_s, 1),
        "compile_s": round(compile_s, 1),
        "attention": attention,
        "before_passes": {
            "ops": by_kind(before),
            "matmuls": matmuls(before, batch),
            "custom_calls": custom_calls(before),
            "cost": costs(lowered.cost_analysis(), batch),
        },
        "compiled": {
            "ops_run": by_kind(run),
            "ops_in_fusions": by_kind(fused),
            "custom_calls": custom_calls(run + fused),
            "cost": costs(compiled.cost_analysis(), batch),
        },
    }


def show(record: dict) -> None:
    before, after = record["before_passes"], record["compiled"]
    tree = record["tree"]
    print(f"\n{record['model']} on {record['backend']}, batch {record['batch_size']}, ", end="")
    print(f"{record['amp_level']}, tree {tree['commit'][:7]} ({record['api']})")
    print(f"lowered in {record['lower_s']} s, compiled in {record['compile_s']} s")
    att = record["attention"]
    print(f"attention modules through SDPA: {att['modules_through_sdpa']} of ", end="")
    print(f"{att['attention_modules']}; choice: {att.get('choice') or att.get('path')}")
    for shape, row in att.get("shapes", {}).items():
        print(f"  {row['calls']:>3} x {shape}: chose {row['chose']}, ran {row['ran']} ", end="")
        print(f"(cuDNN would pad {row['tokens']} to {row['cudnn_padded_tokens']} tokens)")
    print("before XLA's passes:", before["cost"])
    print("  ops:", ", ".join(f"{k} {v}" for k, v in list(before["ops"].items())[:12]))
    for key, row in before["matmuls"].items():
        print(f"  dot {key}: {row['count']} ops, {row['gflops_per_image']} GFLOP/image")
    print("compiled:", after["cost"])
    ran, inside = after["ops_run"], after["ops_in_fusions"]
    print("  ops run:", ", ".join(f"{k} {ran.get(k, 0)}" for k in SHOWN), end="")
    print(f"; all {sum(ran.values())}")
    print("  in fusions:", ", ".join(f"{k} {inside.get(k, 0)}" for k in SHOWN if k != "fusion"))
    print("  custom calls:", after["custom_calls"] or "none")


# --- the recorded comparison -----------------------------------------------------------------
def record_all(args: argparse.Namespace) -> int:
    if not args.early:
        raise SystemExit("--record needs --early PATH (git worktree add PATH 638c545)")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for tree in (ROOT, Path(args.early).resolve()):
            for model in MODELS:
                out = Path(scratch) / f"{len(runs)}.json"
                argv = [sys.executable, __file__, "--model", model, "--tree", str(tree)]
                argv += ["--batch_size", str(args.batch_size), "--amp_level", args.amp_level]
                done = subprocess.run([*argv, "--out", str(out)], cwd=ROOT)
                if done.returncode != 0:
                    return done.returncode
                runs.append(json.loads(out.read_text()))
    write_result(
        args.record, {"kind": "step anatomy (lowered and compiled, not run)", "runs": runs}
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=MODELS[0], help="a timm name, or vit_micro / swin_micro")
    p.add_argument("--backend", default="jax", choices=("jax",))
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--amp_level", default="O1", choices=("O0", "O1", "O2", "O3"))
    p.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"))
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose accel is lowered")
    p.add_argument("--out", type=Path, help="write the record here (JSON)")
    p.add_argument("--record", metavar="TAG", help="the four runs into bench/results/TAG.json")
    p.add_argument("--early", help="with --record: the early tree (a worktree of 638c545)")
    args = p.parse_args(argv)
    if args.record:
        return record_all(args)
    args.tree = args.tree.resolve()
    sys.path.insert(0, str(args.tree))  # before accel is first imported
    record = {"device": device_name(), "versions": versions(), **anatomy(args)}
    show(record)
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
