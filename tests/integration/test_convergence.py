"""Training to accuracy on real images: scikit-learn's handwritten digits (1,797 8x8 scans that
ship inside the package, written out as 32-px JPEGs offline by data.prepare.prepare_digits),
vit_micro for 4 epochs with augmentation fitting centred digits (bench/convergence.py's flags,
with a learning rate of 3e-3 for the short schedule; that script runs 15 epochs and draws the
curves). eager reaches 0.6 top-1 (0.66 when measured); xla and jax land within 0.1 of it."""

from __future__ import annotations

import pytest

from accel.cli.data.prepare import prepare_digits
from bench.convergence import BACKENDS, FLAGS, curves
from tests.helpers import DEFAULT_XLA, INSTALLED, train, train_forked

EPOCHS, LR, EAGER_TOP1, DISTANCE = 4, "3e-3", 0.6, 0.1


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    data = prepare_digits(tmp_path_factory.mktemp("digits"))
    # The installed backends but compile, which trains eager's numbers with inductor's kernels
    # (its losses are eager's to 1e-5 in every parity test; bench/convergence.py draws its
    # curve), and would add 30 s of the suite's time; without torch_xla (make test-latest) two.
    backends = tuple(b for b in BACKENDS if b in INSTALLED and b != "compile")
    # bench/convergence.py's flags, the images decoded in the training process: the batches
    # its loader workers give (test_user_commands.py), without a fork server and workers to start.
    flags = (*FLAGS, "--data", str(data), "--epochs", str(EPOCHS), "--lr", LR, "--workers", "0")
    # In this process, but jax in a process of its own (forked from the suite's server, its JAX
    # started with the flags given: helpers.train_forked) with XLA's default code generation: its
    # four epochs of steps outweigh the compiles (10 s a run against 26 s at the suite's lowest
    # level, which this process's JAX has already read); torch_xla's run is the other way round
    # (22 s against 26 s), its steps held back by tracing more than by code generation.
    runs = {}
    for b in backends:
        output = tmp_path_factory.mktemp(b)
        if b == "jax":
            runs[b] = train_forked(output, *flags, "--backend", b, env=DEFAULT_XLA)[0]
        else:
            runs[b] = train(output, *flags, "--backend", b)[0]
    return runs


def test_the_digits_folder_is_the_real_dataset(tmp_path):
    root = prepare_digits(tmp_path)
    counts = {split: len(list((root / split).glob("*/*.JPEG"))) for split in ("train", "val")}
    assert counts == {"train": 1438, "val": 359}
    assert sorted(p.name for p in (root / "train").iterdir()) == [f"digit_{d}" for d in range(10)]


@pytest.mark.slow  # three backends, four epochs each, through the command line
def test_eager_reaches_the_stated_accuracy_and_xla_and_jax_follow(runs):
    table = curves(runs)
    assert all(len(values) == EPOCHS for values in table.values())
    assert table["eager"][-1] >= EAGER_TOP1
    assert table["eager"][-1] > table["eager"][0] + 0.3  # it learned, epoch after epoch
    for backend, values in table.items():
        assert abs(values[-1] - table["eager"][-1]) <= DISTANCE, backend
