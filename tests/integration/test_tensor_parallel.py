"""--tp_head: the classifier split by class over the ranks of a tp group (2 and 4 gloo
processes), trained to the losses of the unsplit run, checkpointed in the ordinary format."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from accel.backends.torch_family.named_state import local_bytes
from accel.config import MeshConfig
from accel.distributed import destroy_process_group
from accel.logits import ClassShards
from accel.parallel import tp_head
from accel.parallel.mesh import MeshAxis, ParallelDims
from tests.helpers import checkpoint_tensors, train, train_ranks
from tests.shared_runs import TP_JOB

pytestmark = pytest.mark.slow

JOB = TP_JOB


def _run(output: Path, *extra: str) -> tuple[dict, str]:
    return train_ranks(output, *JOB, *extra)


@pytest.fixture
def runs(tp_runs):
    return tp_runs


def test_tp_head_trains_the_single_process_losses(runs):
    _, single, _ = runs["single"]
    _, split, stdout = runs["tp2"]
    assert "accel: mesh dp 1 x tp 2 (2 processes)" in stdout
    assert "11 classes over tp 2: the classifier is padded to 12 rows" in stdout
    np.testing.assert_allclose(split["losses"][:5], single["losses"][:5], rtol=1e-5)
    np.testing.assert_allclose(split["eval_loss"], single["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(split["eval_loss_ema"], single["eval_loss_ema"], rtol=1e-5)
    assert split["eval_acc"] == single["eval_acc"]  # top-1 from the shards' best
    assert split["tp_head"] == 2 and split["global_batch_size"] == single["global_batch_size"]
    classifier = split["state_bytes"]["classifier"] / single["state_bytes"]["classifier"]
    assert classifier <= 6 / 11 + 1e-6  # 6 of 11 rows: half, and the padding row


def test_dp2_by_tp2_trains_the_ddp_losses(runs):
    _, ddp, _ = runs["ddp2"]
    _, mesh, stdout = runs["dp2xtp2"]
    assert "accel: mesh dp 2 x tp 2 (4 processes)" in stdout
    np.testing.assert_allclose(mesh["losses"][:5], ddp["losses"][:5], rtol=1e-5)
    np.testing.assert_allclose(mesh["eval_loss"], ddp["eval_loss"], rtol=1e-5)


def test_tp_checkpoint_holds_the_whole_classifier_and_resumes_exactly(runs, tmp_path):
    output, split, _ = runs["tp2"]
    checkpoints = output / "vit_micro" / "eager" / "r" / "checkpoints"
    saved = checkpoint_tensors(checkpoints / "step_00000006.dcp")
    assert saved["model.model.head.weight"].shape == (11, 64)  # the padding row left out
    assert saved["optim.model.head.weight.exp_avg"].shape == (11, 64)
    assert saved["ema.model.head.weight"].shape == (11, 64)
    plain, _ = train(tmp_path / "plain", *JOB, "--resume", str(checkpoints / "step_00000006.dcp"))
    np.testing.assert_allclose(plain["eval_loss"], split["eval_loss"], rtol=1e-5)
    resumed, _ = _run(
        tmp_path / "resumed",
        *("--nproc_per_node", "2", "--tp_head", "2"),
        *("--resume", str(checkpoints / "step_00000002.dcp")),
    )
    assert resumed["losses"] == split["losses"]
    assert resumed["eval_loss_ema"] == split["eval_loss_ema"]


def test_a_split_head_checkpoint_reshards_into_fsdp_and_back(runs, tmp_path):
    """tp 2 -> FSDP over 2 ranks -> tp 2: every layout loads every other's checkpoint."""
    output, split, _ = runs["tp2"]
    last = output / "vit_micro" / "eager" / "r" / "checkpoints" / "step_00000006.dcp"
    # Two data-parallel ranks of 4 images: the global batch of the split head's run.
    fsdp = ("--nproc_per_node", "2", "--shard", "full", "--batch_size", "4")
    sharded, _ = _run(tmp_path / "fsdp", *fsdp, "--resume", str(last))
    np.testing.assert_allclose(sharded["eval_loss"], split["eval_loss"], rtol=1e-5)
    back = tmp_path / "fsdp" / "vit_micro" / "eager" / "r" / "checkpoints" / "step_00000006.dcp"
    again, _ = _run(
        tmp_path / "tp", "--nproc_per_node", "2", "--tp_head", "2", "--resume", str(back)
    )
    np.testing.assert_allclose(again["eval_loss"], split["eval_loss"], rtol=1e-5)


