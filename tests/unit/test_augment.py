"""Each augmentation flag changes the images as timm's own training transform would: the same
distributions (two-sample Kolmogorov-Smirnov distance, small) where timm's transform draws from
generators of its own, and a clear change from the flag's default. The crops are read back from
an image whose pixels hold their own coordinates."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing
from timm.data.transforms_factory import transforms_imagenet_train

from accel.cli.data.augment import erase_boxes, with_safe_posterize
from accel.cli.data.config import DataConfig
from accel.cli.data.folder import RandomResizedCropDecode
from accel.cli.data.loaders import keyed_randomness
from accel.cli.data.sampling import ShardedBatchSampler
from accel.cli.models.erasing import random_erase

SIDE, OUT, DRAWS = 96, 32, 300
SAME, DIFFERENT = 0.15, 0.3  # KS distances: within sampling noise at 300 draws; far outside it


def ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    cdf = lambda x: np.searchsorted(x, grid, side="right") / len(x)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


@pytest.fixture(scope="module")
def coordinates(tmp_path_factory) -> str:
    """A PNG whose red channel is x and green channel is y (0-255 across the image)."""
    ramp = np.linspace(0, 255, SIDE).round().astype(np.uint8)
    pixels = np.stack(
        [np.tile(ramp, (SIDE, 1)), np.tile(ramp[:, None], (1, SIDE)), np.full((SIDE, SIDE), 128)],
        axis=-1,
    ).astype(np.uint8)
    path = tmp_path_factory.mktemp("aug") / "coordinates.png"
    Image.fromarray(pixels).save(path)
    return str(path)


def ours(path: str, cfg: DataConfig) -> list[np.ndarray]:
    transform = RandomResizedCropDecode(OUT, cfg, draft=False)
    out = []
    for seed in range(DRAWS):
        with keyed_randomness(seed):
            out.append(transform(path).permute(1, 2, 0).numpy().astype(float))
    return out


def timms(path: str, cfg: DataConfig) -> list[np.ndarray]:
    transform = transforms_imagenet_train(
        OUT,
        scale=cfg.scale,
        ratio=cfg.ratio,
        hflip=cfg.hflip,
        vflip=cfg.vflip,
        color_jitter=cfg.color_jitter or None,
        auto_augment=cfg.aa or None,
        interpolation=cfg.train_interpolation,
        use_prefetcher=True,
    )
    torch.manual_seed(12345)
    np.random.seed(12345)
    with Image.open(path) as img:
        image = img.convert("RGB")
    transform = with_safe_posterize(transform)  # Pillow 12 refuses timm's 0-bit posterize
    return [np.asarray(transform(image)).transpose(1, 2, 0).astype(float) for _ in range(DRAWS)]


def geometry(images: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The crop each image shows: its area fraction, log aspect, and whether it is mirrored or
    upside down (read from the coordinate channels at its edges)."""
    x0, x1 = (np.array([im[:, col, 0].mean() for im in images]) for col in (0, -1))
    y0, y1 = (np.array([im[row, :, 1].mean() for im in images]) for row in (0, -1))
    width, height = np.abs(x1 - x0) / 255, np.abs(y1 - y0) / 255
    return {
        "area": width * height,
        "aspect": np.log(width / height),
        "mirrored": (x1 < x0).astype(float),
        "upside_down": (y1 < y0).astype(float),
    }


def colour(images: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "brightness": np.array([im.mean() for im in images]),
        "contrast": np.array([im.std() for im in images]),
        "blue": np.array([im[..., 2].mean() for im in images]),
    }


GEOMETRIC = [
    ({"scale": (0.5, 1.0)}, "area"),
    ({"scale": (0.08, 0.3)}, "area"),
    ({"ratio": (0.5, 0.6)}, "aspect"),
    ({"hflip": 0.0}, "mirrored"),
    ({"vflip": 0.5}, "upside_down"),
]
COLOUR = [
    ({"color_jitter": 0.4}, "brightness"),
    ({"aa": "rand-m9-mstd0.5-inc1"}, "blue"),
    ({"aa": "augmix"}, "contrast"),
    ({"aa": "original"}, "blue"),
]


@pytest.mark.parametrize(
    ("flags", "statistic"), GEOMETRIC + COLOUR, ids=lambda v: str(v) if isinstance(v, dict) else v
)
def test_each_flag_changes_the_batch_as_timm_does(coordinates, flags, statistic):
    geometric = (flags, statistic) in GEOMETRIC
    # Colour flags are measured on the whole image, unflipped: the crop's own spread of colours
    # would hide theirs.
    base = DataConfig() if geometric else DataConfig(scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0)
    cfg = dataclasses.replace(base, **flags)
    measure = geometry if geometric else colour
    mine = measure(ours(coordinates, cfg))[statistic]
    reference = measure(timms(coordinates, cfg))[statistic]
    default = measure(ours(coordinates, base))[statistic]
    assert ks(mine, reference) < SAME, "a different distribution from timm's transform"
    assert ks(mine, default) > DIFFERENT, "the flag changed nothing"


