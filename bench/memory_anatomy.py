"""Benchmark: what the jax backend's training step holds in memory, read from XLA's own analysis
of the compiled program (lowered and compiled, never run), beside a plain Flax ViT-B/16 step.

The step is `accel.prepare(model, AdamW(wd 0.05), soft-target loss, backend="jax", amp="O1",
clip_grad=1.0, attention="xla", remat=...)` over a timm model that takes uint8 NCHW images and
scales them by 1/255 in the compute dtype, Swin's window attention through
scaled_dot_product_attention as the command line's models have it; its
`engine.lowered_step(images, targets)` is compiled for this machine. The Flax step (written
here: timm's ViT-B/16 in flax.linen, bf16 compute with fp32 params, jax.nn.dot_product_attention,
optax clip_by_global_norm(1.0) + adamw(wd 0.05), the same uint8 NHWC images / 255 and soft
targets) is compiled the same way. Reported per program:

- XLA's memory analysis: arguments, outputs, aliased (outputs written into donated arguments),
  temporaries, and temporaries per image;
- the matmuls before XLA's passes, by operand and result dtypes;
- XLA's buffer assignment at the peak of its live ranges (the dump's live-range report): bytes by
  kind (fp32 matmul operands, fp32 copies of bf16 values, activations by dtype, attention scores,
  attention bias/mask, weight-sized values) and the largest buffers, with the instruction that
  made them (its op_name and source line);
- `--record`: ViT-B/16 and Swin-T under each remat choice, and the Flax step, each in its own
  process, into bench/results/TAG.json, with the ViT-B/16 step set against Flax's buffer by
  buffer (shapes compared with their axes sorted, as the two lay out [B, heads, T, D] apart).

XLA's dump is read, so XLA_FLAGS must be set before jax is imported: each run sets it itself
(`--xla_dump_to`), with `--xla_cpu_enable_concurrency_optimized_scheduler=false`: the CPU's
default schedule trades memory for parallelism and runs every recomputed block in the forward,
so that remat saves nothing (in Flax as in accel; ViT-B/16 temporaries 8.0 GB against 5.6 GB
with the memory-minimising schedule). Even that one runs some recomputation ahead of its
backward: remat's savings here are a lower bound. Figures are the CPU's: it multiplies bf16
matrices in fp32, so both programs hold fp32 matmul operands that a GPU would hold in bf16
(counted apart). At batch 32 on 2 cores: ViT-B/16 about 15 s, Swin-T 35-50 s, --record 3.5 min.

    python bench/memory_anatomy.py --model swin_tiny_patch4_window7_224
    python bench/memory_anatomy.py --model vit_base_patch16_224 --remat dots
    python bench/memory_anatomy.py --model flax_vit_base_patch16_224
    python bench/memory_anatomy.py --record cpu-memory-anatomy
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import device_name, versions, write_result  # noqa: E402
from bench.step_anatomy import Op, computations, matmuls  # noqa: E402

MODELS = ("vit_base_patch16_224", "swin_tiny_patch4_window7_224")
FLAX = "flax_vit_base_patch16_224"
REMATS = ("none", "dots", "full")
CLASSES = 1000
FP32_MATMUL = "f32 x f32 -> f32"
MEMORY_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# Instructions that only move or retype data: a fusion of these and a bf16 -> f32 convert is a
# copy of a bf16 value in fp32.
MOVES = {"parameter", "convert", "bitcast", "copy", "transpose", "reshape", "broadcast", "slice"}
# op_names of attention's [.., T, T] scores and probabilities: jax.nn.dot_product_attention's
# (vmap()), torch's SDPA, or attention written out (q @ k^T, softmax; Swin's in timm).
ATTENTION = ("scaled_dot_product_attention", "vmap()", "softmax", "bmm", "matmul")
# ... and of the additive bias made for it (Swin's relative positions plus its shift mask).
MASKS = ("aten::add", "aten::expand", "aten::index", "aten::view", "aten::clone", "convert")


# --- the two steps, lowered -------------------------------------------------------------------
def accel_engine(model_name: str, remat: str = "none", attention: str = "xla") -> tuple[Any, str]:
    """accel.prepare on the jax backend for `model_name`; and the remat it runs with
    ('unavailable' where prepare takes no remat=)."""
    import timm
    import torch

    import accel

    class Uint8Images(torch.nn.Module):
        """uint8 NCHW images scaled by 1/255 in the compute dtype (the buffer's), then the
        timm model."""

        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model
            self.register_buffer("scale", torch.tensor(1 / 255.0), persistent=False)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.model(images.to(self.scale.dtype) * self.scale)

    def loss_fn(model: Any, batch: tuple) -> torch.Tensor:
        images, targets = batch
        return torch.sum(-targets * torch.log_softmax(model(images), -1), -1).mean()

    # As the command line's models (accel/cli/models/factory.py): Swin's window attention through
    # scaled_dot_product_attention too (timm keeps it on plain ops by default).
    timm.layers.set_fused_attn(True, experimental=True)
    model = Uint8Images(timm.create_model(model_name, num_classes=CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    kwargs: dict[str, Any] = dict(
        backend="jax", amp="O1", clip_grad=1.0, attention=attention, quiet=True
    )
    try:
        return accel.prepare(model, opt, loss_fn, remat=remat, **kwargs), remat
    except TypeError as err:  # a library without remat=
        if "remat" not in str(err):
            raise
        return accel.prepare(model, opt, loss_fn, **kwargs), "unavailable"


def accel_batch(batch: int) -> tuple:
    """uint8 NCHW images and soft targets (torch tensors)."""
    import torch

    images = torch.zeros(batch, 3, 224, 224, dtype=torch.uint8)
    return images, torch.full((batch, CLASSES), 1.0 / CLASSES)


def flax_step(
    batch: int, implementation: str | None = None, pad_to: int | None = None
) -> tuple[Any, tuple]:
    """A plain Flax ViT-B/16 training step (jitted, params and optimizer state donated) and
    the shapes of its arguments (params, opt_state, uint8 NHWC images, soft targets). `pad_to`:
    attention's tokens padded to that length, the true one passed on (cuDNN's flash attention
    refuses 197 tokens and takes 208 so)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    bf16, width, heads = jnp.bfloat16, 768, 12

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        tokens = q.shape[1]
        if pad_to is None:
            return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
        widths = [(0, 0), (0, pad_to - tokens), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(t, widths) for t in (q, k, v))
        lengths = jnp.full((q.shape[0],), tokens, jnp.int32)
        out = jax.nn.dot_product_attention(
            q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation=implementation,
        )  # fmt: skip
        return out[:, :tokens]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, d = x.shape
            h = nn.LayerNorm(epsilon=1e-6, dtype=bf16)(x)
            qkv = nn.Dense(3 * d, dtype=bf16)(h).reshape(b, t, 3, heads, d // heads)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            a = attend(q, k, v)
            x = x + nn.Dense(d, dtype=bf16)(a.reshape(b, t, d))
            h = nn.Dense(4 * d, dtype=bf16)(nn.LayerNorm(epsilon=1e-6, dtype=bf16)(x))
            h = nn.gelu(h, approximate=False)
            return x + nn.Dense(d, dtype=bf16)(h)

    class ViT(nn.Module):
        @nn.compact
        def __call__(self, images: jax.Array) -> jax.Array:
            x = images.astype(bf16) * jnp.asarray(1 / 255.0, bf16)
            x = nn.Conv(width, (16, 16), strides=(16, 16), dtype=bf16)(x)
            x = x.reshape(x.shape[0], -1, width)
            cls = self.param("cls_token", nn.initializers.zeros, (1, 1, width))
            x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, width)).astype(bf16), x], 1)
            pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, x.shape[1], width))
            x = x + pos.astype(bf16)
            for _ in range(12):
                x = Block()(x)
            x = nn.LayerNorm(epsilon=1e-6, dtype=bf16)(x)[:, 0]
            return nn.Dense(CLASSES, dtype=bf16)(x)

    model = ViT()
    images = jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.uint8)
    targets = jax.ShapeDtypeStruct((batch, CLASSES), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), images)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.05))

    def step(params: Any, opt_state: Any, images: jax.Array, targets: jax.Array) -> tuple:
        def loss_fn(p: Any) -> jax.Array:
            logits = model.apply(p, images).astype(jnp.float32)
            return jnp.mean(jnp.sum(-targets * jax.nn.log_softmax(logits), -1))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step.__name__ = "flax_step"  # the module's name: jit_flax_step
    args = (params, jax.eval_shape(tx.init, params), images, targets)
    return jax.jit(step, donate_argnums=(0, 1)), args


