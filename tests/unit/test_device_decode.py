"""JPEG decoding on the training device (--data_device gpu), run here on the CPU device: the same
code path as on a GPU but for torchvision's decoder (libjpeg-turbo instead of nvJPEG)."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from accel.cli.config import replace_path
from accel.cli.data.collate import TrainCollate
from accel.cli.data.config import DataConfig, MixupConfig
from accel.cli.data.device_decode import DeviceDecodedLoader, EncodedCrop, EncodedJpeg
from accel.cli.data.folder import BadImageError, train_transform
from accel.cli.data.jpeg_decoders import decoding_error as device_decoding_error
from accel.cli.data.loaders import build_train_loader
from accel.cli.data.sampling import SampleKey
from accel.cli.resolve import resolve_decode_on
from accel.config import AccelError
from tests.helpers import dirty_mock_imagenet, micro_config

MIX = MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0)


@pytest.fixture(scope="module")
def dirty_imagenet(tmp_path_factory) -> Path:
    return dirty_mock_imagenet(tmp_path_factory.mktemp("decode"), val_per_class=2)


def _epoch(root: Path, decode_on: str, workers: int = 0, start_batch: int = 0, **data) -> list:
    cfg = DataConfig(source=str(root), workers=workers, decode_on=decode_on, **data)
    loader = build_train_loader(cfg, 32, 4, (0, 1), seed=3, num_classes=3)
    loader.batch_sampler.set_epoch(1, start_batch)
    return list(loader)


def test_device_path_gives_the_cpu_paths_crops_targets_and_skips(dirty_imagenet):
    workers = _epoch(dirty_imagenet, "workers", mixup=MIX, jpeg_draft=False)
    device = _epoch(dirty_imagenet, "cpu", mixup=MIX)
    assert len(device) == len(workers) == 6
    for cpu, dev in zip(workers, device, strict=True):
        assert dev["images"].dtype == torch.uint8 and dev["images"].shape == (4, 3, 32, 32)
        assert dev["targets"].dtype == torch.float32 and dev["targets"].shape == (4, 3)
        assert torch.equal(dev["targets"], cpu["targets"])  # the same mixup, the same labels
        assert dev["skipped"] == cpu["skipped"]
        # Two decoders and two resamplers of the same crop: close, not equal.
        diff = (dev["images"].float() - cpu["images"].float()).abs().mean()
        assert diff < 2.0, diff
    skipped = {Path(p).name for batch in device for p in batch["skipped"]}
    assert skipped == {"truncated.jpg", "empty.jpg", "notes.png"}


@pytest.mark.slow  # loader workers: forkserver processes
def test_device_path_is_the_same_with_workers_and_after_a_resume(dirty_imagenet):
    reference = _epoch(dirty_imagenet, "cpu", mixup=MIX)
    with_workers = _epoch(dirty_imagenet, "cpu", workers=2, mixup=MIX)
    resumed = _epoch(dirty_imagenet, "cpu", start_batch=3, mixup=MIX)
    assert len(resumed) == 3
    pairs = [*zip(with_workers, reference, strict=True), *zip(resumed, reference[3:], strict=True)]
    for got, want in pairs:
        assert torch.equal(got["images"], want["images"])
        assert torch.equal(got["targets"], want["targets"])


def test_mix_plan_mixes_like_timms_fast_collate_mixup():
    """Mixup drawn ahead and applied to decoded images equals FastCollateMixup on the host."""
    collate = TrainCollate(5, 0.1, MIX, seed=7)
    rng = np.random.default_rng(0)
    kinds = set()
    for batch in range(8):
        images = rng.integers(0, 256, (6, 3, 16, 16), dtype=np.uint8)
        keys = [SampleKey(i, 0, batch) for i in range(6)]
        samples = [(torch.from_numpy(images[i]), i % 5, (), keys[i], None) for i in range(6)]
        host = collate(samples)
        plan = collate.mix_plan(keys[0], (6, 3, 16, 16))
        kinds.add(plan.box is not None)
        assert torch.equal(plan.apply(torch.from_numpy(images)), host["images"])
        labels = torch.tensor([s[1] for s in samples])
        assert torch.equal(collate.targets(labels, plan), host["targets"])
    assert kinds == {True, False}  # both cutmix and mixup batches were drawn


def test_a_jpeg_cut_short_is_decoded_by_its_worker_never_by_the_device(dirty_imagenet, tmp_path):
    """nvJPEG decodes a truncated file, filling in the rest, where the CPU path skips it: a worker
    sends the device only files that end with JPEG's end-of-image marker."""
    folder = dirty_imagenet / "train" / "n00000000"
    crop = EncodedCrop(train_transform(32, DataConfig(), draft=False))
    whole = next(folder.glob("*.JPEG"))
    assert isinstance(crop(str(whole)), EncodedJpeg)
    with pytest.raises(OSError, match="truncated"):  # PIL's decode on the worker: skipped there
        crop(str(folder / "truncated.jpg"))
    trailing = tmp_path / "trailing.jpg"  # bytes after the image: whole, but decoded on the CPU
    trailing.write_bytes(whole.read_bytes() + bytes(16))
    decoded = seeded(0, crop, str(trailing))
    assert torch.equal(decoded, seeded(0, crop.cpu, str(whole)))  # the CPU path's crop of it


