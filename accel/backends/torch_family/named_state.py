"""The torch backends' training state by parameter name (what a checkpoint reads and loads, and
what each rank holds of it), read off a TorchCore's modules, optimizer, fp32 masters and EMA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from accel.backends.torch_family.first_state import StateInit, init_optimizer_state


class StateHolder(Protocol):
    """What the state is read off: core.py's TorchCore (read-only here)."""

    @property
    def modules(self) -> Sequence[nn.Module]: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def master(self) -> Mapping[nn.Parameter, torch.Tensor]: ...  # fp32 master weights (O2)
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def extra_state(self) -> StateInit | None: ...
    @property
    def ema(self) -> Sequence[torch.Tensor]: ...
    @property
    def scaler(self) -> Any: ...  # torch.amp.GradScaler
    @property
    def classifier(self) -> Sequence[torch.Tensor]: ...

    def updated(self, param: nn.Parameter) -> torch.Tensor: ...


View = Callable[[dict[str, Any]], dict[str, Any]]  # a layout's view of the named state


def named_state(core: StateHolder) -> dict[str, Any]:
    """The live tensors: {'model': weights and persistent buffers (the fp32 masters where
    there are any), 'optim': {name: the optimizer's state}}, and the fp16 loss scaler's
    state. The optimizer's state is made first where no step has made it yet (a checkpoint
    loads into it)."""
    init_optimizer_state(core.optimizer, core.extra_state)
    model, optim = {}, {}
    for module in core.modules:
        params = {n: p for n, p in module.named_parameters()}
        for name, value in module.state_dict(keep_vars=True).items():
            param = params.get(name)
            model[name] = core.updated(param) if param is not None else value
            state = core.optimizer.state.get(core.updated(param)) if param is not None else None
            if state:
                optim[name] = {k: v for k, v in state.items() if torch.is_tensor(v)}
    out = {"model": model, "optim": optim}
    if core.ema:
        names = {id(p): n for m in core.modules for n, p in m.named_parameters()}
        out["ema"] = {names[id(p)]: e for p, e in zip(core.params, core.ema, strict=True)}
    if core.scaler.is_enabled():  # fp16 loss scaling: its scale and growth count
        out["scaler"] = {k: torch.tensor(v) for k, v in core.scaler.state_dict().items()}
    return out


def load_named_state(core: StateHolder, state: dict[str, Any], view: View = lambda s: s) -> None:
    """Copy `state` (named_state's structure, as `view` shows it) into the live tensors,
    where it holds other tensors than those (a checkpoint loaded in place needs no copy)."""
    live = view(named_state(core))
    with torch.no_grad():
        for name, target in live["model"].items():
            _copy(target, state["model"][name])
        for name, moments in live["optim"].items():
            for key, target in moments.items():
                _copy(target, state["optim"][name][key])
        for name, target in live.get("ema", {}).items():
            # A checkpoint without an EMA starts it from its weights.
            _copy(target, state.get("ema", state["model"])[name])
        for p, m in core.master.items():
            p.copy_(m)
    if core.scaler.is_enabled() and "scaler" in state:
        core.scaler.load_state_dict({k: v.item() for k, v in state["scaler"].items()})


def state_bytes(core: StateHolder) -> dict[str, int]:
    """Bytes this rank holds of weights, gradients, optimizer state and EMA (its shards
    where split), read off the tensors while the gradients exist."""
    held = [*core.params, *core.master.values()]
    moments = [v for s in core.optimizer.state.values() for v in s.values() if v.dim()]
    measured = {
        "params": local_bytes(held),
        "grads": local_bytes([t.grad for t in held if t.grad is not None]),
        "optimizer": local_bytes(moments),
    }
    if core.ema:
        measured["ema"] = local_bytes(core.ema)
    head = core.classifier
    if head:  # the classifier's share: weights, gradients, AdamW moments
        head_moments = [v for q in head for v in core.optimizer.state[q].values()]
        grads = [q.grad for q in head if q.grad is not None]
        measured["classifier"] = local_bytes([*head, *grads, *head_moments])
    return measured


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _copy(target: torch.Tensor, value: torch.Tensor) -> None:
    """target <- value, unless value is target's own memory (loaded in place)."""
    mine, theirs = local_part(target), local_part(value)
    if mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape:
        return
    target.copy_(value.to(target.dtype))


def local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes this rank holds of `tensors` (its shards of DTensors)."""
    total = 0
    for t in tensors:
        local = local_part(t)
        if local.dim():
            total += local.numel() * local.element_size()
    return total
