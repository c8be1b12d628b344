"""The optimizer step every torch-module backend shares (eager, compile, xla): AMP (autocast, fp32
master weights, fp16 loss scaling), the optimizer (any of torch.optim's) guarded against non-finite
steps, clipping to a norm the caller computes (it knows how the gradients are split), and the
state by parameter name.

What differs between backends comes in as functions: how the update is guarded (fused AdamW's
`found_inf` here, a `torch.where` in the xla graph) and how the gradient norm is taken.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from accel.amp import AmpPolicy
from accel.backends.as_eager import modes_kept
from accel.backends.base import group_divisor, split_loss
from accel.backends.torch_family.first_state import StateInit
from accel.backends.torch_family.named_state import local_part, state_bytes


def capturable_rate(rate: float) -> float:
    """A rate as torch's capturable Adam can take it. It folds the rate into its denominator
    (sqrt(v) / (c * lr) + eps / lr): at 0 (a warm-up's first step) a weight whose gradient is 0
    gets 0/0, a NaN, silently (the guard reads the gradients). 1e-30 instead (no subnormal in
    that denominator, which XLA may flush to 0) moves no weight by anything float32 holds."""
    return max(float(rate), 1e-30) if float(rate) >= 0 else float(rate)


# (optimizer, scaler, finite) -> None: step unless `finite` is false, without a host sync.
Guard = Callable[[torch.optim.Optimizer, Any, torch.Tensor], None]
GradNorm = Callable[[list[torch.Tensor]], torch.Tensor]  # the norm of these tensors' gradients


def fused_guard(optimizer: torch.optim.Optimizer, scaler: Any, finite: torch.Tensor) -> None:
    """Fused AdamW leaves weights, moments and step count as they were where `found_inf` is 1,
    on the device; an optimizer torch has no fused update of, where_guard. fp16 loss scaling
    keeps torch's scaler, which decides on the host."""
    if not optimizer.defaults.get("fused") and not scaler.is_enabled():
        where_guard(optimizer, scaler, finite)
        return
    if not scaler.is_enabled():
        # Read by fused AdamW's step; torch's Optimizer type does not declare it.
        optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
        optimizer.step()
        return
    if bool(finite):
        scaler.step(optimizer)
    scaler.update()  # also after a skipped step: it ends what unscale_ began


def local_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of the gradients this rank holds."""
    return torch.nn.utils.get_total_norm(grads)


def clip_to_norm(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """torch.nn.utils.clip_grads_with_norm_'s rule (scale by max_norm / (norm + 1e-6) where
    above) on the gradients' local storage: torch's own multiplies a list that may mix DTensor
    and plain gradients (a model split by tensors), which DTensor refuses."""
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, scale.to(grads[0].device) if grads else scale)


def updated_tensors(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """What an optimizer step changes for `param`: the parameter and its state tensors."""
    state = {k: v for k, v in optimizer.state.get(param, {}).items() if torch.is_tensor(v)}
    return {"param": param, **state}


def live_tensors(core: TorchCore, named: dict[str, Any]) -> dict[str, Any]:
    """`named` (named_state's structure, holding the fp32 masters under "model" where the
    optimizer keeps them) with the modules' own weights under "model", as the forward uses them,
    and the optimizer's copies under "masters" where they differ (O2)."""
    weights = {n: p for m in core.modules for n, p in m.named_parameters() if n in named["model"]}
    masters = {n: core.updated(p) for n, p in weights.items() if core.updated(p) is not p}
    live = {**named, "model": {**named["model"], **weights}}
    return {**live, "masters": masters} if masters else live


