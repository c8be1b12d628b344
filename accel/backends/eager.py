"""PyTorch eager backend: DDP over torch.distributed (NCCL on CUDA, gloo on CPU).

The step is split into small hooks (device, model wrapping, accumulation context, autocast,
gradient reduction, end of step) so that backends built on torch modules (compile, xla) change
only what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from timm.loss import SoftTargetCrossEntropy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from accel.amp import AmpPolicy, amp_policy
from accel.backends.base import Batch, StepResult
from accel.config import ConfigError, RunConfig
from accel.distributed import DistContext
from accel.optim import weight_decay_groups
from accel.parallel import effective_shard, fsdp, tp_head
from accel.parallel.layout import MeshLayout
from models.factory import ImageClassifier

KERNEL_OPTS = "nothing more: AdamW is always the fused one, which skips non-finite steps itself"


def require() -> None:
    """Eager needs nothing beyond torch."""


def build(cfg: RunConfig, ctx: DistContext) -> EagerBackend:
    if cfg.pp > 1:
        from accel.parallel.pipeline import PipelineBackend  # it builds on this module

        return PipelineBackend(cfg, ctx)
    return EagerBackend(cfg, ctx)


def to_cpu(tree: Any) -> Any:
    """Checkpoints hold CPU tensors only, so any backend can load them."""
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, tree)


def soft_target_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return SoftTargetCrossEntropy()(logits.float(), targets)


def eval_sums(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[loss sum, correct, count] over the unmasked rows of a padded evaluation batch."""
    logits, mask = logits.float(), mask.float()
    loss = nn.functional.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(-1) == labels).float()
    return torch.stack([(loss * mask).sum(), (correct * mask).sum(), mask.sum()])


