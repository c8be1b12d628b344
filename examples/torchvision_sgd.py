"""A torchvision model (ViT-B/16 or Swin-T, shrunk for a CPU) trained with SGD and Nesterov
momentum through accel, with no timm in sight.

    python examples/torchvision_sgd.py --model swin_t --steps 20 --out runs/tv-swin
    ACCEL_BACKEND=xla python examples/torchvision_sgd.py --model vit_b_16 --out runs/tv-vit
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torchvision.models import SwinTransformer, VisionTransformer

import accel

# torchvision's own classes, as vit_b_16() and swin_t() build them, at a size a CPU trains.
MODELS = {
    "vit_b_16": lambda: VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    ),
    "swin_t": lambda: SwinTransformer(
        patch_size=[4, 4], embed_dim=24, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=10,  # no random draws: backends compare
    ),
}  # fmt: skip


def colour_classes(n: int, classes: int = 10, seed: int = 0) -> torch.utils.data.Dataset:
    """32 px images whose class sets their mean colour: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    colours = torch.rand(classes, 3, 1, 1, generator=torch.Generator().manual_seed(1234))
    images = colours[labels] + 0.3 * torch.randn(n, 3, 32, 32, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels, label_smoothing=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="swin_t")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("runs/torchvision_sgd"))
    args = p.parse_args()
    torch.manual_seed(0)
    model = MODELS[args.model]()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]  # norms and biases
    groups = [{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    warmup = 5  # a linear warm-up, then flat: any function of the step
    schedule = lambda step: 0.05 * min(1.0, (step + 1) / warmup)  # noqa: E731
    engine = accel.prepare(model, optimizer, loss_fn, schedule=schedule)
    data = torch.utils.data.DataLoader(colour_classes(32 * args.steps), batch_size=32)
    handles = [engine.step(images, labels) for images, labels in engine.loader(data)]
    losses = [r.loss for r in engine.fetch(handles)]  # one host sync for the whole run
    print(f"{args.model} on {engine.backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"backend": engine.backend, "losses": losses}
    (args.out / "losses.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
