"""Benchmark: the smallest model of each of 30 timm families, trained from the same weights on the
same batches (3 AdamW steps, 4 images of 64 px, 5 classes) on every backend, each against eager.
What each backend did is recorded: the losses' largest relative distance from eager's ("as
eager" within 1e-4, else "differs"), or the line of a refusal (accel's own errors), or of a
failure (any other), and its seconds. A model that eager cannot train at 64 px is recorded as
such; every model runs in a process of its own, so that one that ends its process ends no other.

    python bench/timm_zoo.py                                   # every family, every backend
    python bench/timm_zoo.py --models convnext_atto,eva02_tiny_patch14_224 --backends jax
    python bench/timm_zoo.py --models crossvit_tiny_240 --update   # one row again, the rest kept

Written to bench/results/TAG.json (default cpu-timm-zoo) with the device and versions, and a
table to TAG.md. About an hour on a 2-core CPU, most of it inductor's and XLA's compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_backends import write_result  # noqa: E402

# family -> its smallest model in timm 1.0
FAMILIES = {
    "vit": "vit_tiny_patch16_224",
    "deit3": "deit3_small_patch16_224",
    "eva02": "eva02_tiny_patch14_224",
    "swin": "swin_tiny_patch4_window7_224",
    "cait": "cait_xxs24_224",
    "xcit": "xcit_nano_12_p16_224",
    "crossvit": "crossvit_tiny_240",
    "coat": "coat_lite_tiny",
    "pvt_v2": "pvt_v2_b0",
    "twins": "twins_pcpvt_small",
    "tiny_vit": "tiny_vit_5m_224",
    "levit": "levit_128s",
    "mobilevitv2": "mobilevitv2_050",
    "efficientvit": "efficientvit_b0",
    "fastvit": "fastvit_t8",
    "edgenext": "edgenext_xx_small",
    "poolformer": "poolformer_s12",
    "mixer": "mixer_s32_224",
    "resmlp": "resmlp_12_224",
    "convnext": "convnext_atto",
    "convnextv2": "convnextv2_atto",
    "resnet": "resnet18",
    "regnet": "regnetx_002",
    "efficientnet": "efficientnet_b0",
    "mobilenetv3": "mobilenetv3_small_050",
    "ghostnet": "ghostnet_100",
    "repvgg": "repvgg_a0",
    "hgnetv2": "hgnetv2_b0",
    "starnet": "starnet_s1",
    "mambaout": "mambaout_femto",
}
BACKENDS = ("eager", "compile", "xla", "jax")
SIZE, BATCH, CLASSES, STEPS = 64, 4, 5, 3
AS_EAGER = 1e-4  # the losses' largest relative distance from eager's still called eager's
# How accel words an error raised in the user's code while it ran the step ("RuntimeError in the
# step at FILE:LINE (...): ..."), not a refusal of its own.
MODELS_OWN_ERROR = re.compile(r"^[\w.]+ in the [\w ]+ at ")


@dataclass
class Outcome:
    """What one backend did with one model: `status` is "as eager", "differs", "refused",
    "failed" (or "eager cannot train it" for eager's own failure)."""

    model: str
    backend: str
    status: str
    distance: float | None = None  # the losses' largest relative distance from eager's
    line: str | None = None  # the refusal's or failure's first line
    seconds: float = 0.0
    losses: list[float] | None = None


def build(name: str):
    """The model with its weights drawn from seed 0, at SIZE px where it takes an image size,
    without dropout or stochastic depth (swin's default): each backend draws its own random
    numbers (docs/api.md), and the losses would differ by those draws alone."""
    import timm
    import torch

    # A convolutional net takes no img_size keyword, and a few nets no drop_path_rate.
    sized, no_drops = {"img_size": SIZE}, {"drop_rate": 0.0, "drop_path_rate": 0.0}
    for options in ({**sized, **no_drops}, no_drops, {"drop_rate": 0.0}, {}):
        torch.manual_seed(0)
        try:
            return timm.create_model(name, num_classes=CLASSES, **options)
        except TypeError:
            continue
    raise TypeError(f"timm's {name} takes none of img_size, drop_rate and drop_path_rate")


def batches() -> list:
    import torch

    g = torch.Generator().manual_seed(0)
    images = [torch.randn(BATCH, 3, SIZE, SIZE, generator=g) for _ in range(STEPS)]
    return [(x, torch.randint(0, CLASSES, (BATCH,), generator=g)) for x in images]


def cross_entropy(model, batch):
    import torch.nn.functional as F

    images, labels = batch
    return F.cross_entropy(model(images), labels)


def losses(name: str, backend: str) -> list[float]:
    """STEPS steps of `name` on `backend`, through accel as a script runs them."""
    import torch

    import accel

    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with accel.prepare(model, optimizer, cross_entropy, backend=backend, quiet=True) as engine:
        return [r.loss for r in engine.fetch([engine.step(*b) for b in batches()])]


def first_line(err: BaseException) -> str:
    """The error's type and first line, its paths relative to the project."""
    lines = str(err).replace(f"{ROOT}/", "").strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def outcome(name: str, backend: str, eager: list[float] | None) -> Outcome:
    """`backend`'s outcome on `name` against eager's losses (None: this is eager's run)."""
    from accel import AccelError

    start = time.perf_counter()
    try:
        got = losses(name, backend)
    except Exception as err:
        if eager is None:
            status = "eager cannot train it"
        elif isinstance(err, AccelError) and not MODELS_OWN_ERROR.match(str(err)):
            status = "refused"  # accel's own refusal, before or at the first step
        else:
            status = "failed"  # an error raised in the model's code, or anything else
        return Outcome(name, backend, status, line=first_line(err), seconds=seconds(start))
    if eager is None:
        return Outcome(name, backend, "as eager", 0.0, seconds=seconds(start), losses=got)
    distance = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, eager, strict=True))
    status = "as eager" if distance <= AS_EAGER else "differs"
    return Outcome(name, backend, status, distance, seconds=seconds(start), losses=got)


