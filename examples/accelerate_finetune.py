"""Fine-tune a transformers ViT as 🤗 Accelerate's example scripts do: dict batches from a
collate function, two parameter groups, a linear warm-up, gradient accumulation, accuracy gathered
over the processes each epoch, a checkpoint each epoch and resume, save_pretrained. Written for
Accelerate (accelerate_finetune.py), and moved onto accel (accelerate_finetune_accel.py).

USE_TORCH_XLA=0 python examples/accelerate_finetune.py --epochs 2 --out runs/acc
ACCEL_BACKEND=jax python examples/accelerate_finetune_accel.py --epochs 2 --out runs/acc-jax
"""

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import ViTConfig, ViTForImageClassification, get_linear_schedule_with_warmup


def colour_classes(n: int, classes: int, seed: int) -> TensorDataset:
    """32 px images whose class sets their mean colour: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    colours = torch.rand(classes, 3, 1, 1, generator=torch.Generator().manual_seed(1234))
    images = colours[labels] + 0.3 * torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset(images, labels)


def collate(samples: list) -> dict:
    """What a Hugging Face dataset's collate function gives: a dict of the model's inputs."""
    images, labels = zip(*samples, strict=True)
    return {"pixel_values": torch.stack(images), "labels": torch.stack(labels)}


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay for biases and layer norms, as the transformers examples group them."""
    plain = [p for n, p in model.named_parameters() if p.ndim == 1]
    decayed = [p for n, p in model.named_parameters() if p.ndim > 1]
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--accum", type=int, default=3, help="micro-batches an optimizer step takes")
    p.add_argument("--train_samples", type=int, default=100)  # 13 batches: groups of 3, 3, 3, 3, 1
    p.add_argument("--eval_samples", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps")
    p.add_argument("--out", type=Path, default=Path("runs/acc"))
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint folder to go on from")
    return p.parse_args()


def main() -> None:
    args = parse()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum)
    torch.manual_seed(0)
    config = ViTConfig(  # a small ViT, built from its config: nothing is downloaded
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=4,
    )  # fmt: skip
    model = ViTForImageClassification(config)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.05), lr=args.lr)
    train_set = colour_classes(args.train_samples, 4, seed=0)
    eval_set = colour_classes(args.eval_samples, 4, seed=1)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, collate_fn=collate)
    eval_loader = DataLoader(eval_set, batch_size=args.batch_size, collate_fn=collate)
    steps = math.ceil(len(train_loader) / args.accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    first_epoch, losses, accuracies = 0, [], []
    if args.resume:
        accelerator.load_state(args.resume)
        record = json.loads((args.resume / "record.json").read_text())
        first_epoch, losses, accuracies = record["epoch"] + 1, record["losses"], record["accuracy"]
    for epoch in range(first_epoch, args.epochs):
        model.train()
        group = []
        for batch in train_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            group.append(outputs.loss.item())
            if accelerator.sync_gradients:  # an optimizer step: its micro-batches' mean loss
                losses.append(sum(group) / len(group))
                group = []

        model.eval()
        correct = total = 0
        for batch in eval_loader:
            with torch.no_grad():
                outputs = model(**batch)
            preds = outputs.logits.argmax(dim=-1)
            preds, labels = accelerator.gather_for_metrics((preds, batch["labels"]))
            correct += int((preds == labels).sum())
            total += len(labels)
        accuracies.append(correct / total)
        accelerator.print(f"epoch {epoch}: loss {losses[-1]:.4f}, accuracy {correct / total:.3f}")

        folder = args.out / f"epoch_{epoch}"
        record = {"epoch": epoch, "losses": losses, "accuracy": accuracies}
        accelerator.save_state(folder)
        if accelerator.is_main_process:
            (folder / "record.json").write_text(json.dumps(record))

    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(args.out / "model")
    if accelerator.is_main_process:
        result = {"losses": losses, "accuracy": accuracies}
        (args.out / "losses.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