def lowered_step(model: str, batch: int, remat: str) -> tuple[Any, str, list[str]]:
    """(lowered step, remat it ran with, names of its top-level arguments)."""
    if model == FLAX:
        fn, args = flax_step(batch)
        return fn.lower(*args), "none", ["params", "opt_state", "images", "targets"]
    engine, remat = accel_engine(model, remat)
    lowered = engine.lowered_step(*accel_batch(batch))
    names = ["params", "opt_state", "ema", "count", "consts", "batch", "lrs", "ema_decay"]
    return lowered, remat, names


# --- XLA's dump -------------------------------------------------------------------------------
def dims_of(type_: str) -> tuple[str, list[int]]:
    found = re.match(r"([a-z]\w*)\[([\d,]*)\]", type_)
    if not found:
        return "?", []
    return found.group(1), [int(d) for d in found.group(2).split(",") if d]


def element(type_: str, index: str) -> str:
    """The type at `index` ('{}', '{3}') of a possibly tuple-typed instruction."""
    type_ = re.sub(r"\{[\d,]*\}|/\*[^*]*\*/", "", type_)  # layouts, /*index=5*/
    if not type_.startswith("(") or index in ("{}", ""):
        return type_
    parts, depth, current = [], 0, ""
    for char in type_[1:-1]:
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return parts[int(index.strip("{}").split(",")[0])]