def seconds(start: float) -> float:
    return round(time.perf_counter() - start, 1)


def one_model(name: str, backends: tuple[str, ...]) -> list[Outcome]:
    """Eager first, then each of `backends` against it; nothing else where eager fails."""
    if "xla" in backends:  # XLA's runtime starts before the process's first backward (eager's)
        import torch_xla

        torch_xla.device()
    eager = outcome(name, "eager", None)
    if eager.status != "as eager":
        return [eager]
    return [eager, *(outcome(name, b, eager.losses) for b in backends if b != "eager")]


def in_own_process(name: str, backends: tuple[str, ...]) -> list[Outcome]:
    """one_model in a fresh interpreter (XLA's and JAX's CPU platforms): its outcomes, or one
    "failed" outcome with the end of its stderr where the process itself ended badly."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, __file__, "--one", name, "--backends", ",".join(backends)]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-2:])
        line = f"the process ended with {done.returncode}: {tail}"[:300]
        return [Outcome(name, "process", "failed", line=line, seconds=seconds(start))]
    return [Outcome(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def table(outcomes: list[Outcome], backends: tuple[str, ...]) -> str:
    """A markdown row a model: each backend's status, with its distance or its line."""

    def cell(o: Outcome | None) -> str:
        if o is None:
            return ""
        if o.line:
            return f"{o.status}: {o.line.replace('|', '/')}"
        return o.status if o.backend == "eager" else f"{o.status} ({o.distance:.1e})"

    rows = [f"| model | {' | '.join(backends)} |", "|---" * (len(backends) + 1) + "|"]
    for name in dict.fromkeys(o.model for o in outcomes):
        mine = {o.backend: o for o in outcomes if o.model == name}
        ended = mine.pop("process", None)  # in_own_process's: no backend's column is its own
        label = name if ended is None else f"{name} ({cell(ended)})"
        rows.append(f"| {label} | {' | '.join(cell(mine.get(b)) for b in backends)} |")
    return "\n".join(rows) + "\n"


def kept(tag: str, models: list[str]) -> list[Outcome]:
    """The outcomes recorded in bench/results/TAG.json of models other than `models`."""
    path = ROOT / "bench" / "results" / f"{tag}.json"
    rows = json.loads(path.read_text())["outcomes"] if path.exists() else []
    return [Outcome(**row) for row in rows if row["model"] not in models]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(FAMILIES.values()))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--tag", default="cpu-timm-zoo")
    p.add_argument("--update", action="store_true",
                   help="keep TAG.json's other models, replacing those run now")  # fmt: skip
    p.add_argument("--one", help=argparse.SUPPRESS)  # one model, its outcomes as JSON
    args = p.parse_args()
    backends = tuple(args.backends.split(","))
    if args.one:
        print(json.dumps([asdict(o) for o in one_model(args.one, backends)]))
        return
    models = args.models.split(",")
    outcomes = kept(args.tag, models) if args.update else []
    markdown = ROOT / "bench" / "results" / f"{args.tag}.md"
    for i, name in enumerate(models, 1):
        found = in_own_process(name, backends)
        outcomes += found
        said = ", ".join(f"{o.backend} {o.status}" for o in found)
        print(f"[{i}/{len(models)}] {name}: {said}", flush=True)
        # written after each model: a run stopped early keeps the models it finished
        record = {"outcomes": [asdict(o) for o in outcomes], "as_eager": AS_EAGER}
        record["models"] = len(dict.fromkeys(o.model for o in outcomes))
        write_result(args.tag, record, quiet=True)
        markdown.write_text(table(outcomes, ("eager", *[b for b in backends if b != "eager"])))
    print(markdown.read_text())


if __name__ == "__main__":
    main()
