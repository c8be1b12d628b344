"""A Hugging Face transformers model on accel: its own loss from its output, and
save_pretrained after training, as in a transformers loop.

python examples/hugging_face.py --steps 20 --out runs/hf
ACCEL_BACKEND=xla python examples/hugging_face.py --steps 20 --out runs/hf-xla
ACCEL_BACKEND=jax python examples/hugging_face.py --steps 20 --out runs/hf-jax
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import ViTConfig, ViTForImageClassification

import accel


def colour_classes(n: int, classes: int = 10, seed: int = 0) -> torch.utils.data.Dataset:
    """32 px images whose class sets their mean colour: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    colours = torch.rand(classes, 3, 1, 1, generator=torch.Generator().manual_seed(1234))
    images = colours[labels] + 0.3 * torch.randn(n, 3, 32, 32, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def loss_fn(model: ViTForImageClassification, batch: tuple) -> torch.Tensor:
    """The model computes its loss itself when given the labels."""
    pixel_values, labels = batch
    return model(pixel_values=pixel_values, labels=labels).loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("runs/hf"))
    args = p.parse_args()
    torch.manual_seed(0)
    config = ViTConfig(  # a small ViT, built from its config: nothing is downloaded
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=10,
    )  # fmt: skip
    model = ViTForImageClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    engine = accel.prepare(model, optimizer, loss_fn, clip_grad=1.0)
    data = torch.utils.data.DataLoader(colour_classes(32 * args.steps), batch_size=32)
    handles = [engine.step(images, labels) for images, labels in engine.loader(data)]
    losses = [r.loss for r in engine.fetch(handles)]  # one host sync for the whole run
    print(f"step {len(losses)}: loss {losses[-1]:.4f}")
    model.save_pretrained(args.out / "model")  # the trained weights, on every backend
    record = {"backend": engine.backend, "losses": losses}
    (args.out / "losses.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
