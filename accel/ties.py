"""Tensors a model holds under more than one name (tied weights: an embedding shared with the
output layer), found once and kept tied. Moving a module to an XLA device gives each module a
new parameter (the tie splits in two); functional_call refuses the two names unless only one is
given. Both names stay in a model's state_dict, so checkpoints load into an untied copy too.

    import torch
    from accel.ties import tied_names

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert tied_names(model) == {"1.weight": "0.weight"}
"""

from __future__ import annotations

import torch
from torch import nn


def tied_names(model: nn.Module) -> dict[str, str]:
    """{alias: name}: each name under which the model holds a parameter or buffer it already
    holds under an earlier name (the one named_parameters and named_buffers give)."""
    aliases: dict[str, str] = {}
    for named in (
        model.named_parameters(remove_duplicate=False),
        model.named_buffers(remove_duplicate=False),
    ):
        first: dict[int, str] = {}
        for name, tensor in named:
            if id(tensor) in first:
                aliases[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Each alias holds its tensor again (after a move that replaced the parameters)."""
    for alias, name in aliases.items():
        owner, _, attribute = alias.rpartition(".")
        module = model.get_submodule(owner)
        tensor: torch.Tensor
        try:
            tensor = model.get_parameter(name)
        except AttributeError:  # a buffer
            tensor = model.get_buffer(name)
        setattr(module, attribute, tensor)


__all__ = ["retie", "tied_names"]
