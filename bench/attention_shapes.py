"""jax's attention per shape: XLA's own ops against cuDNN flash attention (padded), forward and
backward, at the shapes Swin and ViT models train with. What `--attention auto` picks from
(AUTO_RULES in accel/backends/jax/attention.py).

    python bench/attention_shapes.py                       # batch 128, bf16, on the GPU
    python bench/attention_shapes.py --batch_size 2 --iters 2   # the harness, on a CPU

Each shape runs through the jax backend's own attention (`AttentionKernels`, the path a step
takes), so a shape cuDNN refuses is timed on XLA and said so. A Swin block's attention has a
learned relative-position bias [1, heads, T, T]; a shifted block adds its window mask, which
makes the bias [B * windows, heads, T, T]; the gradient reaches the learned bias either way.
Reported per shape: milliseconds per forward and per forward + backward on each implementation,
and for each model the sum over its blocks (one training step's attention). Written to
bench/results/<tag>.json with the device and versions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from accel.backends.jax.attention import AttentionKernels  # noqa: E402
from bench.compare_backends import write_result  # noqa: E402


class Shape(NamedTuple):
    """One attention of a model: `blocks` of its blocks take it per step, for a batch of
    `images`: images * windows sequences of `tokens`, `heads` heads of `head_dim`."""

    model: str
    name: str
    blocks: int
    windows: int  # sequences per image (Swin's windows; 1 for ViT)
    tokens: int
    heads: int
    head_dim: int
    bias: str  # "none", "shared" ([1, H, T, T], learned) or "per_window" (+ the shift mask)


def swin_shapes(
    model: str, image: int, window: int, heads: tuple[int, ...], depths: tuple[int, ...]
):
    """Swin's attentions: per stage, its regular blocks (shared bias) and its shifted ones (bias
    and mask per window); a stage whose resolution is one window does not shift."""
    shapes = []
    side = image // 4
    for stage, (h, depth) in enumerate(zip(heads, depths, strict=True)):
        windows = (side // window) ** 2
        shifted = depth // 2 if side > window else 0
        common = dict(model=model, windows=windows, tokens=window * window, heads=h, head_dim=32)
        shapes.append(
            Shape(name=f"stage {stage + 1}", blocks=depth - shifted, bias="shared", **common)
        )
        if shifted:
            shapes.append(
                Shape(
                    name=f"stage {stage + 1} shifted", blocks=shifted, bias="per_window", **common
                )
            )
        side //= 2
    return shapes


def vit_shape(model: str, tokens: int, heads: int, depth: int) -> list[Shape]:
    return [Shape(model, "every block", depth, 1, tokens, heads, 64, "none")]


SHAPES = [  # the models the rules are for first: each shape compiles 4 steps (~10 s on a GPU)
    *swin_shapes("swin_tiny_patch4_window7_224", 224, 7, (3, 6, 12, 24), (2, 2, 6, 2)),
    *vit_shape("vit_base_patch16_224", 197, 12, 12),
    *vit_shape("vit_base_patch32_224", 50, 12, 12),
    *swin_shapes("swin_base_patch4_window12_384", 384, 12, (4, 8, 16, 32), (2, 2, 18, 2)),
    *vit_shape("vit_large_patch16_224", 197, 16, 24),
    *vit_shape("vit_small_patch16_224", 197, 6, 12),
    *vit_shape("vit_base_patch16_384", 577, 12, 12),
]


def step_fns(shape: Shape, kernels: AttentionKernels, sequences: int):
    """The forward, and the forward + backward (to q, k, v and the learned bias), jitted."""
    key = jax.random.PRNGKey(0)
    qkv_shape = (sequences, shape.tokens, shape.heads, shape.head_dim)
    q, k, v = (
        jax.random.normal(jax.random.fold_in(key, i), qkv_shape, jnp.bfloat16) for i in range(3)
    )
    learned = mask = None
    if shape.bias != "none":
        learned = jax.random.normal(key, (1, shape.heads, shape.tokens, shape.tokens), jnp.bfloat16)
    if shape.bias == "per_window":  # timm's shift mask: 0 or -100 per window pair, each window
        mask = jnp.where(
            jax.random.bernoulli(key, 0.2, (sequences, 1, shape.tokens, shape.tokens)), -100.0, 0.0
        ).astype(jnp.bfloat16)

    def forward(q, k, v, learned):
        bias = None if learned is None else (learned if mask is None else learned + mask)
        return kernels(q, k, v, bias, None, None, False)

    def loss(q, k, v, learned):
        return forward(q, k, v, learned).astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2) if learned is None else (0, 1, 2, 3))
    return jax.jit(forward), jax.jit(grad), (q, k, v, learned)


def milliseconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile, and one run
    started = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / iters * 1e3


def measure(shape: Shape, implementation: str, batch: int, iters: int, on_gpu: bool) -> dict:
    kernels = AttentionKernels(flash=on_gpu, choice=implementation)  # type: ignore[arg-type]
    forward, backward, args = step_fns(shape, kernels, batch * shape.windows)
    try:
        fwd_ms = milliseconds(forward, args, iters)
        train_ms = milliseconds(backward, args, iters)
    except Exception as err:  # a kernel that fails at run time: said, not fatal to the table
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    ran = sorted({s["ran"] for s in kernels.shapes.values()})
    return {
        "forward_ms": round(fwd_ms, 3),
        "train_ms": round(train_ms, 3),
        "ran": "+".join(ran),
        "refused": next(iter(kernels.refused.values()), None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch_size", type=int, default=128, help="images")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--models", default="", help="comma-separated; default: every model above")
    p.add_argument(
        "--tag", default="", help="results file name (default: <device>-attention-shapes)"
    )
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    wanted = set(filter(None, args.models.split(",")))
    rows = []
    print(f"{'model':<32}{'attention':<20}{'blocks':>7}{'seqs':>7}{'T':>5}{'H':>4}"
          f"{'xla ms':>9}{'cudnn ms':>10}  (forward + backward)")  # fmt: skip
    for shape in SHAPES:
        if wanted and shape.model not in wanted:
            continue
        row = {**shape._asdict(), "sequences": args.batch_size * shape.windows}
        for implementation in ("xla", "cudnn"):
            row[implementation] = measure(
                shape, implementation, args.batch_size, args.iters, on_gpu
            )
        rows.append(row)
        xla, cudnn = (row[i].get("train_ms", float("nan")) for i in ("xla", "cudnn"))
        print(f"{shape.model:<32}{shape.name:<20}{shape.blocks:>7}{row['sequences']:>7}"
              f"{shape.tokens:>5}{shape.heads:>4}{xla:>9.2f}{cudnn:>10.2f}"
              f"  cudnn ran {row['cudnn'].get('ran', '-')}", flush=True)  # fmt: skip
        per_model = write(rows, args)  # after each shape: a run stopped early keeps its rows
    for model, totals in per_model.items():
        print(f"{model}: one step's attention, forward + backward: "
              f"xla {totals['xla']:.1f} ms, cudnn {totals['cudnn']:.1f} ms")  # fmt: skip
    return 0


def write(rows: list[dict], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The results file as it stands; each model's attention per step (its blocks summed)."""
    per_model: dict[str, dict[str, float]] = {}
    for row in rows:
        totals = per_model.setdefault(row["model"], {"xla": 0.0, "cudnn": 0.0})
        for implementation in totals:
            ms = row[implementation].get("train_ms", float("nan"))
            totals[implementation] += ms * row["blocks"]
    device = jax.devices()[0].device_kind.lower().replace(" ", "-")
    record = {
        "settings": vars(args),
        "platform": jax.default_backend(),
        "note": "one run; each figure the mean of --iters calls after one warm-up call",
        "results": rows,
        "per_step_ms": per_model,
    }
    write_result(args.tag or f"{device}-attention-shapes", record, quiet=True)
    return per_model


if __name__ == "__main__":
    raise SystemExit(main())
