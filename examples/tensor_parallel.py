"""A timm ViT split by tensors from your own script: each block's attention and MLP over `--tp`
ranks (Megatron's columns and rows), the other ranks splitting the data (with `--shard full`,
FSDP's shards of each other). The same global batch of 32 on any layout trains the same losses.

python examples/tensor_parallel.py --out runs/tp1
torchrun --nproc_per_node 4 examples/tensor_parallel.py --tp 2 --out runs/tp2
torchrun --nproc_per_node 4 examples/tensor_parallel.py --tp 2 --shard full --out runs/fsdp
ACCEL_BACKEND=jax ACCEL_DEVICES=2 python examples/tensor_parallel.py --tp 2 --out runs/jax-tp2
"""

import argparse
import json
from pathlib import Path

import timm
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import accel


def colour_classes(n: int, classes: int = 10, seed: int = 0) -> torch.utils.data.Dataset:
    """32 px images whose class sets their mean colour: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    colours = torch.rand(classes, 3, 1, 1, generator=torch.Generator().manual_seed(1234))
    images = colours[labels] + 0.3 * torch.randn(n, 3, 32, 32, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--shard", default="none", choices=("none", "full"))
    p.add_argument("--out", type=Path, default=Path("runs/tp"))
    args = p.parse_args()
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    engine = accel.prepare(model, optimizer, loss_fn, clip_grad=1.0, tp=args.tp, shard=args.shard)
    # Each data group reads its part of the global batch; a tensor-parallel group reads one.
    data = colour_classes(32 * args.steps)
    sampler = DistributedSampler(data, engine.data_ranks, engine.rank, shuffle=False)
    loader = DataLoader(data, batch_size=32 // engine.data_ranks, sampler=sampler)
    pending = [engine.step(images, labels) for images, labels in engine.loader(loader)]
    losses = [r.loss for r in engine.fetch(pending)]  # one host sync for the run
    print(f"{engine.backend}, tp {args.tp}: losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    weights = engine.state_dict()  # the unsplit model's tensors, on every rank
    if engine.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        shapes = {n: list(t.shape) for n, t in weights.items()}
        record = {"backend": engine.backend, "losses": losses, "shapes": shapes}
        (args.out / "losses.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