def test_interpolation_draws_both_resamplings_when_random(coordinates):
    cfg = DataConfig(train_interpolation="random")
    transform = RandomResizedCropDecode(OUT, cfg, draft=False)
    drawn = []
    for seed in range(40):
        with keyed_randomness(seed):
            drawn.append(transform.resample())
    assert {Image.Resampling.BILINEAR, Image.Resampling.BICUBIC} == set(drawn)
    bicubic = RandomResizedCropDecode(OUT, DataConfig(train_interpolation="bicubic"), False)
    bilinear = RandomResizedCropDecode(OUT, DataConfig(), False)
    with keyed_randomness(0):
        a = bicubic(coordinates)
    with keyed_randomness(0):
        b = bilinear(coordinates)
    assert not torch.equal(a, b)  # the same crop, resampled differently


def _erased(cfg: DataConfig, ours_: bool) -> list[torch.Tensor]:
    """Masks of erased pixels and the fills of 300 images of 5.0 (no fill draws 5.0)."""
    timm_erase = RandomErasing(cfg.reprob, mode=cfg.remode, max_count=cfg.recount, device="cpu")
    out = []
    for seed in range(DRAWS):
        image = torch.full((1, 3, OUT, OUT), 5.0)
        if ours_:
            with keyed_randomness(seed):
                boxes = torch.from_numpy(erase_boxes(cfg, OUT, OUT, seed))
            image = random_erase(image, boxes[None])
        else:
            image = timm_erase(image)
        out.append(image[0])
    return out


@pytest.mark.parametrize(
    "cfg",
    [
        DataConfig(reprob=0.25, remode="pixel"),
        DataConfig(reprob=0.8, remode="rand"),
        DataConfig(reprob=0.5, remode="const", recount=3),
    ],
    ids=["pixel", "rand", "const-3"],
)
def test_random_erasing_draws_as_timms(cfg):
    torch.manual_seed(0)
    mine, theirs = _erased(cfg, True), _erased(cfg, False)
    area = lambda images: [float((im != 5.0).any(0).float().mean()) for im in images]  # noqa: E731
    assert ks(area(mine), area(theirs)) < SAME
    erased = [im for im in mine if (im != 5.0).any()]
    assert len(erased) / DRAWS == pytest.approx(cfg.reprob, abs=0.08)
    fills = torch.cat([im[im != 5.0] for im in erased])
    if cfg.remode == "const":
        assert torch.all(fills == 0)
    else:  # standard normal values, per pixel or one per channel
        assert fills.mean().abs() < 0.15 and fills.std() == pytest.approx(1.0, abs=0.15)
        per_channel = [im[c][im[c] != 5.0].unique().numel() for im in erased for c in range(3)]
        assert max(per_channel) == 1 if cfg.remode == "rand" else min(per_channel) > 1


def test_repeated_augmentation_spreads_each_image_over_ranks():
    """--aug_repeats 3 over 3 ranks: an epoch shows each chosen image 3 times, once per rank
    (timm's RepeatAugSampler), and each rank still sees len/ranks samples."""
    length, ranks = 48, 3
    seen = {}
    for rank in range(ranks):
        sampler = ShardedBatchSampler(length, 4, rank, ranks, seed=0, repeats=3)
        sampler.set_epoch(0)
        keys = [k for batch in sampler for k in batch]
        assert len(keys) == len(sampler) * 4 == length // ranks
        for key in keys:
            seen.setdefault(key.index, []).append((rank, key.repeat))
    copies = [len(v) for v in seen.values()]
    assert max(copies) <= 3 and np.mean(copies) > 2.5
    assert all(len({r for r, _ in v}) == len(v) for v in seen.values())  # never twice on a rank


def test_full_magnitude_posterize_runs_on_this_pillow():
    """timm asks Pillow for a 0-bit posterize at magnitude 10 (m9 plus noise); ours blacks the
    image as older Pillow did instead of failing the worker."""
    from timm.data import auto_augment

    from accel.cli.data.augment import secondary

    stage = secondary(DataConfig(aa="rand-m9-mstd0.5-inc1"), OUT)
    ops = [op for t in stage.transforms for op in getattr(t, "ops", [])]
    posterize = [op for op in ops if "Posterize" in op.name]
    assert posterize and all(op.aug_fn is not auto_augment.posterize for op in posterize)
    image = Image.new("RGB", (8, 8), (200, 100, 50))
    assert np.asarray(posterize[0].aug_fn(image, 0)).max() == 0
    assert np.asarray(posterize[0].aug_fn(image, 8)).max() == 200
