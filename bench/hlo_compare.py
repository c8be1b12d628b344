"""Benchmark: the jax backend's ViT-B/16 training step and a plain Flax ViT-B/16 step, set side by
side as the StableHLO each hands XLA, with XLA's cost analysis; nothing runs.

accel's step is `accel.prepare(timm vit_base_patch16_224 behind uint8 / 255, AdamW(wd 0.05),
soft-target loss, backend="jax", amp="O1", clip_grad=1.0, attention="xla")`; the Flax step is
bench/memory_anatomy.py's (bf16 compute, fp32 params, jax.nn.dot_product_attention on XLA's ops,
optax clip_by_global_norm(1.0) + adamw(wd 0.05)), on the same uint8 images and soft targets.
Both are exported for CUDA without a GPU (`jax.export.export(fn, platforms=["cuda"])`, accel's
jitted step with its own arguments), and lowered for this machine. Reported per step:

- StableHLO ops by kind (a called function's ops once per call), converts by from -> to dtype,
  transposes, elementwise ops by result dtype (f32 / bf16), dot_generals by operand and result
  types (and by shapes, in the record) with their flops per image;
- bytes accessed per image: XLA's cost analysis before its passes (of the CUDA export and of
  the lowering for this machine: the same figures) and of the program compiled for this
  machine (a CPU's fusions, not a GPU's); and this script's own count of the export (operands
  plus results of every op, as XLA counts them before its passes, to within about 2%) split by
  the part of the step that made each op, read from the StableHLO's source locations: the
  model's forward and backward (by layer), the weights' casts, the loss, the micro-step scan,
  the all-reduce, clipping, the optimizer, the non-finite check.

Written to bench/results/TAG.json (default cpu-hlo-compare) with the device and versions. About
40 s on a 2-core CPU (two lowerings, two exports, two compiles for this machine).

    python bench/hlo_compare.py
    python bench/hlo_compare.py --batch 32 --tag cpu-hlo-compare
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import linecache
import math
import re
import sys
import time
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import write_result  # noqa: E402
from bench.memory_anatomy import accel_batch, accel_engine, flax_step, source_path  # noqa: E402
from bench.step_anatomy import by_kind, computations, costs, executed  # noqa: E402

MODEL = "vit_base_patch16_224"
BYTES = {"f64": 8, "i64": 8, "ui64": 8, "f32": 4, "i32": 4, "ui32": 4, "bf16": 2, "f16": 2}
BYTES |= {"i16": 2, "ui16": 2, "i8": 1, "ui8": 1, "i1": 1}
ELEMENTWISE = {
    *("add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "sign"),
    *("exponential", "log", "sqrt", "rsqrt", "tanh", "power", "select", "compare", "clamp"),
    *("and", "or", "not", "is_finite", "floor", "log_plus_one", "exponential_minus_one"),
}
# No bytes of their own in XLA's cost analysis before its passes (a transpose is a layout, a
# sharding constraint an annotation); a called function's ops are counted where they run.
FREE = {"constant", "while", "call", "return", "iota", "transpose", "sharding_constraint"}


# --- StableHLO, read --------------------------------------------------------------------------
def tensor(text: str) -> tuple[str, int]:
    """'32x197x768xbf16' -> ('bf16', elements)."""
    *dims, dtype = text.split("x")
    return dtype, math.prod(int(d) for d in dims)


def types(text: str) -> list[tuple[str, int]]:
    return [tensor(t) for t in re.findall(r"tensor<([^>]*)>", text)]


class Locations:
    """The module's `#locN = loc(...)` table: each location as (name stack, frames), frames
    innermost first as (file, line)."""

    def __init__(self, text: str):
        self.table = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)\s*$", text, re.M))

    @cache  # noqa: B019 (one instance a module, kept while the module is read)
    def resolve(self, expr: str) -> tuple[str, tuple[tuple[str, int], ...]]:
        expr = expr.strip()
        if expr.startswith("#loc"):
            return self.resolve(self.table.get(expr, "unknown"))
        if expr.startswith("loc(") and expr.endswith(")"):
            expr = expr[4:-1]
        found = re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", expr)
        if found:
            (name, inner), (_, outer) = (self.resolve(g) for g in found.groups())
            return name, inner + outer
        found = re.match(r'"([^"]*)":(\d+):', expr)
        if found:
            return "", ((found.group(1), int(found.group(2))),)
        found = re.fullmatch(r'"([^"]*)"\((.*)\)', expr)
        if found:
            name, frames = self.resolve(found.group(2))
            return found.group(1) + (f"/{name}" if name else ""), frames
        found = re.fullmatch(r'"([^"]*)"', expr)
        if found:
            return found.group(1), ()
        found = re.match(r"fused\[(#loc\d*)", expr)
        return self.resolve(found.group(1)) if found else ("", ())


class HloOp:
    """One StableHLO op: its kind, operand and result types, and where it came from."""

    def __init__(self, kind: str, text: str, signature: str, location: str, callee: str = ""):
        self.kind, self.callee, self.text, self.signature = kind, callee, text, signature
        self.location = location[:-1] if location.endswith(")") else location  # "#loc3)"
        found = types(signature)
        if "->" in signature:
            ins, _, outs = signature.partition("->")
            self.ins, self.outs = types(ins), types(outs)
        elif kind == "while":  # its results' types
            self.ins, self.outs = [], found
        elif kind == "select" and len(found) == 2:  # the predicate's type, then the values'
            self.ins, self.outs = [found[0], found[1], found[1]], [found[1]]
        else:  # one type for every operand and the result
            operands = len(re.findall(r"%[\w#.:-]+", text)) if kind not in FREE else 0
            self.ins, self.outs = found[:1] * operands, found[:1]

    @property
    def moved(self) -> int:
        """Bytes of its operands and results."""
        return sum(BYTES.get(d, 4) * n for d, n in self.ins + self.outs)

    @property
    def bytes(self) -> int:
        """Bytes accessed as XLA's cost analysis counts them."""
        return 0 if self.kind in FREE else self.moved

    def dot_flops(self) -> int:
        found = re.search(r"contracting_dims = \[([\d, ]*)\] x", self.text)
        lhs = re.search(r"tensor<([^>]*)>", self.signature)
        if not found or not lhs or not self.outs:
            return 0
        dims = [int(d) for d in lhs.group(1).split("x")[:-1]]
        contracted = math.prod(dims[int(i)] for i in found.group(1).split(",") if i.strip())
        return 2 * self.outs[0][1] * contracted


