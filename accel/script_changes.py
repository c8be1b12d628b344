"""What a script changes between steps that the prepared step holds as it was built: which of the
model's weights require a gradient, and the optimizer's param groups.

Before each step the Engine asks `ScriptChanges.before_step()`. A weight the optimizer holds
that stops requiring a gradient (`p.requires_grad_(False)`: freezing a layer mid-training) is
handed to the backend, which leaves it as torch leaves a weight without a gradient: no update,
no weight decay, its optimizer state kept, out of the clipping norm. What accel cannot follow
is refused in one line naming the cure: a weight that requires a gradient but was frozen when
`prepare` ran (its optimizer holds nothing of it), and a param group added or changed after
`prepare` (`optimizer.add_param_group`).

    >>> import torch, accel
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = accel.prepare(model, optimizer, lambda m, b: m(b[0]).pow(2).mean(),
    ...                        backend="eager", quiet=True)
    >>> _ = model[0].requires_grad_(False)  # frozen from the next step on
    >>> before = model[0].weight.detach().clone()
    >>> _ = engine.fetch([engine.step(torch.randn(8, 4))])
    >>> torch.equal(engine.state_dict()["0.weight"], before)
    True
"""

from __future__ import annotations

import torch
from torch import nn

from accel.backends.runner import Runner
from accel.config import AccelError


class ScriptChanges:
    """Which weights require a gradient and the optimizer's groups, as the last step saw them.
    `held`: the names of the weights the prepared optimizer trains."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, held: set[str]):
        self.named = list(model.named_parameters())
        self.optimizer, self.held = optimizer, frozenset(held)
        self.groups = self.group_sizes()
        self.flags = self.requires_grad()
        self.frozen: frozenset[str] = frozenset()

    def requires_grad(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for _, p in self.named)

    def group_sizes(self) -> tuple[int, ...]:
        return tuple(len(group["params"]) for group in self.optimizer.param_groups)

    def before_step(self, runner: Runner) -> None:
        """`runner` told which held weights no longer require a gradient, where that changed
        since the last step; AccelError for what accel cannot follow."""
        if self.group_sizes() != self.groups:
            raise AccelError(
                "the optimizer's param groups changed after prepare (add_param_group, or "
                "parameters added to a group): accel trains the groups it was prepared with; "
                "call accel.prepare again with the optimizer as it is now"
            )
        flags = self.requires_grad()
        if flags == self.flags:
            return
        self.flags = flags
        trainable = {name for name, p in self.named if p.requires_grad}
        unheld = sorted(trainable - self.held)
        if unheld:
            raise AccelError(
                f"{unheld[0]} requires a gradient now but did not when prepare ran, so the "
                "optimizer accel built holds nothing of it: call accel.prepare again after "
                "unfreezing it"
            )
        frozen = self.held - trainable
        if frozen and frozen == self.held:
            raise AccelError("every weight the optimizer holds is frozen: nothing left to train")
        if frozen != self.frozen:
            runner.freeze(frozen)
            self.frozen = frozen
