"""Benchmark: how many images a data-loader worker prepares per second, and where its time goes.

Real JPEGs written by accel-prepare (`--size` pixels square, noisy: slower to decode than a
typical photo), the training path (random-resized crop to `--image_size`, flip, mixup/cutmix at
collate time). Per image in one process: open and decode at full size, decode at reduced scale
(PIL's draft mode), the whole train transform with and without draft decoding. Then the real
train loader with `--workers` worker processes, with and without draft decoding, and with
decoding in the training process on each device of `--decode_on` (cuda: nvJPEG; cpu: the same
path on the CPU), where the workers only read headers and bytes. Written to
bench/results/<tag>.json with the device and versions.

    python bench/loader.py --images 1024 --size 400 --workers 1,2 --decode_on cpu
    python bench/loader.py --images 4096 --size 400 --workers 2,8 --decode_on cuda  # on a GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from PIL import Image  # noqa: E402

from accel.cli.data.config import DataConfig, MixupConfig  # noqa: E402
from accel.cli.data.device_decode import EncodedCrop  # noqa: E402
from accel.cli.data.folder import (  # noqa: E402
    ImageFolderDataset,
    class_names,
    train_transform,
)
from accel.cli.data.loaders import build_train_loader  # noqa: E402
from accel.cli.data.prepare import prepare_mock_imagenet  # noqa: E402
from bench.compare_backends import write_result  # noqa: E402


def per_image_ms(paths: list[str], fn) -> float:
    start = time.perf_counter()
    for path in paths:
        fn(path)
    return 1000 * (time.perf_counter() - start) / len(paths)


def decode_full(path: str) -> None:
    with Image.open(path) as img:
        img.convert("RGB")


def stages(root: Path, image_size: int, count: int) -> dict[str, float]:
    """Milliseconds per image of each stage, in this process."""
    paths = [p for p, _ in ImageFolderDataset(root, "train", None).samples][:count]
    augment = DataConfig()  # the default crop and flip
    return {
        "decode_full_ms": per_image_ms(paths, decode_full),
        "train_transform_full_decode_ms": per_image_ms(
            paths, train_transform(image_size, augment, draft=False)
        ),
        "train_transform_draft_ms": per_image_ms(
            paths, train_transform(image_size, augment, draft=True)
        ),
        "device_path_worker_ms": per_image_ms(
            paths, EncodedCrop(train_transform(image_size, augment))
        ),
    }


def loader_images_per_sec(
    root: Path, args: argparse.Namespace, workers: int, draft: bool, decode_on: str = "workers"
) -> float:
    cfg = DataConfig(
        source=str(root),
        workers=workers,
        mixup=MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0),
        jpeg_draft=draft,
        decode_on=decode_on,
    )
    classes = len(class_names(root))
    loader = build_train_loader(cfg, args.image_size, args.batch_size, (0, 1), 0, classes)
    loader.batch_sampler.set_epoch(0)
    batches = iter(loader)
    next(batches)  # worker start-up is not throughput
    start, images = time.perf_counter(), 0
    for batch in batches:
        images += batch["images"].shape[0]
    return images / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--size", type=int, default=400, help="side of the JPEGs on disk")
    p.add_argument("--image_size", type=int, default=224, help="crop side fed to the model")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--workers", default="1,2", help="worker counts to measure")
    p.add_argument(
        "--decode_on", default="", help="devices to decode on in the training process: cpu, cuda"
    )
    p.add_argument("--stage_images", type=int, default=200, help="images timed per stage")
    p.add_argument("--tag", default="", help="results file name (default: derived)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        classes = 8
        root = prepare_mock_imagenet(
            Path(tmp) / "imagenet",
            classes=classes,
            per_class=args.images // classes,
            val_per_class=1,
            size=args.size,
            progress=False,
        )
        per_image = stages(root, args.image_size, args.stage_images)
        loaders = []
        for workers in (int(w) for w in args.workers.split(",")):
            for draft in (False, True):
                ips = loader_images_per_sec(root, args, workers, draft)
                loaders.append({"workers": workers, "jpeg_draft": draft, "images_per_sec": ips})
                print(
                    f"workers {workers} draft {draft}: {ips:.0f} img/s ({ips / workers:.0f} "
                    "per worker)"
                )
            for device in filter(None, args.decode_on.split(",")):
                ips = loader_images_per_sec(root, args, workers, False, device)
                loaders.append({"workers": workers, "decode_on": device, "images_per_sec": ips})
                print(f"workers {workers} decoding on {device}: {ips:.0f} img/s")
    for name, ms in per_image.items():
        print(f"{name}: {ms:.2f} ms/image ({1000 / ms:.0f} img/s)")
    record = {
        "settings": vars(args),
        "note": "one run each",
        "per_image": per_image,
        "loader": loaders,
    }
    write_result(args.tag or f"loader-{args.size}px", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