def seeded(seed: int, transform, path: str) -> torch.Tensor:
    """A crop with its draws fixed: the box from Python's stream (timm), the flips from torch's."""
    random.seed(seed)
    torch.manual_seed(seed)
    return transform(path)


def test_strict_data_stops_at_the_first_bad_file_on_the_device_path(dirty_imagenet):
    cfg = DataConfig(source=str(dirty_imagenet), workers=0, decode_on="cpu", strict=True)
    loader = build_train_loader(cfg, 32, 4, (0, 1), seed=3, num_classes=3)
    assert isinstance(loader, DeviceDecodedLoader)
    loader.batch_sampler.set_epoch(1)
    with pytest.raises(BadImageError, match=r"(truncated|empty)\.jpg|notes\.png"):
        list(loader)


def test_no_gpu_decoder_is_found_on_a_cpu_build_and_the_run_falls_back(monkeypatch, tmp_path):
    assert device_decoding_error(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert device_decoding_error(torch.device("cuda"))  # one line: why not
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if a GPU were seen
        cfg = micro_config(tmp_path, source=str(tmp_path), data_device="auto")
        decode_on, note = resolve_decode_on(cfg)
        assert "no GPU JPEG decoder" in note and "CPU workers" in note
        assert decode_on == "workers"


@pytest.mark.parametrize(
    ("source", "backend", "reason"),
    [
        ("synthetic", "eager", "no JPEGs to decode"),
        ("folder", "xla", "xla backend does not take batches decoded on the GPU"),
    ],
)
def test_data_device_gpu_where_it_cannot_work_is_refused(tmp_path, source, backend, reason):
    cfg = micro_config(tmp_path, backend=backend, source=source, data_device="gpu")
    gpu_decoding = backend != "xla"  # what the backends' Supports tables say
    with pytest.raises(AccelError, match=f"--data_device gpu: .*{reason}"):
        resolve_decode_on(cfg, gpu_decoding)
    cfg = replace_path(cfg, "data.data_device", "auto")
    assert resolve_decode_on(cfg, gpu_decoding) == ("workers", None)


AUGMENT = {
    "aa": "rand-m9-mstd0.5-inc1",
    "reprob": 0.5,
    "recount": 2,
    "scale": (0.3, 1.0),
    "vflip": 0.3,
    "train_interpolation": "random",
}


@pytest.mark.slow  # loader workers: forkserver processes
@pytest.mark.parametrize("decode_on", ["workers", "cpu"], ids=["cpu-decode", "device-decode"])
def test_augmented_batches_are_the_same_with_workers_and_after_a_resume(dirty_imagenet, decode_on):
    """RandAugment, erasing, crops and flips drawn per sample from its key: the same batches
    with 0 or 2 workers and from a resumed epoch, on both decode paths."""
    reference = _epoch(dirty_imagenet, decode_on, mixup=MIX, **AUGMENT)
    with_workers = _epoch(dirty_imagenet, decode_on, workers=2, mixup=MIX, **AUGMENT)
    resumed = _epoch(dirty_imagenet, decode_on, start_batch=3, mixup=MIX, **AUGMENT)
    plain = _epoch(dirty_imagenet, decode_on, mixup=MIX)
    pairs = [*zip(with_workers, reference, strict=True), *zip(resumed, reference[3:], strict=True)]
    for got, want in pairs:
        for key in ("images", "targets", "erase"):
            assert torch.equal(got[key], want[key]), key
    assert "erase" not in plain[0]
    boxes = torch.cat([b["erase"] for b in reference])
    erased = (boxes[..., 1] > boxes[..., 0]).any(-1).float().mean()
    assert 0.2 < erased < 0.8  # about --reprob 0.5 of the samples carry a rectangle
    changed = [
        not torch.equal(a["images"], b["images"]) for a, b in zip(reference, plain, strict=True)
    ]
    assert all(changed)
