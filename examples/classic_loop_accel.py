"""PyTorch's ImageNet example with a timm model, written the usual way (classic_loop.py: DDP
under torchrun, autocast, loss.backward(), a train() and a validate() that receive the model,
per-step meters, a checkpoint of the model, optimizer and scheduler, --resume) and moved onto
accel (classic_loop_accel.py: the same loop on the backend ACCEL_BACKEND or USE_ACCEL names).
`diff examples/classic_loop.py examples/classic_loop_accel.py` shows the edits.

    python examples/classic_loop.py --steps 20 --out runs/classic
    python examples/classic_loop.py --epochs 2 --resume runs/classic/checkpoint.pt --out runs/more
    ACCEL_BACKEND=jax python examples/classic_loop_accel.py --steps 20 --out runs/classic-jax
    torchrun --nproc_per_node 2 examples/classic_loop_accel.py --steps 20 --out runs/classic-ddp
    USE_ACCEL=1 python examples/classic_loop_accel.py --data /data/imagenet --full-size \
        --model swin_tiny_patch4_window7_224 --img_size 224 --batch_size 128 --epochs 300

Without --data it makes a small folder of JPEGs under --out (a colour per class).
"""

import argparse
import json
import os
from pathlib import Path

import timm
import torch
import torch.distributed as dist
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

import accel

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_folder(root: Path, classes: int = 4, per_class: int = 48, size: int = 40) -> Path:
    """train/ and val/, a folder of JPEGs per class, each class its own colour."""
    noise = torch.Generator().manual_seed(0)
    for split, n in (("train", per_class), ("val", per_class // 4)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = torch.rand(3, generator=torch.Generator().manual_seed(c)) * 255
            for i in range(n):
                pixels = colour + 40 * torch.randn(size, size, 3, generator=noise)
                Image.fromarray(pixels.clamp(0, 255).byte().numpy()).save(folder / f"{i}.jpg")
    return root


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="an ImageNet-style folder (train/, val/)")
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--full-size", action="store_true", help="the model as timm builds it")
    p.add_argument("--img_size", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr_step", type=int, default=30, help="epochs between the rate's tenfold cuts")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: none)")
    p.add_argument("--resume", type=Path, help="a checkpoint this script wrote")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("runs/classic"))
    return p.parse_args()


def loaders(root: Path, size: int, batch: int, workers: int, distributed: bool) -> tuple:
    train_set = datasets.ImageFolder(
        root / "train",
        transforms.Compose([
            transforms.RandomResizedCrop(size, scale=(0.5, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]),
    )  # fmt: skip
    val_set = datasets.ImageFolder(
        root / "val",
        transforms.Compose([
            transforms.Resize(size),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]),
    )  # fmt: skip
    sampler = DistributedSampler(train_set, seed=0) if distributed else None
    val_sampler = DistributedSampler(val_set, shuffle=False) if distributed else None
    order = torch.Generator()  # seeded each epoch: a resumed run sees what an unbroken one saw
    train = DataLoader(
        train_set, batch, shuffle=sampler is None, sampler=sampler, num_workers=workers,
        drop_last=True, generator=order,
    )  # fmt: skip
    val = DataLoader(val_set, batch, sampler=val_sampler, num_workers=workers, drop_last=True)
    return train, val, sampler, order, len(train_set.classes)


def main() -> None:
    args = parse()
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    root = args.data or args.out / "data"
    if args.data is None and rank == 0:
        make_folder(root)
    if distributed:
        dist.barrier()
    train_loader, val_loader, sampler, order, classes = loaders(
        root, args.img_size, args.batch_size, args.workers, distributed
    )

    torch.manual_seed(0)
    small = {} if args.full_size else {"patch_size": 8, "depth": 2}
    model = timm.create_model(args.model, img_size=args.img_size, num_classes=classes, **small)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step, gamma=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])

    def loss_fn(model: nn.Module, batch: tuple) -> tuple:
        output = model(batch[0])
        return criterion(output, batch[1]), {"acc1": accuracy(output, batch[1])}

    engine = accel.prepare(model, optimizer, loss_fn, clip_grad=1.0, amp="O1" if args.amp else "O0")
    model = engine.model  # from here on: the model being trained, to evaluate and to save
    losses = []
    for epoch in range(start_epoch, args.epochs):
        order.manual_seed(epoch)
        if sampler is not None:
            sampler.set_epoch(epoch)
        losses += train(train_loader, model, criterion, optimizer, epoch, device, args, len(losses))
        acc1 = validate(val_loader, model, device)
        scheduler.step()
        best_acc1 = max(acc1, best_acc1)
        if rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}, val top-1 {acc1:.3f}")
            state = {"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1}
            state |= {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            torch.save(state, args.out / "checkpoint.pt")
        if len(losses) == args.steps:
            break

    if rank == 0:
        record = {"backend": engine.backend, "losses": losses}
        (args.out / "losses.json").write_text(json.dumps(record))
    if distributed:
        dist.destroy_process_group()


class Meter:
    """A value's last and mean, as the ImageNet example's AverageMeter keeps them."""

    def __init__(self) -> None:
        self.last, self.total, self.count = 0.0, 0.0, 0

    def update(self, value: float, n: int) -> None:
        self.last, self.total, self.count = value, self.total + value * n, self.count + n

    def __str__(self) -> str:
        return f"{self.last:.4f} ({self.total / self.count:.4f})"


def train(loader, model, criterion, optimizer, epoch, device, args, done: int) -> list[float]:
    """One epoch (or the steps left of args.steps, `done` taken); each step's loss."""
    model.train()
    engine = accel.engine_of(model)
    losses, top1, each = Meter(), Meter(), []
    for i, (images, targets) in enumerate(engine.loader(loader)):
        result = engine.fetch([engine.step(images, targets)])[0]  # the mean over ranks
        loss, acc1 = result.loss, result.extras["acc1"]
        losses.update(loss.item(), len(images))
        top1.update(acc1.item(), len(images))
        each.append(losses.last)
        if i % 10 == 0:
            print(f"epoch {epoch} [{i + 1}/{len(loader)}]: loss {losses}, train top-1 {top1}")
        if done + i + 1 == args.steps:
            break
    return each


def accuracy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of a batch, as PyTorch's ImageNet example measures it."""
    return (output.argmax(-1) == targets).float().mean()


@torch.no_grad()
def validate(loader: DataLoader, model: nn.Module, device: torch.device) -> float:
    """Top-1 accuracy over the validation set (every rank's part)."""
    model.eval()
    sums = torch.zeros(2, device=device)
    for images, targets in loader:
        images, targets = images.to(device), targets.to(device)
        predicted = model(images).argmax(-1)
        sums += torch.stack([(predicted == targets).sum(), targets.new_tensor(len(targets))])
    if dist.is_initialized():
        dist.all_reduce(sums)
    correct, count = sums.tolist()
    return correct / count


if __name__ == "__main__":
    main()
