"""The training step alone: one batch already on the device, the same step again and again, no
loader and no loop. What `compare_backends.py --fed` divides the loop's img/s by (loop
efficiency). Prints one JSON line.

    python bench/fed_step.py --backend jax --model vit_base_patch16_224 --batch_size 128 \\
        --amp_level O1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accel.cli.config import RunConfig  # noqa: E402
from accel.cli.job import build_engine  # noqa: E402
from accel.models.factory import ModelConfig, input_size  # noqa: E402


def fed_images_per_sec(cfg: RunConfig, steps: int, warmup: int) -> float:
    engine = build_engine(cfg, schedule=lambda step: 1e-4)
    size = input_size(cfg.model)[-1]
    images = torch.randint(0, 256, (cfg.batch_size, 3, size, size), dtype=torch.uint8)
    targets = torch.full((cfg.batch_size, cfg.model.num_classes), 1.0 / cfg.model.num_classes)
    (batch,) = engine.loader([(images, targets)])
    engine.fetch([engine.step_micro_batches([batch]) for _ in range(warmup)])
    engine.synchronize()
    start = time.perf_counter()
    handles = [engine.step_micro_batches([batch]) for _ in range(steps)]
    engine.fetch(handles)  # one host sync at the end, as the loop does per group
    engine.synchronize()
    return cfg.batch_size * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", required=True)
    p.add_argument("--model", default="vit_micro")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--amp_level", default="O0")
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--kernel-opt", dest="kernel_opt", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        cfg = RunConfig(
            backend=args.backend,
            model=ModelConfig(args.model, num_classes=args.num_classes),
            batch_size=args.batch_size,
            amp_level=args.amp_level,
            kernel_opt=args.kernel_opt,
            output=out,
        )
        ips = fed_images_per_sec(cfg, args.steps, args.warmup)
    print(json.dumps({"backend": args.backend, "model": args.model, "fed_images_per_sec": ips}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
