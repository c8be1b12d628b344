"""The optimizer the xla backend's step updates with: the user's, rebuilt over the tensors the step
updates, capturable (its step count on the device, so where_guard restores it inside the graph);
with kernel_opt=True, AdamW as torch_xla's syncfree one, which skips a non-finite update inside its
own kernel."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from accel.amp import AmpPolicy
from accel.backends.torch_family.core import where_guard
from accel.optim import OptimizerSpec


def syncfree_extra_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """What syncfree AdamW keeps unlike torch's AdamW, as its first step makes it: the step
    count on the device, and an empty max_exp_avg_sq."""
    return {
        "step": torch.zeros((), dtype=torch.float, device=param.device),
        "max_exp_avg_sq": torch.empty(0, dtype=torch.float, device=param.device),
    }


def syncfree_guard(optimizer: torch.optim.Optimizer, scaler: Any, finite: torch.Tensor) -> None:
    """torch_xla's syncfree AdamW skips the update in its own kernel."""
    # syncfree AdamW's step takes found_inf; torch's Optimizer.step type does not.
    optimizer.step(found_inf=(~finite).float())  # type: ignore[call-overload]


NOT_CAPTURABLE = ("SGD", "Adadelta", "Adagrad")  # optimizers built without capturable on xla


class XlaOptimizer:
    """Which optimizer, how its update is skipped (`guard`) and what state it keeps beyond torch's
    AdamW (`extra_state`)."""

    def __init__(self, kernel_opt: bool, amp: AmpPolicy):
        # syncfree AdamW's fused kernel takes fp32 parameters only (bf16 ones at O3 fail XLA's
        # verifier or give NaN), so O3 keeps torch's AdamW.
        self.syncfree = kernel_opt and amp.level != "O3"
        if kernel_opt and not self.syncfree:
            warnings.warn(
                "kernel_opt=True on xla: syncfree AdamW needs fp32 weights, O3 uses torch's AdamW",
                stacklevel=3,
            )
        self.guard = syncfree_guard if self.syncfree else where_guard
        self.extra_state = syncfree_extra_state if self.syncfree else None

    def build(self, spec: OptimizerSpec, named: dict) -> torch.optim.Optimizer:
        """The user's optimizer over the tensors this backend updates."""
        if self.syncfree and spec.kind == "AdamW":
            from torch_xla.amp import syncfree

            return spec.build(named, optimizer_class=syncfree.AdamW)
        # Capturable: the step count on the device, not a number of the host's that each step
        # would compile into a new graph (torch's Adadelta takes no capturable on xla; its
        # count enters no arithmetic; Adagrad has none, its count only in lr_decay's rate).
        if spec.kind in NOT_CAPTURABLE:
            return spec.build(named)
        return spec.build(named, capturable=True)
