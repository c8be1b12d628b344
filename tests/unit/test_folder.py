from pathlib import Path

import pytest
import torch
from PIL import Image

from accel.cli.data.config import DataConfig
from accel.cli.data.folder import BadImageError, DatasetError, ImageFolderDataset, eval_transform
from accel.cli.data.loaders import build_train_loader
from tests.helpers import dirty_mock_imagenet


@pytest.fixture(scope="module")
def mock_imagenet(tmp_path_factory) -> Path:
    return dirty_mock_imagenet(tmp_path_factory.mktemp("mock"), val_per_class=2)


def test_prepare_writes_real_jpegs_in_imagenet_layout(mock_imagenet):
    train = sorted((mock_imagenet / "train").iterdir())
    assert len(train) == 3 and len(list((mock_imagenet / "val").iterdir())) == 3
    with Image.open(next(train[1].glob("*.JPEG"))) as img:
        assert img.format == "JPEG" and img.size == (40, 40)


def test_bad_files_are_skipped_and_odd_modes_converted(mock_imagenet):
    ds = ImageFolderDataset(mock_imagenet, "train", eval_transform(32))
    by_path = {path: i for i, (path, _) in enumerate(ds.samples)}
    skipped = set()
    for i in range(len(ds)):
        image, _, paths = ds.load(i)
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
        skipped.update(paths)
    names = {Path(p).name for p in skipped}
    assert names == {"truncated.jpg", "empty.jpg", "notes.png"}
    for kind in ("gray.jpg", "rgba.png", "cmyk.jpg"):
        idx = next(i for p, i in by_path.items() if p.endswith(kind))
        assert ds.load(idx)[2] == ()  # loaded itself, not replaced


def test_strict_data_stops_at_the_first_bad_file_with_its_path(mock_imagenet):
    ds = ImageFolderDataset(mock_imagenet, "train", eval_transform(32), strict=True)
    with pytest.raises(BadImageError, match=r"(truncated|empty)\.jpg|notes\.png"):
        for i in range(len(ds)):
            ds.load(i)


def test_training_loader_decodes_jpegs_with_augmentation(mock_imagenet):
    cfg = DataConfig(source=str(mock_imagenet), workers=0)
    loader = build_train_loader(cfg, 32, 4, (0, 1), seed=0, num_classes=3)
    loader.batch_sampler.set_epoch(0)
    batch = next(iter(loader))
    assert batch["images"].shape == (4, 3, 32, 32) and batch["targets"].shape == (4, 3)


def test_missing_and_empty_folders_are_reported(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        ImageFolderDataset(tmp_path / "nope", "train", eval_transform(32))
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(DatasetError, match="empty"):
        ImageFolderDataset(tmp_path / "empty", "train", eval_transform(32))


def test_splits_number_classes_alike_when_a_folder_is_empty_or_missing(tmp_path):
    root = dirty_mock_imagenet(tmp_path, val_per_class=2)
    (root / "train" / "a_empty").mkdir()  # sorts first: every index after it shifts by one
    val_classes = sorted(p.name for p in (root / "val").iterdir())
    (root / "val" / val_classes[0]).rename(root / "val" / "zz_unknown")  # not a train class
    with pytest.warns(UserWarning, match="kept as classes: a_empty$"):
        train = ImageFolderDataset(root, "train", eval_transform(32))
    with pytest.warns(UserWarning, match=f"kept as classes: a_empty, {val_classes[0]}$"):
        val = ImageFolderDataset(root, "val", eval_transform(32))
    assert val.classes == train.classes and train.classes[0] == "a_empty"
    for path, label in val.samples:
        assert train.classes[label] == Path(path).parent.name
    assert {label for _, label in val.samples} == {2, 3}