OPERATION = re.compile(r'^\s*%[\w#:.-]+(?:, %[\w#:.-]+)* = "?(\w+\.\w+|call)"?(.*)$')


def read_module(text: str) -> list[tuple[HloOp, str]]:
    """Every op the module runs, a function's ops once per call (from @main down), each with
    the location of the call it runs in (a jitted helper's ops, jnp.where's or jnp.var's, carry
    no frames of their own); the scalar bodies of reductions and all-reduces left out."""
    functions: dict[str, list[HloOp]] = defaultdict(list)
    current, pending = "", None
    for line in text.splitlines():
        header = re.match(r"\s*func\.func (?:public|private) @([\w.$-]+)\(", line)
        if header:
            current = header.group(1)
            continue
        if pending is not None:  # inside a generic op's region: its types close it
            if line.lstrip().startswith("})"):
                signature, _, location = line.partition(" : ")[2].partition(" loc(")
                functions[current].append(HloOp(*pending, signature, location))
                pending = None
            continue
        found = OPERATION.match(line)
        if not found:
            continue
        kind, rest = found.group(1).split(".")[-1], found.group(2)
        called = re.match(r"\s*@([\w.$-]+)", rest) if kind == "call" else None
        callee = called.group(1) if called else ""
        if rest.rstrip().endswith("({"):
            pending = (kind, rest)
            continue
        body, _, location = rest.partition(" loc(")
        operands, _, signature = body.rpartition(" : ")
        functions[current].append(HloOp(kind, operands, signature, location, callee))
    out: list[tuple[HloOp, str]] = []

    def expand(name: str, caller: str, depth: int = 0) -> None:
        for op in functions.get(name, []):
            out.append((op, caller))
            if op.callee and depth < 20:
                expand(op.callee, op.location, depth + 1)

    expand("main", "")
    return out