def source_path(path: str) -> str:
    """A source path from its package's root ('accel/...', 'timm/...', 'bench/...')."""
    if "/site-packages/" in path:
        return path.rpartition("/site-packages/")[2]
    root = f"{ROOT}/"
    return path[len(root) :] if path.startswith(root) else path


def source_frames(text: str) -> dict[int, str]:
    """stack_frame_id -> 'file:line (function)' of its innermost frame, from the tables the
    compiled module's text opens with."""
    tables: dict[str, dict[int, str]] = {}
    section = ""
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
            continue
        if line.startswith(("HloModule", "%", "ENTRY")) or not line.strip():
            section = "" if line.startswith(("%", "ENTRY")) else section
            continue
        if section:
            key, _, rest = line.partition(" ")
            if key.isdigit():
                tables[section][int(key)] = rest.strip('"')
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    out: dict[int, str] = {}
    for frame, rest in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", rest)
        where = tables.get("FileLocations", {}).get(int(location.group(1)) if location else -1, "")
        ids = dict(re.findall(r"(\w+)=(\d+)", where))
        path = files.get(int(ids.get("file_name_id", -1)), "?")
        function = functions.get(int(ids.get("function_name_id", -1)), "?")
        out[frame] = f"{source_path(path)}:{ids.get('line', '?')} ({function})"
    return out


def op_name(op: Op) -> str:
    found = re.search(r'op_name="([^"]*)"', op.rest)
    name = found.group(1) if found else ""
    # (a step compiled from its export runs inside jit(call)/call_exported)
    name = re.sub(r"^(jit\(call\)/call_exported/)?jit\((step|flax_step)\)/", "", name)
    name = re.sub(r"^(while/body/)?(closed_call/)?", "", name)
    return re.sub(r"_\d+(?=/|$)", "_N", name)  # Block_3 -> Block_N: the blocks group together


