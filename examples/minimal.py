"""The smallest training script on accel: a timm ViT, AdamW and a loss function of your own.

python examples/minimal.py --steps 20 --out runs/minimal
ACCEL_BACKEND=jax python examples/minimal.py --steps 20 --out runs/minimal-jax
"""

import argparse
import json
from pathlib import Path

import timm
import torch
from torch import nn

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
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("runs/minimal"))
    args = p.parse_args()
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    engine = accel.prepare(model, optimizer, loss_fn, clip_grad=1.0)
    data = torch.utils.data.DataLoader(colour_classes(32 * args.steps), batch_size=32)
    losses, pending = [], []
    for images, labels in engine.loader(data):
        pending.append(engine.step(images, labels))  # the whole optimizer step, on the device
        if len(pending) == 10 or len(losses) + len(pending) == args.steps:
            losses += [r.loss for r in engine.fetch(pending)]  # one host sync for the group
            print(f"step {len(losses)}: loss {losses[-1]:.4f}")
            pending.clear()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"backend": engine.backend, "losses": losses}
    (args.out / "losses.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
