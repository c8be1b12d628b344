"""The optimizer state torch's first step makes, made before any step (so that a checkpoint loads
into it in place), for the optimizers of torch.optim that make theirs in their first step."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

StateInit = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def init_optimizer_state(optimizer: torch.optim.Optimizer, extra: StateInit | None = None) -> None:
    """Create the optimizer's state where no step has made it yet, as its first step would
    (Adam/AdamW: zero moments, step counts at zero; SGD with momentum: a zero buffer, which its
    first step treats as it treats none when dampening is 0), so that a checkpoint loads into
    it in place. Made directly rather than by a step on zero gradients (what
    torch.distributed.checkpoint's helpers do): that costs a copy of the weights and of their
    gradients, and capturable AdamW divides by the learning rate. `extra`: state tensors a
    variant keeps besides (torch_xla's syncfree AdamW)."""
    sgd = isinstance(optimizer, torch.optim.SGD)
    made = FIRST_STATE.get(type(optimizer).__name__)
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            zeros = functools.partial(torch.zeros_like, p, memory_format=torch.preserve_format)
            if sgd:
                if group["momentum"] and not group["dampening"]:
                    optimizer.state[p] = {"momentum_buffer": zeros()}
                continue
            if made is None:  # its first step makes it (Adagrad's constructor already has)
                continue
            step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state = {"step": step, **made(group, zeros, step)}
            optimizer.state[p] = {**state, **(extra(p) if extra else {})}


def _adam_state(group: dict, zeros: Callable[[], torch.Tensor], step: torch.Tensor) -> dict:
    state = {"exp_avg": zeros(), "exp_avg_sq": zeros()}
    return {**state, "max_exp_avg_sq": zeros()} if group.get("amsgrad") else state


def _rmsprop_state(group: dict, zeros: Callable[[], torch.Tensor], step: torch.Tensor) -> dict:
    state = {"square_avg": zeros()}
    state |= {"momentum_buffer": zeros()} if group["momentum"] > 0 else {}
    return state | ({"grad_avg": zeros()} if group["centered"] else {})


# The state torch's first step makes for a parameter besides `step`, by optimizer (SGD's apart).
FIRST_STATE: dict[str, Callable[[dict, Callable[[], torch.Tensor], torch.Tensor], dict]] = {
    "Adam": _adam_state,
    "AdamW": _adam_state,
    "RAdam": _adam_state,
    "NAdam": lambda g, z, step: {"mu_product": torch.ones_like(step), **_adam_state(g, z, step)},
    "RMSprop": _rmsprop_state,
    "Adamax": lambda g, z, step: {"exp_avg": z(), "exp_inf": z()},
    "Adadelta": lambda g, z, step: {"square_avg": z(), "acc_delta": z()},
}