class Program:
    """A compiled module's text, read from XLA's dump: its instructions by name, the fused
    computations, the parameters' shapes and the source lines of its stack frames."""

    def __init__(self, text: str, batch: int, bf16_matmuls: bool):
        # No fp32 x fp32 matmul before XLA's passes (attention's backward multiplies its fp32
        # score gradients by bf16 values, in Flax as in accel; the rest is bf16 x bf16).
        self.bf16_matmuls = bf16_matmuls
        self.comps = computations(text)
        self.ops = {op.name: op for ops in self.comps.values() for op in ops}
        self.frames = source_frames(text)
        self.users: dict[str, list[Op]] = {}
        for ops in self.comps.values():
            for op in ops:
                for name in op.operands():
                    self.users.setdefault(name, []).append(op)
        # The weights' and moments' shapes (the batch's arguments left out: they have its size)
        params = [op for op in self.comps.get("ENTRY", []) if op.opcode == "parameter"]
        self.weight_shapes = {canonical(op.type)[1] for op in params if batch not in op.dims}
        self.weight_shapes.discard(())

    def body(self, op: Op) -> list[Op]:
        return self.comps.get((op.attribute("calls") or "").lstrip("%"), [])

    def made_by(self, op: Op, depth: int = 0) -> tuple[str, str]:
        """(op_name, source line) of the instruction, or of its fusion's root."""
        for candidate in [op, *reversed(self.body(op))]:
            name = op_name(candidate)
            frame = re.search(r"stack_frame_id=(\d+)", candidate.rest)
            if name:
                return name, self.frames.get(int(frame.group(1)), "") if frame else ""
        # A copy XLA made (a layout, a dtype): named after what it copies.
        source = self.ops.get(next(iter(op.operands()), ""))
        if source is not None and source.opcode != "parameter" and depth < 3:
            name, where = self.made_by(source, depth + 1)
            return f"{op.opcode} of {name}", where
        return "", ""

    def category(self, op: Op, type_: str, name: str) -> str:
        dtype, dims = dims_of(type_)
        kinds = {o.opcode for o in self.body(op)} or {op.opcode}
        if canonical(type_)[1] in self.weight_shapes:
            return "weight-sized (gradients, moments, weight copies)"
        users = self.users.get(op.name, [])
        if dtype == "f32" and users and all(self.is_matmul(u) for u in users):
            if self.bf16_matmuls:  # the CPU's fp32 then: it multiplies bf16 in fp32
                return "fp32 matmul operands (the CPU's; bf16 before XLA's passes)"
            return "fp32 matmul operands (fp32 x fp32 matmuls before XLA's passes)"
        converts = [o for o in self.body(op) or [op] if o.opcode == "convert"]
        if dtype == "f32" and converts and kinds <= MOVES:
            return "fp32 copy of a bf16 value"
        if len(dims) >= 3 and dims[-1] == dims[-2]:
            if any(key in name for key in ATTENTION):
                return f"attention scores/probabilities {dtype}"
            if any(key in name for key in MASKS):
                return f"attention bias/mask {dtype}"
        return f"activations {dtype}" if dtype in ("f32", "bf16") else f"{dtype} values"

    def is_matmul(self, op: Op) -> bool:
        return op.opcode == "dot" or any(o.opcode == "dot" for o in self.body(op))


def canonical(type_: str) -> tuple[str, tuple[int, ...]]:
    """dtype and the sorted axes, 1s dropped: one buffer in two layouts compares equal."""
    dtype, dims = dims_of(type_)
    return dtype, tuple(sorted((d for d in dims if d != 1), reverse=True))


def read_dump(folder: Path, module: str) -> tuple[str, str]:
    """The compiled module's text and its live-range report."""
    found = sorted(folder.glob(f"*.{module}.cpu_after_optimizations.txt"))
    if not found:
        raise SystemExit(f"no {module} in XLA's dump at {folder}")
    text = found[-1].read_text()
    return text, found[-1].with_name(found[-1].stem + "-live-range.txt").read_text()


