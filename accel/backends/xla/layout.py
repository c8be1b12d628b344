"""How the model and its training state are laid out on the xla backend's devices: the model moved
to the device (replica 0's weights on every process), the weights of the tp plan split along the
mesh's `tp` axis with everything kept of their shape, FSDPv2 (shard='full') splitting every
weight on its first axis, and the named state a checkpoint holds, split again once loaded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accel.backends.torch_family.core import TorchCore
from accel.backends.torch_family.first_state import init_optimizer_state
from accel.backends.torch_family.named_state import load_named_state, named_state
from accel.backends.xla.devices import XlaDevices
from accel.backends.xla.runtime import xm, xs
from accel.config import MeshConfig
from accel.parallel.tensor_parallel import resolve_plan, weight_splits
from accel.ties import retie, tied_names


def host_readable(model: nn.Module) -> list[RemovableHandle]:
    """The model trained on the XLA device reads as a host model: its state_dict() gives CPU
    copies, which safetensors (a Hugging Face model's save_pretrained), torch.save and numpy
    can read (an XLA tensor has no storage they can), a tensor held under two names one copy.
    `state_dict(keep_vars=True)` (what the backend and torch itself read) keeps the device's
    tensors. Torch's public state_dict hooks, on the model itself (functions: torch marks each
    hook it is given); their handles returned, for Engine.close to remove."""
    keep_vars = [False]

    def before(module: nn.Module, prefix: str, keep: bool) -> None:
        keep_vars[0] = keep

    def after(module: nn.Module, state: dict, prefix: str, metadata: Any) -> None:
        if keep_vars[0]:
            return
        copies: dict[int, torch.Tensor] = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "xla":
                state[name] = copies.setdefault(id(value), value.cpu())

    return [model.register_state_dict_pre_hook(before), model.register_state_dict_post_hook(after)]


class XlaLayout:
    """Where each tensor of the model and of its training state lives, and how it is split."""

    def __init__(self, mesh: MeshConfig, devices: XlaDevices, core: TorchCore):
        self.tp_plan, self.devices, self.core = mesh.tp_plan, devices, core
        self.splits: dict[str, int] = {}  # split parameter name -> its axis along `tp`
        self.hooks: list[RemovableHandle] = []  # on the user's model: host_readable's

    def place(self, model: nn.Module, dtype: torch.dtype) -> None:
        """`model` on the device in `dtype`, its weights split as the mesh says: `module` the
        model trained, `forward_module` what the step calls (FSDPv2's wrapper where there is
        one)."""
        devices = self.devices
        aliases = tied_names(model)
        self.module = self.forward_module = model.to(devices.device, dtype=dtype)
        # Moving to the XLA device gives each module a new parameter: tied weights split.
        retie(self.module, aliases)
        self.hooks = host_readable(self.module)
        if devices.ctx.distributed:  # every replica starts from replica 0's weights
            xm.broadcast_master_param(self.module)
        if devices.tp > 1:  # names as the module trained has them (it is never wrapped with tp)
            plan = resolve_plan(self.module, self.tp_plan, devices.tp)
            self.splits = weight_splits(self.module, plan)
            # Split before the fp32 masters, the optimizer's moments and the EMA are made from
            # the weights, so that none of them is ever held whole.
            self.mark_tp()
        if devices.shard == "full":  # FSDPv2: the weights split on their first axis over `fsdp`
            from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
                SpmdFullyShardedDataParallel,
            )

            self.forward_module = SpmdFullyShardedDataParallel(self.module, mesh=devices.mesh)

    def place_state(self) -> None:
        """Once the optimizer is built: with tp, its moments made now (zeros, as the first step
        would make them), to be split as their weight is: made by the step, they would be whole
        until it ends."""
        if self.devices.tp > 1:
            init_optimizer_state(self.core.optimizer, self.core.extra_state)
            self.mark_tp()

    @contextlib.contextmanager
    def weights(self, ema: bool) -> Iterator[None]:
        """The live weights, or with `ema` the EMA's in their place (sharded alike)."""
        if not ema:
            yield
            return
        with self.core.ema_weights():
            self.reshard()
            yield
        self.reshard()

    # --- named state --------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return named_state(self.core)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        load_named_state(self.core, state)
        self.reshard()
        self.devices.sync()

    # --- shardings ----------------------------------------------------------------------------
    def reshard(self) -> None:
        """A copy into a tensor drops its sharding: FSDPv2's again, or tp's."""
        self.mark_tp()
        devices = self.devices
        if devices.shard != "full":
            return
        for param in self.module.parameters():
            if param.dim():
                xs.mark_sharding(param, devices.mesh, devices.split_first(param))

    def mark_tp(self) -> None:
        """Each weight of the tp plan split along the mesh's `tp` axis on its axis, and the
        tensors laid out as it (its fp32 master, its optimizer moments, its EMA) alike; the rest
        stays replicated. Marking a tensor split the same way again changes nothing."""
        if not self.splits:
            return
        params, along = dict(self.module.named_parameters()), self.devices.tensor_axis
        for name, axis in self.splits.items():
            param = params[name]
            spec = tuple(along if i == axis else None for i in range(param.dim()))
            for tensor in self.laid_out_as(param):
                xs.mark_sharding(tensor, self.devices.mesh, spec)

    def laid_out_as(self, param: nn.Parameter) -> list[torch.Tensor]:
        """`param` and what the optimizer keeps of its shape for it (once attached): its fp32
        master, its moments (not the step count, not syncfree's empty buffer), its EMA."""
        core = self.core
        if not hasattr(core, "optimizer"):
            return [param]
        updated = core.updated(param)
        state = core.optimizer.state.get(updated, {})
        ema = {id(p): e for p, e in zip(core.params, core.ema, strict=False)}
        found = [param, updated, *state.values(), ema.get(id(param))]
        out: dict[int, torch.Tensor] = {}
        for tensor in found:
            if torch.is_tensor(tensor) and tensor.shape == param.shape:
                out.setdefault(id(tensor), tensor)
        return list(out.values())
