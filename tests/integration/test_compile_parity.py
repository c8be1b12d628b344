"""torch.compile gives the eager losses (O0, relative 1e-3)."""

import pytest

from accel.distributed import DistContext
from accel.train import Trainer
from tests.helpers import micro_config


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    cfg = micro_config(tmp_path_factory.mktemp("eager"), steps=5)
    return Trainer(cfg, DistContext()).train()["losses"]


def test_compile_matches_eager_first_five_losses(tmp_path, eager_losses):
    summary = Trainer(micro_config(tmp_path, backend="compile", steps=5), DistContext()).train()
    assert summary["losses"] == pytest.approx(eager_losses, rel=1e-3)
    assert summary["compiles_after_warmup"] == 0
    assert summary["graphs_compiled"] >= 1