# --- which part of the step made an op --------------------------------------------------------
@cache
def enclosing_function(path: str, line: int) -> str:
    """The function (Class.method or name) a source line sits in."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return ""
    best, best_span = "", 10**9

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal best, best_span
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                if child.lineno <= line <= end and end - child.lineno < best_span:
                    best, best_span = name, end - child.lineno
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return best


def part(frames: tuple[tuple[str, int], ...]) -> str:
    """The part of the step an op belongs to: the innermost frame a rule names (optax's tree
    helpers name none: the clipping or the optimizer that called them does)."""
    for path, line in frames:
        name = source_path(path)
        function = enclosing_function(path, line)
        if name.startswith("accel/backends/jax/step.py"):
            if function.endswith("torch_clip"):
                return "clip (torch's rule)"
            if function.endswith("micro_step") or function.endswith("mean_grads"):
                return "micro-step scan (zeros, sums, / steps)"
            if function.endswith("local_grads"):
                return "all-reduce over the mesh (pmean, keys)"
            if function.endswith("constrain"):
                return "gradient sharding constraints"
            return f"step: {linecache.getline(path, line).strip()[:60]}"
        if name.startswith("accel/backends/jax/values.py") or name.startswith("flax/linen/dtypes"):
            return "weights cast to bf16"
        if name.startswith("accel/backends/jax/optimizer.py"):
            return "optimizer (AdamW)"
        if name.startswith("accel/backends/jax/compiled.py"):
            return "loss (fp32 cast, extras)"
        if name.startswith("optax/transforms/_clipping"):
            return "clip (optax)"
        if name.startswith("optax/") and not name.startswith("optax/tree_utils"):
            return "optimizer (AdamW)"
        if name.startswith(("timm/", "torch/nn/", "flax/linen/", "accel/backends/jax/attention")):
            return "model forward+backward"
        if name.startswith("bench/"):
            if ".Block." in f".{function}." or ".ViT." in f".{function}." or "Uint8" in function:
                return "model forward+backward"
            if function.endswith("loss_fn"):
                return "loss"
    return "other"


LAYERS = (  # the layer of a model op: from its name stack, else from its source line
    ("layer norm", ("layer_norm", "LayerNorm")),
    ("gelu", ("gelu", "erf")),
    ("attention", ("scaled_dot_product_attention", "dot_product_attention", "vmap(")),
    ("linear", ("linear", "Dense", "addmm", "aten::mm", "dot_general")),
    ("patch embed + input", ("convolution", "Conv", "aten::mul.Tensor", "aten::cat", "_to_copy")),
)
LAST = (
    ("residual adds", ("aten::add.Tensor", "/add")),
    ("layout (reshape, transpose, split)", ("aten::", "/reshape", "/transpose", "/squeeze")),
    ("layout (reshape, transpose, split)", ("/slice", "/concatenate")),
)


def layer(name: str, line: str) -> str:
    for text, table in ((name, LAYERS), (line, LAYERS[1:3]), (name, LAST)):
        found = next((k for k, keys in table if any(key in text for key in keys)), None)
        if found:
            return found
    return "other"


def model_line(frames: tuple[tuple[str, int], ...]) -> str:
    """The model's own source line an op comes from (timm's, or this bench's Flax model)."""
    model = ("timm/", "bench/")
    found = next(((p, n) for p, n in frames if source_path(p).startswith(model)), None)
    return linecache.getline(*found).strip() if found else ""


def dot_types(op: HloOp) -> str:
    return f"{op.ins[0][0]} x {op.ins[1][0]} -> {op.outs[0][0]}"


def rnd(table: dict) -> dict:
    return {k: [round(x, 4) if isinstance(x, float) else x for x in v] for k, v in table.items()}


