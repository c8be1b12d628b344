"""Write an image folder of real JPEG files, `train/<class>/*.JPEG` and `val/<class>/*.JPEG`: a
mock ImageNet (made up, class-coloured), or `--digits`: scikit-learn's bundled handwritten digits
(the UCI optical-recognition set, 1,797 8x8 scans in 10 classes), read offline from the package
and scaled up, with a fixed stratified split."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm


def _image(rng: np.random.Generator, colour: np.ndarray, size: int) -> Image.Image:
    """A class-coloured image with a random bright square, so classes are learnable but varied."""
    noise = rng.integers(-48, 49, size=(size, size, 3))
    pixels = np.clip(colour[None, None, :] + noise, 0, 255)
    side = int(rng.integers(size // 4, size // 2))
    y, x = rng.integers(0, size - side, size=2)
    pixels[y : y + side, x : x + side] = 255 - colour
    return Image.fromarray(pixels.astype(np.uint8), mode="RGB")


def prepare_mock_imagenet(
    out: str | Path,
    classes: int = 10,
    per_class: int = 50,
    val_per_class: int = 10,
    size: int = 48,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Create the folder tree with real JPEG files; returns its root."""
    if classes < 1 or per_class < 1 or val_per_class < 0 or size < 8:
        raise ValueError("need classes >= 1, per_class >= 1, val_per_class >= 0, size >= 8")
    root = Path(out)
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(classes, 3))
    jobs = [("train", per_class), ("val", val_per_class)]
    total = classes * (per_class + val_per_class)
    with tqdm(total=total, desc="mock-imagenet", disable=not progress) as bar:
        for split, count in jobs:
            for c in range(classes):
                folder = root / split / f"n{c:08d}"
                folder.mkdir(parents=True, exist_ok=True)
                for i in range(count):
                    _image(rng, colours[c], size).save(folder / f"{split}_{c}_{i}.JPEG", quality=90)
                    bar.update(1)
    return root


def prepare_digits(
    out: str | Path, size: int = 32, val_fraction: float = 0.2, seed: int = 0
) -> Path:
    """scikit-learn's digits as a folder: each 8x8 scan (ink 0-16) as a white-on-black JPEG of
    `size` pixels (bicubic), a stratified `val_fraction` held out; returns its root."""
    from sklearn.datasets import load_digits  # ships inside scikit-learn: no download

    digits = load_digits()
    root = Path(out)
    rng = np.random.default_rng(seed)
    for label in range(10):
        index = rng.permutation(np.flatnonzero(digits.target == label))
        held = round(len(index) * val_fraction)
        for split, part in (("val", index[:held]), ("train", index[held:])):
            folder = root / split / f"digit_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
                image = Image.fromarray(pixels, mode="L").resize(
                    (size, size), Image.Resampling.BICUBIC
                )
                image.convert("RGB").save(folder / f"{i:04d}.JPEG", quality=95)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accel-prepare", description=__doc__, allow_abbrev=False)
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=50, help="training images per class")
    parser.add_argument("--val-per-class", type=int, default=10)
    parser.add_argument("--size", type=int, default=48, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--digits", action="store_true", help="scikit-learn's handwritten digits (real scans)"
    )
    args = parser.parse_args(argv)
    try:
        if args.digits:
            root = prepare_digits(args.out, size=32, seed=args.seed)
        else:
            root = prepare_mock_imagenet(
                args.out, args.classes, args.per_class, args.val_per_class, args.size, args.seed
            )
    except ValueError as err:
        print(f"accel-prepare: error: {err}", file=sys.stderr)
        return 2
    print(f"{'digits' if args.digits else 'mock ImageNet'} written to {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
