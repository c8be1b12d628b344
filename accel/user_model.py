"""The user's own model beside the Engine: kept current on a backend that trains arrays of
its own (TrainedOnRead), and the trained model as a callable for an evaluation loop (EvalModel)."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel.batches import ModelCall
from accel.loop import user_errors
from accel.trained import TrainedWeights


class TrainedOnRead:
    """Where the backend trains arrays of its own (jax), the model a script gave `prepare` reads
    as the trained one: its state_dict() and its forward first copy the trained weights in
    (Engine.sync_model), once after each step or load. Torch's public module hooks, on the
    model itself (not its submodules); the engine's trained weights are held weakly, so the
    model does not keep them alive."""

    def __init__(self, weights: TrainedWeights, model: nn.Module):
        self.weights = weakref.ref(weights)
        self.hooks = [
            model.register_state_dict_pre_hook(self.before_state_dict),
            model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
        ]

    def remove(self) -> None:
        """The trained weights copied in a last time, and the hooks taken off (Engine.close):
        the model is a plain module again, holding what was trained."""
        self.sync()
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.sync()

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # The backend traces the model on tensors of its own (torchax's, on the "jax" device),
        # given by position or by keyword (`model(pixel_values=...)`), with the weights it
        # hands the trace: nothing to copy in then.
        given = (*args, *kwargs.values())
        if not any(isinstance(a, torch.Tensor) and a.device.type == "jax" for a in given):
            self.sync()

    def sync(self) -> None:
        weights = self.weights()
        if weights is not None and not weights.reading and weights.synced != weights.changes:
            weights.sync_model()


class EvalModel:
    """`engine.model`: the model a script evaluates, as a module it can call. `eval()` and
    `train()` are accepted and change nothing (the model trains only through engine.step),
    `state_dict()` is the trained weights (engine.state_dict), and `accel.engine_of` gives its
    engine back, so a script may hand it to its own train function as the model."""

    def __init__(
        self,
        forward: Callable[[ModelCall], Any],
        state_dict: Callable[[], dict[str, torch.Tensor]],
        engine: object,
    ):
        self.forward, self.trained_state, self.engine = forward, state_dict, engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = ModelCall.of(args, kwargs)
        first = call.tensors[0] if call.tensors else None
        device = first.device if first is not None else torch.device("cpu")
        if device.type not in ("cpu", "cuda", "xla"):
            device = torch.device("cpu")  # jax's views: their values come back to the host
        with user_errors("forward"):
            out = self.forward(call)
        return on_device(out, device)

    def eval(self) -> EvalModel:
        return self

    def train(self, mode: bool = True) -> EvalModel:
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trained_state()


def on_device(out: Any, device: torch.device) -> Any:
    """A model's output (a tensor, or tuples, lists, dicts and dataclasses of them) on
    `device`, each in its own class: a transformers ModelOutput keeps `.logits`, a namedtuple
    its fields."""
    if isinstance(out, torch.Tensor):
        return out.to(device)
    if isinstance(out, dict):  # before dataclasses: a ModelOutput is both
        moved = copy.copy(out)  # its class, its attributes (ModelOutput's mirror its keys)
        for key, value in out.items():
            moved[key] = on_device(value, device)
        return moved
    if isinstance(out, tuple | list):
        items = [on_device(o, device) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        fields = [f.name for f in dataclasses.fields(out) if f.init]
        return dataclasses.replace(out, **{f: on_device(getattr(out, f), device) for f in fields})
    return out
