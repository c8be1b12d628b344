import pytest
import torch

from accel.cli.data.config import DataConfig, MixupConfig
from accel.cli.data.loaders import build_eval_loader, build_train_loader
from accel.cli.data.sampling import PaddedEvalBatchSampler, ShardedBatchSampler
from accel.cli.data.synthetic import SyntheticImages
from accel.workers import fork_server


def test_synthetic_is_deterministic_per_index():
    a, b = SyntheticImages(10, 3, seed=1), SyntheticImages(10, 3, seed=1)
    assert torch.equal(a[4][0], b[4][0]) and a[4][1] == b[4][1]
    assert not torch.equal(a[4][0], a[5][0])
    assert a[4][0].dtype == torch.uint8


def _loader(mixup: MixupConfig, workers: int = 0, batch_size: int = 8, **kw):
    cfg = DataConfig(workers=workers, mixup=mixup, synthetic_length=64, **kw)
    return build_train_loader(cfg, 32, batch_size, (0, 1), seed=0, num_classes=10)


def test_mixup_targets_are_soft_and_batch_stays_uint8():
    loader = _loader(MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0))
    loader.batch_sampler.set_epoch(0)
    for batch in loader:
        assert batch["images"].dtype == torch.uint8
        assert batch["images"].shape == (8, 3, 32, 32)
        assert batch["targets"].shape == (8, 10)
        torch.testing.assert_close(batch["targets"].sum(1), torch.ones(8))
    # mixing really happened: most rows are not a plain smoothed one-hot (max 0.91)
    assert (batch["targets"].max(1).values < 0.9).float().mean() > 0.5


@pytest.mark.slow  # loader workers: forkserver processes
def test_batches_reproduce_exactly_whatever_the_worker_count():
    mix = MixupConfig(mixup_alpha=0.8, cutmix_alpha=1.0)
    batches = []
    for workers in (0, 2):
        loader = _loader(mix, workers=workers)
        loader.batch_sampler.set_epoch(3)
        batches.append(list(loader))
    for a, b in zip(*batches, strict=True):
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["targets"], b["targets"])


@pytest.mark.slow  # loader workers: forkserver processes
def test_mixup_switches_off_inside_persistent_workers():
    loader = _loader(MixupConfig(mixup_alpha=0.8, off_epoch=1), workers=1, persistent_workers=True)
    maxima = []
    for epoch in range(2):
        loader.batch_sampler.set_epoch(epoch)
        maxima.append(torch.cat([b["targets"].max(1).values for b in loader]))
    assert loader._iterator is not None  # the same worker served both epochs
    # epoch 0 mixed (a pair of the same class keeps a plain target, so not every row)
    assert (maxima[0] < 0.9).float().mean() > 0.5
    torch.testing.assert_close(maxima[1], torch.full_like(maxima[1], 0.91))  # plain, smoothed


def test_shards_are_disjoint_and_cover_and_reshuffle():
    shards = [ShardedBatchSampler(100, 5, rank, 4, seed=0) for rank in range(4)]
    for s in shards:
        s.set_epoch(0)
    seen = [k.index for s in shards for batch in s for k in batch]
    assert len(seen) == len(set(seen)) == 100
    first = [k.index for k in next(iter(shards[0]))]
    shards[0].set_epoch(1)
    assert [k.index for k in next(iter(shards[0]))] != first


def test_training_batches_drop_the_tail_and_resume_mid_epoch():
    sampler = ShardedBatchSampler(30, 8, seed=0)
    sampler.set_epoch(0)
    batches = list(sampler)
    assert len(batches) == 3 and all(len(b) == 8 for b in batches)
    sampler.set_epoch(0, start_batch=2)
    assert list(sampler) == batches[2:]


def test_eval_batches_are_padded_and_masked():
    cfg = DataConfig(workers=0, synthetic_length=84)  # eval split has 21 samples
    loaders = [
        build_eval_loader(cfg, 32, 4, (rank, 2), seed=0, num_classes=10) for rank in range(2)
    ]
    counts = [sum(int(b["mask"].sum()) for b in loader) for loader in loaders]
    shapes = {tuple(b["images"].shape) for loader in loaders for b in loader}
    assert sum(counts) == 21
    assert shapes == {(4, 3, 32, 32)}
    assert len(PaddedEvalBatchSampler(21, 4, 0, 2)) == len(PaddedEvalBatchSampler(21, 4, 1, 2))


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('import torch\n\nif __name__ == "__main__":\n    main()\n', True),
        ("if '__main__' == __name__:\n    main()\n", True),
        ("import torch\n\nmain()\n", False),
        ("def main():\n    if __name__ == '__main__':\n        pass\n", False),  # not top-level
        ("if __name__ != '__main__':\n    pass\n", False),
        ("def main(:\n", None),  # not Python: nothing known
    ],
)
def test_a_scripts_main_guard_is_found(tmp_path, source, found):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert fork_server.guarded(str(script)) is found