def peak_buffers(text: str, live: str, batch: int, top: int, bf16_matmuls: bool) -> dict:
    """The values live at the peak of XLA's live ranges: bytes by category, and the largest
    groups (same type, same maker)."""
    program = Program(text, batch, bf16_matmuls)
    peak_at, _, listed = live.partition("(peak):")
    at = re.findall(r"Live ranges at (\d+)", peak_at)
    by_category: Counter[str] = Counter()
    groups: dict[tuple, dict] = {}
    shapes: Counter[str] = Counter()
    arguments = 0
    for name, index, size in re.findall(r"^\s*(\S+?)(\{[\d,]*\}): (\d+) bytes", listed, re.M):
        op, size = program.ops.get(name), int(size)
        if op is None:
            continue
        if op.opcode == "parameter":
            arguments += size
            continue
        type_ = element(op.type, index)
        made_by, source = program.made_by(op)
        category = program.category(op, type_, made_by)
        by_category[category] += size
        dtype, dims = canonical(type_)
        shapes[f"{dtype}[{','.join(map(str, dims))}]"] += size
        row = groups.setdefault(
            (type_, made_by),
            {"type": type_, "count": 0, "bytes": 0, "category": category, "made_by": made_by},
        )
        row["count"] += 1
        row["bytes"] += size
        row.setdefault("source", source)
        row.setdefault("instruction", f"{op.opcode} {name}")
    largest = sorted(groups.values(), key=lambda r: -r["bytes"])[:top]
    temporaries = sum(by_category.values())
    return {
        "peak_at": int(at[0]) if at else None,
        "arguments_live_bytes": arguments,
        "temporaries_live_bytes": temporaries,
        "temporaries_live_per_image": temporaries // batch,
        "by_category": dict(by_category.most_common()),
        "by_shape": dict(shapes.most_common()),
        "largest": largest,
    }


def argument_bytes(lowered: Any, names: list[str]) -> dict[str, int]:
    import jax

    args = lowered.args_info[0]
    return {
        name: sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(arg))
        for name, arg in zip(names, args, strict=True)
    }


# --- one run ----------------------------------------------------------------------------------
def anatomy(args: argparse.Namespace, dump: Path) -> dict:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # compile here, so it dumps
    started = time.perf_counter()
    lowered, remat, names = lowered_step(args.model, args.batch, args.remat)
    lower_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    stats = compiled.memory_analysis()
    memory = {
        key: getattr(stats, f"{key}_size_in_bytes")
        for key in ("argument", "output", "alias", "temp", "generated_code")
    }
    memory["output_not_aliased"] = memory["output"] - memory["alias"]
    memory["temp_per_image"] = memory["temp"] // args.batch
    module = "jit_flax_step" if args.model == FLAX else "jit_step"
    text, live = read_dump(dump, module)
    before = [op for ops in computations(lowered.as_text(dialect="hlo")).values() for op in ops]
    dots = matmuls(before, args.batch)
    return {
        "model": args.model,
        "batch": args.batch,
        "amp": "O1",
        "remat_asked": args.remat,
        "remat": remat,
        "platform": jax.devices()[0].platform,
        "xla_flags": MEMORY_SCHEDULE,
        "lower_s": round(lower_s, 1),
        "compile_s": round(compile_s, 1),
        "memory": memory,
        "arguments": argument_bytes(lowered, names),
        "matmuls_before_passes": dots,
        "peak": peak_buffers(text, live, args.batch, args.top, FP32_MATMUL not in dots),
    }


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def show(record: dict) -> None:
    mem, peak = record["memory"], record["peak"]
    print(f"\n{record['model']}, batch {record['batch']}, O1, remat {record['remat']}: ", end="")
    print(f"lowered in {record['lower_s']} s, compiled in {record['compile_s']} s")
    print(f"  XLA memory analysis: arguments {mb(mem['argument'])}, ", end="")
    print(f"outputs {mb(mem['output'])}", end="")
    print(f", aliased {mb(mem['alias'])} (not aliased {mem['output_not_aliased']} B)")
    print(f"  temporaries {mb(mem['temp'])}, {mb(mem['temp_per_image'])} per image")
    print("  arguments:", ", ".join(f"{k} {mb(v)}" for k, v in record["arguments"].items()))
    for key, row in record["matmuls_before_passes"].items():
        print(f"  matmuls {key}: {row['count']}, {row['gflops_per_image']} GFLOP/image")
    print(f"  live at the peak (instruction {peak['peak_at']}): arguments ", end="")
    print(f"{mb(peak['arguments_live_bytes'])}, the rest {mb(peak['temporaries_live_bytes'])}")
    for category, size in peak["by_category"].items():
        print(f"    {mb(size):>12}  {category}")
    print("  largest at the peak:")
    for row in peak["largest"]:
        print(f"    {mb(row['bytes']):>12}  {row['count']:>3} x {row['type']:<24} ", end="")
        print(f"{row['category']}; {row['made_by'][:90]} @ {row['source']}")


