"""In-place writes into views inside a model's forward train on jax as on eager: each common form
(`+=` on an indexed slice, `masked_fill_`, `index_add_`, `copy_` into a slice, `fill_`,
`zero_`, an in-place op on `narrow`, `t()` and `view()` results, and on a slice of one), its
losses and trained weights against eager's. Each gave jax a different forward, with no error,
before the jax backend wrote them through (accel/backends/jax/inplace.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import accel

FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "iadd_indexed": lambda y, x: y[:, 0].__iadd__(y[:, 1]),
    "iadd_slice_variable": lambda y, x: y[:, 2:4].__iadd__(x[:, :2]),
    "masked_fill_slice": lambda y, x: y[:, :3].masked_fill_(x[:, :3] > 0.5, 0.0),
    "index_add_slice": lambda y, x: y[:, 2:].index_add_(1, torch.tensor([0, 1]), 2 * x[:, :2]),
    "copy_into_slice": lambda y, x: y[:, 4:].copy_(2 * x[:, :2]),
    "fill_slice": lambda y, x: y[:, 0:2].fill_(1.0),
    "zero_rows": lambda y, x: y[1:3].zero_(),
    "mul_narrow": lambda y, x: y.narrow(1, 1, 2).mul_(3.0),
    "mul_transposed_row": lambda y, x: y.t()[0].mul_(2.0),
    "add_strided_flat_view": lambda y, x: y.view(-1)[::2].add_(1.0),
}


class Writes(nn.Module):
    """A linear layer whose output the forward writes into in place, one way."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.form = nn.Linear(6, 6), form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).clone()
        FORMS[self.form](y, x)
        return y


def train(backend: str, form: str) -> tuple[list[float], dict]:
    model = Writes(form)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, batch: ((m(batch[0]) - batch[1]) ** 2).mean()  # noqa: E731
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)) for _ in range(3)]
    losses = [r.loss for r in engine.fetch([engine.step(*b) for b in data])]
    return losses, engine.state_dict()


@pytest.mark.parametrize("form", list(FORMS))
def test_an_inplace_write_into_a_view_trains_on_jax_as_on_eager(form):
    eager_losses, eager_weights = train("eager", form)
    jax_losses, jax_weights = train("jax", form)
    assert jax_losses == pytest.approx(eager_losses, rel=1e-5)
    for name, value in eager_weights.items():  # the gradients through the write, as eager's
        torch.testing.assert_close(jax_weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