# --- one module, summed -----------------------------------------------------------------------
def summary(text: str, batch: int) -> dict:
    locations = Locations(text)
    ops = read_module(text)
    kinds = Counter(op.kind for op, _ in ops if op.kind not in ("return", "constant"))
    converts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    elementwise: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    transposes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    dots: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    dtypes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    parts: dict[str, float] = defaultdict(float)
    layers: dict[str, float] = defaultdict(float)
    total = 0
    for op, caller in ops:
        name, frames = locations.resolve(op.location)
        if not frames:  # in a helper function: where it was called from
            outer, frames = locations.resolve(caller)
            name = f"{outer}/{name}"
        where = part(frames)
        parts[where] += op.bytes / batch / 1e9
        total += op.bytes
        if where == "model forward+backward":
            layers[layer(f"{name} {op.kind}", model_line(frames))] += op.bytes / batch / 1e9
        dtype = op.outs[0][0] if op.outs else "?"
        if op.kind == "convert" and op.ins:
            row = converts[f"{op.ins[0][0]} -> {dtype}"]
            row[0] += 1
            row[1] += op.outs[0][1] // batch
        elif op.kind in ELEMENTWISE:
            row3 = elementwise[dtype]
            row3[0] += 1
            row3[1] += op.outs[0][1] // batch
            row3[2] += op.bytes / batch / 1e9
        elif op.kind == "transpose":
            transposes[dtype][0] += 1
            transposes[dtype][1] += op.moved / batch / 1e9
        elif op.kind == "dot_general":
            shapes = re.findall(r"tensor<([^>]*)>", op.signature)
            flops = op.dot_flops() / batch / 1e9
            shape = f"{shapes[0]} x {shapes[1]} -> {shapes[2]}"
            for table, key in ((dots, shape), (dtypes, dot_types(op))):
                table[key][0] += 1
                table[key][1] += flops
    return {
        "ops": dict(kinds.most_common()),
        "converts_count_elements_per_image": dict(converts),
        "elementwise_by_dtype_count_elements_gbytes_per_image": rnd(elementwise),
        "transposes_by_dtype_count_gbytes_moved_per_image": rnd(transposes),
        "dot_general_types_count_gflops_per_image": rnd(dtypes),
        "dot_general_shapes_count_gflops_per_image": rnd(dots),
        "own_gbytes_per_image": round(total / batch / 1e9, 4),
        "own_gbytes_per_image_by_part": {k: round(v, 4) for k, v in sorted(parts.items())},
        "own_gbytes_per_image_model_by_layer": {k: round(v, 4) for k, v in sorted(layers.items())},
    }


# --- the two steps ----------------------------------------------------------------------------
def accel_modules(batch: int) -> dict[str, Any]:
    import jax

    engine, _ = accel_engine(MODEL)
    images, targets = accel_batch(batch)
    started = time.perf_counter()
    lowered = engine.lowered_step(images, targets)
    out: dict[str, Any] = {"lowered": lowered, "lower_s": time.perf_counter() - started}
    # The jitted step and its arguments, as Engine.lowered_step builds them.
    runner = engine.runner
    step = runner.step
    args = step.arguments(runner.stacked(engine.steps.micro_batches((images, targets))), 1e-3, 0.0)
    specs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args
    )
    with step.tracer.tracing():
        out["cuda"] = jax.export.export(step.fn, platforms=["cuda"])(*specs).mlir_module()
    return out


def flax_modules(batch: int) -> dict[str, Any]:
    import jax

    fn, args = flax_step(batch, implementation="xla")
    started = time.perf_counter()
    lowered = fn.lower(*args)
    out: dict[str, Any] = {"lowered": lowered, "lower_s": time.perf_counter() - started}
    out["cuda"] = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    return out


def cuda_cost(module: str, batch: int) -> dict[str, float]:
    """XLA's cost analysis (before its passes) of the module exported for CUDA, through jax's
    own route for Lowered.cost_analysis (not public API: {} where it moved)."""
    try:
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        computation = _jax.mlir.mlir_module_to_xla_computation(module, use_tuple_args=False)
        cpu = xla_bridge.get_backend("cpu")
        return costs(_jax.hlo_module_cost_analysis(cpu, computation.as_hlo_module()), batch)
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return {}