# --- the recorded comparison -----------------------------------------------------------------
def compare(accel: dict, flax: dict) -> dict:
    """Bytes at the peak that accel's step holds beyond Flax's: by category, by shape."""

    def diff(key: str) -> dict[str, dict[str, int]]:
        a, f = accel["peak"][key], flax["peak"][key]
        rows = {k: {"accel": a.get(k, 0), "flax": f.get(k, 0)} for k in {*a, *f}}
        for row in rows.values():
            row["accel_minus_flax"] = row["accel"] - row["flax"]
        return dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]["accel_minus_flax"])))

    am, fm = accel["memory"], flax["memory"]
    return {
        "temp_ratio": round(am["temp"] / fm["temp"], 3),
        "temp_accel_minus_flax": am["temp"] - fm["temp"],
        "output_not_aliased": {"accel": am["output_not_aliased"], "flax": fm["output_not_aliased"]},
        "argument_accel_minus_flax": am["argument"] - fm["argument"],
        "peak_by_category": diff("by_category"),
        "peak_by_shape": diff("by_shape"),
    }


def record_all(args: argparse.Namespace) -> int:
    runs = []
    jobs = [(m, r) for m in MODELS for r in REMATS] + [(FLAX, "none")]
    with tempfile.TemporaryDirectory() as scratch:
        for model, remat in jobs:
            out = Path(scratch) / f"{len(runs)}.json"
            argv = [sys.executable, __file__, "--model", model, "--remat", remat]
            argv += ["--batch", str(args.batch), "--top", str(args.top), "--out", str(out)]
            started = time.perf_counter()
            if subprocess.run(argv, cwd=ROOT).returncode != 0:
                return 1
            run = json.loads(out.read_text())
            run["wall_s"] = round(time.perf_counter() - started, 1)
            runs.append(run)
    flax = next(r for r in runs if r["model"] == FLAX)
    vit = next(r for r in runs if r["model"] == MODELS[0] and r["remat_asked"] == "none")
    summary = {
        f"{r['model']} remat={r['remat']}": {
            "temp_bytes": r["memory"]["temp"],
            "temp_per_image": r["memory"]["temp_per_image"],
            "output_not_aliased": r["memory"]["output_not_aliased"],
            "wall_s": r["wall_s"],
        }
        for r in runs
    }
    comparison = compare(vit, flax)
    print("\ntemporaries per image:")
    for key, row in summary.items():
        print(f"  {key:<50} {mb(row['temp_per_image']):>12}  ({row['wall_s']} s)")
    print(f"\nViT-B/16 accel (remat none) over Flax: temporaries x{comparison['temp_ratio']}")
    for key, row in list(comparison["peak_by_shape"].items())[:12]:
        print(f"  {key:<28} accel {mb(row['accel']):>11}  flax {mb(row['flax']):>11}")
    write_result(
        args.record,
        {
            "kind": "memory anatomy (lowered and compiled, not run)",
            "settings": {
                "batch": args.batch,
                "amp": "O1",
                "xla_flags": MEMORY_SCHEDULE,
                "flax": md.version("flax"),
            },
            "summary": summary,
            "vit_accel_vs_flax": comparison,
            "runs": runs,
        },
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=MODELS[1], help=f"a timm name, or {FLAX}")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--remat", default="none", choices=REMATS)
    p.add_argument("--top", type=int, default=15, help="groups of the largest buffers shown")
    p.add_argument("--out", type=Path, help="write the record here (JSON)")
    p.add_argument("--record", metavar="TAG", help="every model and remat, and Flax: TAG.json")
    args = p.parse_args(argv)
    if args.record:
        return record_all(args)
    with tempfile.TemporaryDirectory() as dump:
        # Before jax is first imported: XLA reads its flags once.
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text {MEMORY_SCHEDULE}"
        flags += " --xla_dump_hlo_module_re=^jit_(flax_)?step$"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
        record = {"device": device_name(), "versions": versions(), **anatomy(args, Path(dump))}
    show(record)
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