def where_guard(optimizer: torch.optim.Optimizer, scaler: Any, finite: torch.Tensor) -> None:
    """Any optimizer, without a host sync: the update is computed, then undone where `finite`
    is false. In an XLA graph a clone is a reference to the value, not a device copy; elsewhere
    it costs one copy of the state (fused_guard avoids it where the optimizer is fused)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    before = {p: {k: v.clone() for k, v in updated_tensors(optimizer, p).items()} for p in params}
    optimizer.step()
    with torch.no_grad():
        for p in params:
            for name, new in updated_tensors(optimizer, p).items():
                # State the first step creates starts at zero (moments, counts, buffers).
                old = before[p].get(name, torch.zeros_like(new))
                # (a count an optimizer keeps on the host, Adagrad's on xla: read there)
                new.copy_(torch.where(finite.to(new.device), new, old))


class TorchCore:
    def __init__(
        self,
        amp: AmpPolicy,
        device: torch.device,
        masters: bool,
        guard: Guard,
        extra_state: StateInit | None = None,
    ):
        self.amp, self.device, self.guard, self.extra_state = amp, device, guard, extra_state
        # O2 keeps fp32 master weights beside the low-precision model (unless a sharded layout's
        # fp32 shards are the masters already).
        self.separate_masters = masters
        # torch's loss scaler on the step's device (CUDA's, or the CPU's: torch has both).
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp.loss_scaling)
        self.master: dict[nn.Parameter, torch.Tensor] = {}
        self.measured: dict[str, int] = {}  # state_bytes, once the first step made the state
        self.extra_keys: list[str] = []  # the names of the loss function's extras
        self.device_values = False  # capturable groups' rate and betas given as tensors

    def attach(
        self,
        modules: list[nn.Module],
        build_optimizer: Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer],
        classifier: Sequence[nn.Parameter] = (),
        ema: bool = False,
    ) -> None:
        """Build the optimizer over the trainable parameters of `modules` (any part of the
        model): `build_optimizer` gets (name, the tensor it updates) pairs, the tensor being the
        parameter or its fp32 master (O2); a checkpoint names the state by parameter, so group
        order does not matter. `classifier`: its parameters, whose share of the state is
        reported apart. `ema`: keep an exponential moving average of the weights."""
        self.modules = modules
        named = [(n, p) for m in modules for n, p in m.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        if self.separate_masters:
            self.master = {p: p.detach().float().clone().requires_grad_() for p in self.params}
        self.optimizer = build_optimizer([(n, self.updated(p)) for n, p in named])
        self.classifier = [self.updated(p) for p in classifier]
        # fp32, laid out as the weights are (shards, rows, stages), starting as their copy.
        self.ema = [self.updated(p).detach().float().clone() for p in self.params] if ema else []

    def set_lr(self, lr: float | Sequence[float]) -> None:
        """One base rate (each group scaled by its `lr_scale`), or one rate per group of the
        user's optimizer (a group split in two by OptimizerSpec.build takes its group's), with
        the other values their scheduler changes where given (GroupRates.followed)."""
        groups = self.optimizer.param_groups
        if isinstance(lr, int | float):
            rates = [lr * g.get("lr_scale", 1.0) for g in groups]
        else:
            given = list(lr)
            rates = [given[g.get("spec_group", i)] for i, g in enumerate(groups)]
        followed = getattr(lr, "followed", [])
        for i, (group, rate) in enumerate(zip(groups, rates, strict=True)):
            values = {"lr": rate, **(followed[group.get("spec_group", i)] if followed else {})}
            if self.device_values and group.get("capturable"):
                values["lr"] = torch.tensor(capturable_rate(rate), device=self.device)
                built = group.setdefault("built_betas", group.get("betas"))  # (Adam's: RMSprop
                if values.get("betas", built) != built:  # has none) scheduled, from now on
                    group["scheduled_betas"] = True
                if group.get("scheduled_betas") and "betas" in values:  # a read of beta1 a step
                    betas = tuple(torch.tensor(b, device=self.device) for b in values["betas"])
                    values["betas"] = betas
            group.update(values)

    @property
    def optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer updates: the parameters, or their fp32 masters (O2)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def updated(self, param: nn.Parameter) -> torch.Tensor:
        return self.master.get(param, param)

    def autocast(self, device_type: str | None = None, cache: bool = True):
        if not self.amp.autocast:
            return contextlib.nullcontext()
        kind = device_type or self.device.type
        return torch.autocast(kind, dtype=self.amp.dtype, cache_enabled=cache)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def update(
        self,
        lr: float | Sequence[float],
        loss: torch.Tensor,
        clip: float,
        norm_of: GradNorm,
        ema_decay: float = 0.0,
    ) -> torch.Tensor:
        """Clip and step (and the EMA), unless the loss or the gradients are not finite; returns
        whether the update was applied (a device bool: every rank computes the same one)."""
        for p, m in self.master.items():
            m.grad = None if p.grad is None else p.grad.float()
        self.set_lr(lr)
        self.scaler.unscale_(self.optimizer)
        params = self.optimizer_params
        norm = norm_of(params)
        if clip > 0:
            clip_to_norm(params, clip, norm)
        # The norm of the unscaled gradients: not finite where the loss scaler found an inf or
        # a NaN, whose step it skips (and the EMA and the skip count must know it).
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        self.guard(self.optimizer, self.scaler, finite)
        if not self.measured:
            self.measured = state_bytes(self)
        with torch.no_grad():
            for p, m in self.master.items():
                p.copy_(m)
            if self.ema:
                self.update_ema(ema_decay, finite)
        self.optimizer.zero_grad(set_to_none=True)
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        return finite

    def update_ema(self, decay: float, finite: torch.Tensor) -> None:
        """ema += (weights - ema) * (1 - decay), on the device with no host sync; a skipped
        (non-finite) step leaves it as it was."""
        weight = finite.float() * (1.0 - decay)
        # Shards (DTensors) update their local parts: the EMA is laid out as the weights are.
        ema = [local_part(e) for e in self.ema]
        current = [local_part(self.updated(p).detach()).float() for p in self.params]
        torch._foreach_lerp_(ema, current, [weight] * len(ema))

    @contextlib.contextmanager
    def ema_weights(self):
        """The model's weights are the EMA's inside the block (for evaluation)."""
        if not self.ema:
            raise ValueError("no EMA weights kept (ema=)")
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for p, e in zip(self.params, self.ema, strict=True):
                p.copy_(e)
            try:
                yield
            finally:
                for p, k in zip(self.params, kept, strict=True):
                    p.copy_(k)


def accumulate(
    micro_batches: list[tuple],
    forward_loss: Callable[..., Any],
    core: TorchCore,
    scope: Callable[[bool], Any],
    accum: int = 1,
) -> torch.Tensor:
    """The backward of each micro-batch's share of the group's loss (group_divisor), inside
    `scope(last)` (the backend's autocast, and DDP's no_sync before the last); returns this
    rank's means over the micro-batches as one vector, [loss, *extras] (the extras' names go to
    `core.extra_keys`)."""
    total = torch.zeros((), device=core.device)
    extras = torch.zeros(0, device=core.device)
    divisor = group_divisor(len(micro_batches), accum)
    for i, batch in enumerate(micro_batches):
        with scope(i == len(micro_batches) - 1):
            loss, named = split_loss(forward_loss(*batch))
        core.backward(loss / divisor)
        total += loss.detach() / len(micro_batches)
        core.extra_keys = list(named)
        if named:
            values = [torch.as_tensor(v, device=core.device).detach() for v in named.values()]
            part = torch.stack(values).float() / len(micro_batches)
            extras = part if i == 0 else extras + part
    return torch.cat([total[None], extras])


@torch.no_grad()
def metric_sums(
    module: nn.Module,
    forward: Callable,
    batches: Any,
    metric_fn: Callable,
    autocast: Callable,
    device: torch.device,
    after_batch: Callable[[], None] = lambda: None,
) -> tuple[list[str], torch.Tensor]:
    """The names and the summed values of `metric_fn(forward, batch)` over `batches`, on the
    device and not yet reduced over ranks, `module` in eval mode meanwhile. A value made on the
    host (a count, `len(y)`) joins the device's. `after_batch`: xla's graph cut per batch. The
    module's modes are left as they were (each submodule's)."""
    totals: dict[str, torch.Tensor] = {}
    with modes_kept(module):
        module.eval()
        for batch in batches:
            batch = tuple(t.to(device) for t in batch)
            with autocast():
                sums = metric_fn(forward, batch)
            sums = {k: torch.as_tensor(v, device=device).detach().float() for k, v in sums.items()}
            totals = {k: totals.get(k, 0) + v for k, v in sums.items()}
            after_batch()
    keys = sorted(totals)
    return keys, torch.stack([totals[k] for k in keys]) if keys else torch.zeros(0, device=device)