class LargestExtent(TorchDispatchMode):
    """The longest axis of any tensor an op returned while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim():
                self.largest = max(self.largest, max(t.shape))
        return out


class Classifier(nn.Module):
    """A feature layer and a 1,000,000-class head, found the way timm models expose theirs."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.body = nn.Linear(features, features)
        self.head = nn.Linear(features, classes)

    def get_classifier(self) -> nn.Linear:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _shards_against_whole(layout: MeshAxis) -> dict:
    """ClassShards' cross-entropy (soft and label targets, and its gradient) and top-k against
    the whole logits' own, over 7 classes split in two (the second rank's last column padding)."""
    torch.manual_seed(1)
    whole = torch.randn(6, 7, requires_grad=True)
    soft, labels = torch.softmax(torch.randn(6, 7), -1), torch.randint(0, 7, (6,))
    head = tp_head.ShardedClassifier(nn.Linear(1, 7), layout)
    local = head.forward(torch.zeros(6, 1)).detach()  # the padding's fill where it pads
    local[:, : head.valid] = whole.detach()[:, head.start : head.start + head.valid]
    local.requires_grad_(True)
    shards = ClassShards(local, head)
    found = torch.stack([shards.cross_entropy(soft), shards.cross_entropy(labels)])
    ce = nn.functional.cross_entropy
    expected = torch.stack([ce(whole, soft, reduction="none"), ce(whole, labels, reduction="none")])
    found.sum().backward()
    expected.sum().backward()
    grads = local.grad[:, : head.valid] - whole.grad[:, head.start : head.start + head.valid]
    return {
        "loss_error": float((found - expected).abs().max()),
        "grad_error": float(grads.abs().max()),
        "top_same": bool((shards.topk(5) == whole.topk(5, dim=-1).indices).all()),
    }


def _million_class_rank(rank: int, port: int, result: Path) -> None:
    """One step's forward and backward through a 1,000,000-class head split over 2 ranks."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        classes, features, batch = 1_000_000, 192, 4
        model = Classifier(features, classes)
        mesh = ParallelDims.of(MeshConfig(tp_head=2), world=2).build("cpu")
        layout = MeshAxis.of(mesh, "tp")
        full_bytes = local_bytes(list(model.head.parameters()))
        head = tp_head.apply_tp_head(model, layout)
        targets = torch.full((batch, classes), 0.1 / classes)
        targets[torch.arange(batch), torch.arange(batch)] += 0.9
        x = torch.randn(batch, features)
        with LargestExtent() as seen:
            loss = ClassShards(model(x), head).cross_entropy(targets).mean()
            loss.backward()
        record = {
            "largest": seen.largest,
            "head_bytes": local_bytes(list(head.parameters())),
            "full_bytes": full_bytes,
            "loss": loss.item(),
            **_shards_against_whole(layout),
        }
        (result / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        destroy_process_group()


def test_a_million_classes_split_in_two_never_makes_full_logits(tmp_path, free_port):
    args = (free_port(), tmp_path)
    mp.start_processes(_million_class_rank, args=args, nprocs=2, start_method="forkserver")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    classes = 1_000_000
    for r in ranks:
        assert r["head_bytes"] <= 0.5 * r["full_bytes"] + 1024
        # No tensor made in the step spans more than half the classes: the logits, their
        # softmax and the head's gradient are all (.., classes / 2); full logits would not be.
        assert r["largest"] == classes // 2
    assert ranks[0]["loss"] == ranks[1]["loss"]  # reduced over the shards: one value
    for r in ranks:  # the split logits' collectives give the whole logits' values
        assert r["loss_error"] < 1e-5 and r["grad_error"] < 1e-6
        assert r["top_same"]