def cuda_prefetch(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """Copies the next batch on a side stream while the current one computes (the pattern of
    timm's PrefetchLoader, which wraps a whole loader and normalises; here batches stay uint8
    and the model normalises them)."""
    stream = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    ready = None
    for batch in batches:
        with torch.cuda.stream(stream):
            moved = tuple(t.to(device, non_blocking=True) for t in batch)
        if ready is not None:
            yield ready
        main.wait_stream(stream)
        for t in moved:  # allocated on the side stream, used on the main one
            t.record_stream(main)
        ready = moved
    if ready is not None:
        yield ready


class EagerBackend:
    name = "eager"
    local_replicas = 1  # devices this process drives

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        self.cfg = cfg
        self.ctx = ctx
        self.amp: AmpPolicy = amp_policy(cfg.amp_level, cfg.amp_dtype)
        self.device = self.default_device()
        self.shard = effective_shard(cfg.shard, ctx.world_size)
        if self.shard != "none" and self.amp.loss_scaling:
            raise ConfigError("--shard trains in bfloat16 or fp32 (--amp_dtype bfloat16)")
        # O2 keeps fp32 master weights beside the low-precision model; sharded, the fp32 shards
        # are the masters and FSDP gathers them in low precision.
        self.separate_masters = self.amp.master_weights and self.shard == "none"
        self.state_bytes: dict[str, int] = {}
        self.tp = None  # the dp x tp layout of --tp_head
        self.data_parallel = (ctx.rank, ctx.world_size)  # (rank, ranks) the data is split over
        if cfg.tp_head > 1:
            self.tp = MeshLayout.build("tp", cfg.tp_head, self.device.type)
            self.data_parallel = (self.tp.dp_rank, self.tp.dp)
        self.scaler = torch.amp.GradScaler(
            "cuda", enabled=self.amp.loss_scaling and self.device.type == "cuda"
        )

    def default_device(self) -> torch.device:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = torch.device(f"cuda:{self.ctx.local_rank}")
        torch.cuda.set_device(device)
        return device

    # --- set-up -------------------------------------------------------------------------------
    def setup(self, model: ImageClassifier) -> None:
        if self.cfg.remat:
            model.model.set_grad_checkpointing(True)  # timm: recompute each block's activations
        dtype = torch.float32 if self.amp.master_weights and not self.separate_masters else None
        if self.tp:  # on the host, before the move: the whole classifier never reaches the device
            self.head = tp_head.shard_classifier(model.model, self.tp)
        self.module = model.to(self.device, dtype=dtype or self.amp.param_dtype)
        self.model = self.wrap_model(self.module)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = self.make_optimizer(
            weight_decay_groups(self.module, self.cfg.optim.weight_decay)
        )
        if self.tp:  # read by every step's gradient norm
            self.head_ids = {id(q) for _, _, _, q in self.head_entries()}

    def wrap_model(self, module: nn.Module) -> nn.Module:
        if self.shard != "none":
            blocks = fsdp.transformer_blocks(module.model)
            fsdp.shard_model(module, blocks, self.shard, self.amp, self.device.type)
            return module
        if self.data_parallel[1] < 2:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        group = self.tp.dp_group if self.tp else None  # a tp group trains on the same batch
        return DistributedDataParallel(module, device_ids=ids, process_group=group)

    def make_optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        if self.separate_masters:
            self.master = {p: p.detach().float().clone().requires_grad_() for p in self.params}
            groups = [{**g, "params": [self.master[p] for p in g["params"]]} for g in groups]
        return self.adamw(groups)

    @property
    def optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer updates: the parameters, or their fp32 masters (O2)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def adamw(self, groups: list[dict]) -> torch.optim.Optimizer:
        # Fused (CUDA and CPU): one kernel for the whole update, and it takes `found_inf`, which
        # skips a non-finite step on the device (see guarded_step).
        lr, betas = self.cfg.optim.lr, self.cfg.optim.betas
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)

    @property
    def pin_memory(self) -> bool:
        """Whether host batches should come in pinned memory (asynchronous copies to CUDA)."""
        return self.device.type == "cuda"

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        if self.device.type == "cuda":
            return cuda_prefetch(batches, self.device)
        return (tuple(t.to(self.device) for t in batch) for batch in batches)

    # --- the step -----------------------------------------------------------------------------
    def autocast(self):
        if not self.amp.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp.dtype)

    def accumulation_context(self, last: bool):
        """DDP: no gradient all-reduce on the non-final micro-steps of an accumulation; FSDP:
        no reduce-scatter (read in the backward, so set, not scoped)."""
        if self.shard != "none":
            self.module.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self.data_parallel[1] > 1 and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self, micro_batches: list[Batch], lr: float) -> torch.Tensor:
        """Returns [mean loss over ranks, 1.0 if the update was applied else 0.0]."""
        loss = self.all_reduce_mean(self.backward(micro_batches))
        applied = self.apply_update(lr, loss)
        self.step_done()
        return torch.stack([loss, applied.float()])

    def backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulate gradients and average them over ranks; returns this rank's mean loss."""
        loss = self.accumulate(micro_batches)
        self.reduce_gradients()
        return loss

    def accumulate(self, micro_batches: list[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for i, (images, targets) in enumerate(micro_batches):
            with self.accumulation_context(i == len(micro_batches) - 1), self.autocast():
                loss = self.forward_loss(images, targets) / len(micro_batches)
            self.scaler.scale(loss).backward()
            total += loss.detach()
        return total

    def forward_loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp:
            return tp_head.soft_target_loss(self.model(images), targets, self.head)
        return soft_target_loss(self.model(images), targets)

    def reduce_gradients(self) -> None:
        """DDP has already averaged them during backward."""

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.ctx.distributed:
            dist.all_reduce(value)
            value /= self.ctx.world_size
        return value

    def step_done(self) -> None:
        """Eager work is already queued on the device."""

    def apply_update(self, lr: float, loss: torch.Tensor) -> torch.Tensor:
        """Clip and step, unless the loss or the gradients are not finite; returns whether the
        update was applied (a device bool: every rank computes the same one)."""
        if self.separate_masters:
            for p, m in self.master.items():
                m.grad = None if p.grad is None else p.grad.float()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        finite = torch.isfinite(loss)
        norm = self.clip_gradients()
        if not self.scaler.is_enabled():  # the loss scaler skips steps with inf gradients itself
            finite &= torch.isfinite(norm)
        self.guarded_step(finite)
        if not self.state_bytes:  # once, after the optimizer made its state
            self.state_bytes = self.measure_state_bytes()
        if self.separate_masters:
            with torch.no_grad():
                for p, m in self.master.items():
                    p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        return finite

    def clip_gradients(self) -> torch.Tensor:
        """The total gradient norm, clipping the gradients to --clip_grad where it is set."""
        params, clip = self.optimizer_params, self.cfg.optim.clip_grad
        if self.tp:
            norm = tp_head.grad_norm(params, self.head_ids, self.tp.group)
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
            return norm
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return fsdp.full_value(norm)  # sharded: the global norm, reduced over the shards

    def measure_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of weights, gradients and optimizer state (its shards when
        sharded), read off the tensors while the gradients exist."""
        held = self.params + (list(self.master.values()) if self.separate_masters else [])
        grads = [t.grad for t in held if t.grad is not None]
        measured = {
            "params": fsdp.local_bytes(held),
            "grads": fsdp.local_bytes(grads),
            "optimizer": fsdp.optimizer_bytes(self.optimizer),
        }
        head = self.classifier_params()
        if head:  # the classifier's share of the above: weights, gradients, AdamW moments
            moments = [v for q in head for v in self.optimizer.state[q].values() if v.dim()]
            tensors = head + [q.grad for q in head if q.grad is not None] + moments
            measured["classifier"] = fsdp.local_bytes(tensors)
        return measured

    def classifier_params(self) -> list[torch.Tensor]:
        """What the optimizer updates of the classifier (this rank's shard of it where split)."""
        if self.tp:
            head = self.head
        elif hasattr(self.module.model, "get_classifier"):
            head = self.module.model.get_classifier()
        else:
            return []
        return [self.master[p] if self.separate_masters else p for p in head.parameters()]

    # --- the tensor-parallel head's place in the optimizer and the checkpoint ----------------
    def head_entries(self) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
        """(name, optimizer index, parameter, what the optimizer updates) of the head's
        weight and bias."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        order = {id(q): i for i, q in enumerate(self.optimizer_params)}
        entries = []
        for p in self.head.parameters():
            q = self.master[p] if self.separate_masters else p
            entries.append((names[id(p)], order[id(q)], p, q))
        return entries

    def gather_head(self, state: dict[str, Any]) -> None:
        """Whole classifier rows in a state dict of this rank's shard (every tp rank calls it)."""
        for name, index, _, q in self.head_entries():
            state["model"][name] = self.head.gather(q.detach()).cpu().float()
            moments = state["optimizer"]["state"].get(index, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments:
                    moments[key] = self.head.gather(self.optimizer.state[q][key]).cpu()

    def slice_head(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows of a whole-classifier state dict (a copy where it changes)."""
        model = dict(state["model"])
        optimizer = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
        for name, index, _, _ in self.head_entries():
            model[name] = self.head.rows(model[name])
            if index in optimizer["state"]:
                moments = dict(optimizer["state"][index])
                for key in ("exp_avg", "exp_avg_sq"):
                    moments[key] = self.head.rows(moments[key])
                optimizer["state"][index] = moments
        return {**state, "model": model, "optimizer": optimizer}

    def guarded_step(self, finite: torch.Tensor) -> None:
        """No host sync: fused AdamW leaves the weights, moments and step count as they were
        where `found_inf` is 1. fp16 loss scaling keeps its scaler, deciding on the host."""
        if not self.scaler.is_enabled():
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
            return
        if bool(finite):
            self.scaler.step(self.optimizer)
        self.scaler.update()  # also after a skipped step: it ends what unscale_ began

    def fetch_results(self, handles: list[torch.Tensor]) -> list[StepResult]:
        rows = torch.stack(handles).float().cpu().tolist() if handles else []
        return [StepResult(loss, applied > 0) for loss, applied in rows]

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict]) -> dict[str, float]:
        self.module.eval()
        sums = torch.zeros(3, device=self.device)
        for batch in batches:
            images, labels, mask = (batch[k].to(self.device) for k in ("images", "labels", "mask"))
            sums += self.batch_eval_sums(images, labels, mask)
            self.step_done()
        self.module.train()
        loss_sum, correct, count = self.host_values(self.all_reduce_sum(sums))
        count = max(count, 1.0)
        return {
            "eval_loss": loss_sum / count,
            "eval_acc": correct / count,
            "eval_images": int(count),
        }

    def batch_eval_sums(
        self, images: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """[loss sum, correct, count] of one evaluation batch on this rank."""
        with self.autocast():
            logits = self.module(images)
        if self.tp:
            return tp_head.eval_sums(logits, labels, mask, self.head)
        return eval_sums(logits, labels, mask)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Summed over the data-parallel ranks (a tp group's ranks hold the same sums)."""
        if self.data_parallel[1] > 1:
            dist.all_reduce(value, group=self.tp.dp_group if self.tp else None)
        return value

    @property
    def gathers_state(self) -> bool:
        """Whether state_dict() gathers across ranks, so that every rank must call it."""
        return self.tp is not None

    def host_values(self, value: torch.Tensor) -> list[float]:
        return value.cpu().tolist()

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # To the host first: converting on an XLA device would compile a graph per tensor.
        model = {
            k: v.detach().cpu().float() if v.is_floating_point() else v.cpu()
            for k, v in self.module.state_dict().items()
        }
        if self.separate_masters:  # the fp32 master copy is the true value of the weights
            names = {p: n for n, p in self.module.named_parameters()}
            model.update({names[p]: m.detach().cpu() for p, m in self.master.items()})
        state = {
            "model": model,
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "scaler": self.scaler.state_dict(),
        }
        if self.tp:
            self.gather_head(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tp:
            state = self.slice_head(state)
        self.module.load_state_dict(state["model"])
        if self.separate_masters:
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    self.master[p].copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def dcp_state_dict(self) -> dict[str, Any]:
        """Model and optimizer state by parameter name, as torch.distributed.checkpoint saves
        and loads it: sharded like the model, or whole for an unsharded one."""
        if self.separate_masters:
            raise ConfigError(
                "sharded checkpoints load into --amp_level O0, O1 or O3 runs, or O2 with --shard"
            )
        return fsdp.dcp_state(self.module, self.optimizer)

    def load_dcp_state_dict(self, state: dict[str, Any]) -> None:
        fsdp.load_dcp_state(self.module, self.optimizer, state)

    def rng_state(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        return {"cuda": torch.cuda.get_rng_state(self.device)}

    def load_rng_state(self, state: dict[str, Any]) -> None:
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark_warmup_done(self) -> None:
        """Eager compiles nothing."""

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "compiles_after_warmup": 0,
            "fallback_ops": {},
            "shard": self.shard,
            "tp_head": self.tp.size if self.tp else 1,
            "state_bytes": self.state_bytes,
        }
        if self.device.type == "cuda":
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out