def measure(modules: dict[str, Any], batch: int) -> dict:
    lowered = modules["lowered"]
    started = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    run, _ = executed(computations(compiled.as_text()))
    return {
        "lower_s": round(modules["lower_s"], 1),
        "compile_s": round(compile_s, 1),
        "cost_before_passes": costs(lowered.cost_analysis(), batch),
        "cost_cuda_export_before_passes": cuda_cost(modules["cuda"], batch),
        "cost_compiled_cpu": costs(compiled.cost_analysis(), batch),
        "compiled_cpu_ops_run": by_kind(run),
        "cuda_export": summary(modules["cuda"], batch),
        "cpu_lowering": summary(lowered.as_text(debug_info=True), batch),
    }


def show(accel: dict, flax: dict) -> None:
    def rows(title: str, a: dict, f: dict, fmt=lambda v: str(v)) -> None:
        print(f"\n{title}")
        for key in sorted({*a, *f}, key=lambda k: str(k)):
            av, fv = a.get(key, "-"), f.get(key, "-")
            print(f"  {key:<58} {fmt(av):>22} {fmt(fv):>22}")

    a, f = accel["cuda_export"], flax["cuda_export"]
    print(f"\n{'':<60} {'accel':>22} {'flax':>22}   (StableHLO exported for CUDA)")
    rows("ops by kind", a["ops"], f["ops"])
    rows("converts: count, elements/image", a["converts_count_elements_per_image"],
         f["converts_count_elements_per_image"])  # fmt: skip
    rows("elementwise by dtype: count, elements/image, GB/image",
         a["elementwise_by_dtype_count_elements_gbytes_per_image"],
         f["elementwise_by_dtype_count_elements_gbytes_per_image"])  # fmt: skip
    rows("transposes: count, GB moved/image", a["transposes_by_dtype_count_gbytes_moved_per_image"],
         f["transposes_by_dtype_count_gbytes_moved_per_image"])  # fmt: skip
    rows("dot_general types: count, GFLOP/image", a["dot_general_types_count_gflops_per_image"],
         f["dot_general_types_count_gflops_per_image"])  # fmt: skip
    rows("own bytes count by part, GB/image", a["own_gbytes_per_image_by_part"],
         f["own_gbytes_per_image_by_part"])  # fmt: skip
    rows("model forward+backward by layer, GB/image", a["own_gbytes_per_image_model_by_layer"],
         f["own_gbytes_per_image_model_by_layer"])  # fmt: skip
    rows("compiled for this CPU: ops run", accel["compiled_cpu_ops_run"],
         flax["compiled_cpu_ops_run"])  # fmt: skip
    for key in ("cost_before_passes", "cost_cuda_export_before_passes", "cost_compiled_cpu"):
        rows(f"XLA's cost analysis, {key}", accel[key], flax[key])
    before = accel["cost_before_passes"]["gbytes_accessed_per_image"]
    ratio = before / flax["cost_before_passes"]["gbytes_accessed_per_image"]
    print(f"\nbytes accessed per image, accel / flax: {ratio:.3f} before XLA's passes", end="")
    compiled = accel["cost_compiled_cpu"]["gbytes_accessed_per_image"]
    print(f", {compiled / flax['cost_compiled_cpu']['gbytes_accessed_per_image']:.3f} compiled")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tag", default="cpu-hlo-compare", help="results file name")
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    accel = measure(accel_modules(args.batch), args.batch)
    flax = measure(flax_modules(args.batch), args.batch)
    show(accel, flax)
    ratio = {
        key: round(
            accel[key]["gbytes_accessed_per_image"] / flax[key]["gbytes_accessed_per_image"], 4
        )
        for key in ("cost_before_passes", "cost_compiled_cpu")
    }
    write_result(
        args.tag,
        {
            "kind": "StableHLO of the ViT-B/16 step, accel (jax backend) against plain Flax",
            "settings": {
                "model": MODEL,
                "batch": args.batch,
                "amp": "O1",
                "attention": "xla",
                "flax": md.version("flax"),
            },
            "bytes_accessed_ratio_accel_over_flax": ratio,
            "accel": accel,
            "flax": flax,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
