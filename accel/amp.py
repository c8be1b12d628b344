"""AMP levels shared by every backend.

O0  fp32 everywhere.
O1  fp32 weights, matmuls in low precision under autocast (bf16 by default; fp16 uses loss scaling).
O2  low-precision weights in the model, fp32 master weights in the optimizer, autocast on.
O3  everything low precision, optimizer included: fastest, may cost accuracy.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from accel.config import AMP_LEVELS, AccelError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AmpPolicy:
    level: str
    dtype: torch.dtype  # the low-precision dtype of O1..O3

    @property
    def autocast(self) -> bool:
        return self.level in ("O1", "O2")

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float32 if self.level in ("O0", "O1") else self.dtype

    @property
    def master_weights(self) -> bool:
        return self.level == "O2"

    @property
    def loss_scaling(self) -> bool:
        return self.dtype == torch.float16 and self.level in ("O1", "O2")


def amp_policy(level: str, dtype: str = "bfloat16") -> AmpPolicy:
    """The policy of a level the config has already checked (accel/config.py)."""
    if level not in AMP_LEVELS or dtype not in DTYPES:
        raise AccelError(f"unknown AMP level or dtype: {level} {dtype}")
    if level == "O3":
        warnings.warn(
            "AMP O3 trains entirely in low precision: fastest, may cost accuracy", stacklevel=2
        )
    return AmpPolicy(level, DTYPES[dtype])
