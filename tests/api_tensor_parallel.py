"""A user's script training a model split by tensors, for the public API's tests: a torchvision
Swin-T (shrunk; its blocks found by module type) or a model of the user's own with a plan. Each
data group trains on its part of the same global batches; writes the losses and the trained
weights to OUT/result.json and its checkpoint to OUT/checkpoint.

    python -m tests.api_tensor_parallel MODEL BACKEND DEVICES TP SHARD OUT
    torchrun --nproc_per_node 4 -m tests.api_tensor_parallel swin eager 1 2 none OUT
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torchvision.models import SwinTransformer

import accel
from tests.helpers import api_loss_fn, colour_batches


class MlpNet(nn.Module):
    """A user's own model: a conv stem, then an MLP whose two linear layers the plan splits."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x).mean((2, 3))
        return self.head(features + self.fc2(nn.functional.gelu(self.fc1(features))))


PLAN = {"fc1": "colwise", "fc2": "rowwise"}


def swin() -> nn.Module:
    return SwinTransformer(
        patch_size=[2, 2], embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=[2, 2],
        stochastic_depth_prob=0.0, num_classes=5,
    )  # fmt: skip


def build(name: str) -> tuple[nn.Module, dict | None]:
    torch.manual_seed(0)
    return (swin(), None) if name == "swin" else (MlpNet(), PLAN)


def main() -> None:
    name, backend, devices, tp, shard = sys.argv[1:6]
    out = Path(sys.argv[6])
    out.mkdir(parents=True, exist_ok=True)
    model, plan = build(name)
    engine = accel.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), api_loss_fn, backend=backend,
        devices=int(devices), tp=int(tp), tp_plan=plan, shard=shard, clip_grad=1.0, quiet=True,
    )  # fmt: skip
    rank, part = engine.rank, 16 // engine.data_ranks  # a tp group reads the same part
    mine = [tuple(t[rank * part : (rank + 1) * part] for t in b) for b in colour_batches(5)]
    losses = [r.loss for r in engine.fetch([engine.step(*b) for b in engine.loader(mine)])]
    state = engine.state_dict()  # whole, on the host (split weights gathered)
    engine.save(out / "checkpoint")
    if engine.is_main:
        record = {
            "losses": losses,
            "weights": {n: t.float().flatten().tolist() for n, t in state.items()},
            "shapes": {n: list(t.shape) for n, t in state.items()},
            "state_bytes": engine.stats().state_bytes,
        }
        (out / "result.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
