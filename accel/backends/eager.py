"""PyTorch eager backend: DDP over torch.distributed (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from timm.loss import SoftTargetCrossEntropy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel.amp import AmpPolicy, amp_policy
from accel.backends.base import Batch
from accel.config import RunConfig
from accel.distributed import DistContext
from accel.optim import weight_decay_groups
from models.factory import ImageClassifier

KERNEL_OPTS = "fused AdamW on CUDA (foreach on CPU), flash/efficient SDPA attention via timm"


def require() -> None:
    """Eager needs nothing beyond torch."""


def build(cfg: RunConfig, ctx: DistContext) -> EagerBackend:
    return EagerBackend(cfg, ctx)


def soft_target_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return SoftTargetCrossEntropy()(logits.float(), targets)


class EagerBackend:
    name = "eager"

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        self.cfg = cfg
        self.ctx = ctx
        self.amp: AmpPolicy = amp_policy(cfg.amp_level, cfg.amp_dtype)
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{ctx.local_rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp.loss_scaling and cuda)

    # --- set-up -------------------------------------------------------------------------------
    def setup(self, model: ImageClassifier) -> None:
        self.module = model.to(self.device, dtype=self.amp.param_dtype)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        wrapped: nn.Module = self.module
        if self.ctx.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(self.module, device_ids=ids)
        self.model = self.wrap_model(wrapped)
        self.optimizer = self._optimizer()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def _optimizer(self) -> torch.optim.Optimizer:
        groups = weight_decay_groups(self.module, self.cfg.optim.weight_decay)
        if self.amp.master_weights:
            self.master = {p: p.detach().float().clone().requires_grad_() for p in self.params}
            groups = [{**g, "params": [self.master[p] for p in g["params"]]} for g in groups]
        fast = {}
        if self.cfg.kernel_opt:
            fast = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        return torch.optim.AdamW(groups, lr=self.cfg.optim.lr, betas=self.cfg.optim.betas, **fast)

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        for images, targets in batches:
            yield (
                images.to(self.device, non_blocking=True),
                targets.to(self.device, non_blocking=True),
            )

    # --- the step -----------------------------------------------------------------------------
    def autocast(self):
        if not self.amp.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp.dtype)

    def train_step(self, micro_batches: list[Batch], lr: float) -> torch.Tensor:
        loss = self.backward(micro_batches)
        self._apply_update(lr)
        return loss

    def backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulate gradients (all-reduced on the last micro-batch); returns the mean loss."""
        total = torch.zeros((), device=self.device)
        for i, (images, targets) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # No gradient all-reduce on the non-final micro-steps of an accumulation.
            no_sync = self.ctx.distributed and not last
            with self.model.no_sync() if no_sync else contextlib.nullcontext(), self.autocast():
                loss = soft_target_loss(self.model(images), targets) / len(micro_batches)
            self.scaler.scale(loss).backward()
            total += loss.detach()
        return total

    def _apply_update(self, lr: float) -> None:
        if self.amp.master_weights:
            for p, m in self.master.items():
                m.grad = None if p.grad is None else p.grad.float()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        if self.cfg.optim.clip_grad > 0:
            opt_params = [p for g in self.optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(opt_params, self.cfg.optim.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.amp.master_weights:
            with torch.no_grad():
                for p, m in self.master.items():
                    p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)

    def fetch_losses(self, losses: list[torch.Tensor]) -> list[float]:
        if not losses:
            return []
        stacked = torch.stack(losses).float()
        if self.ctx.distributed:
            dist.all_reduce(stacked)
            stacked /= self.ctx.world_size
        return stacked.cpu().tolist()

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict]) -> dict[str, float]:
        self.module.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in batches:
            images, labels = batch["images"].to(self.device), batch["labels"].to(self.device)
            mask = batch["mask"].to(self.device)
            with self.autocast():
                logits = self.module(images).float()
            loss = nn.functional.cross_entropy(logits, labels, reduction="none")
            correct = (logits.argmax(-1) == labels).float()
            sums += torch.stack([(loss * mask).sum(), (correct * mask).sum(), mask.sum()]).double()
        self.module.train()
        if self.ctx.distributed:
            dist.all_reduce(sums)
        loss_sum, correct, count = sums.tolist()
        return {
            "eval_loss": loss_sum / max(count, 1),
            "eval_acc": correct / max(count, 1),
            "eval_images": int(count),
        }

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        model = {
            k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
            for k, v in self.module.state_dict().items()
        }
        if self.amp.master_weights:  # the fp32 master copy is the true value of the weights
            names = {p: n for n, p in self.module.named_parameters()}
            model.update({names[p]: m.detach().cpu() for p, m in self.master.items()})
        return {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        if self.amp.master_weights:
            names = dict(self.module.named_parameters())
            with torch.no_grad():
                for name, p in names.items():
                    self.master[p].copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark_warmup_done(self) -> None:
        """Eager compiles nothing."""

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"compiles_after_warmup": 0, "fallback_ops": {}}
        if self.device.type == "cuda":
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out
