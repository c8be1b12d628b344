"""The whole model on each rank: one process, or replicas that DDP (over NCCL or gloo) keeps
equal, the data split over every rank. Replicas start from rank 0's weights (DDP broadcasts
them)."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel.backends.base import ModelInit
from accel.backends.torch_family.layout import Layout, remat
from accel.parallel.materialize import whole


class WholeLayout(Layout):
    """The model whole on each rank; DDP's hooks reduce the gradients in the backward."""

    def adopt(self, model: nn.Module, init: ModelInit | None) -> list[nn.Module]:
        model = whole(model, init)
        remat(model, self.cfg.step.remat)
        self.module = model.to(self.device, dtype=self.param_dtype)
        self.forward = self.wrap(self.module)
        return [self.module]

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.data_parallel[1] < 2:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def sync(self, last: bool) -> Any:
        """No gradient reduce on the micro-steps before the last of an accumulation."""
        if isinstance(self.forward, DistributedDataParallel) and not last:
            return self.forward.no_sync()
        return contextlib.nullcontext()
