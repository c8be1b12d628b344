"""The user's own optimizer beside the Engine, read and loaded as the trained one.

accel never steps the optimizer a script gave `prepare`: the backend updates with its own (or
its optax translation). So that the script's own checkpoint code keeps working unchanged
(`torch.save({"optimizer": optimizer.state_dict()})`, then `optimizer.load_state_dict(...)`
to resume), that optimizer's state_dict() holds the engine's state (moments and step counts, by
torch's parameter indices, in torch's format) and a state it loads, before or after `prepare`,
goes into the engine. torch.optim.Optimizer's public state-dict hooks do both.

    >>> import torch, accel
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    >>> loss_fn = lambda m, b: m(b[0]).pow(2).mean()
    >>> engine = accel.prepare(model, optimizer, loss_fn, backend="eager", quiet=True)
    >>> _ = engine.fetch([engine.step(torch.randn(8, 4))])
    >>> saved = optimizer.state_dict()
    >>> float(saved["state"][0]["step"]), sorted(saved["state"][0])
    (1.0, ['exp_avg', 'exp_avg_sq', 'step'])
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from accel.config import AccelError
from accel.parallel.fsdp import full_value
from accel.trained import TrainedWeights

Named = dict[str, dict[str, torch.Tensor]]  # optimizer state by parameter name


class TrainedOptimizer:
    """The hooks on the user's optimizer; the engine's trained weights (and its runner's state
    through them) are held weakly, as the model's are."""

    def __init__(self, weights: TrainedWeights, optimizer: torch.optim.Optimizer, names: list[str]):
        """`names`: parameter_names(optimizer, model), taken before the backend adopted the
        model (xla moves its parameters to the device as new ones)."""
        self.weights, self.names, self.optimizer = weakref.ref(weights), names, optimizer
        if optimizer.state:  # loaded before prepare (a resume): it goes into the engine now
            self.after_load(optimizer)
        self.hooks = [
            optimizer.register_state_dict_post_hook(self.after_state_dict),
            optimizer.register_load_state_dict_post_hook(self.after_load),
        ]

    def remove(self) -> None:
        """The engine's state loaded into the optimizer itself, and the hooks taken off
        (Engine.close): a plain torch optimizer again, holding the trained moments and step
        counts (whole copies, gathered where the engine splits them)."""
        trained = self.optimizer.state_dict()  # through after_state_dict: the engine's
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        self.optimizer.load_state_dict(trained)

    def after_state_dict(self, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
        weights = self.weights()
        if weights is None:
            return saved
        trained = weights.runner.checkpoint_state()["optim"]
        saved["state"] = {
            i: {k: host_copy(v) for k, v in trained[name].items()}
            for i, name in enumerate(self.names)
            if name in trained
        }
        return saved

    def after_load(self, optimizer: torch.optim.Optimizer) -> None:
        weights = self.weights()
        if weights is None:
            return
        loaded: Named = {}
        for index, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            if optimizer.state.get(p):
                loaded[self.names[index]] = dict(optimizer.state[p])
        state = weights.runner.checkpoint_state()
        for name, moments in loaded.items():
            mine = state["optim"].get(name, {})
            missing = set(mine) - set(moments)
            if missing:
                raise AccelError(
                    f"the optimizer state loaded for {name} has no {', '.join(sorted(missing))}: "
                    "it was saved from another kind of optimizer"
                )
            state["optim"][name] = {k: as_host(moments[k], v.dtype) for k, v in mine.items()}
        weights.runner.load_checkpoint_state(state)
        weights.changed()
        optimizer.state.clear()  # the engine holds it: state_dict() reads it back from there


def parameter_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The model's name of each parameter the optimizer holds, by torch's state_dict index
    (its groups' parameters, in order)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def as_host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to("cpu", dtype)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A whole host copy of one of the engine's tensors (gathered where split)."""
    return full_value(tensor).detach().to("cpu", copy=True)
