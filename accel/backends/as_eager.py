"""Torch functions whose lowering on a compiling backend does not do what eager does, made to
while the user's model runs there (xla's step, jax's trace):

- BatchNorm's running statistics: torch_xla's and torchax's lowerings update the running
  variance with the biased estimate (eager: the unbiased one), and torchax computes the new
  statistics without writing them back. Here the batch is normalised by the lowering and the
  running statistics are written in place, as eager writes them, from the same batch.
- InstanceNorm's running statistics (`track_running_stats=True`): the same, with eager's
  rule for instances: each instance's statistics (the unbiased variance) update the running
  ones, averaged over the batch.
- A BatchNorm in eval mode inside the training step (a frozen one): torch_xla's backward of it
  fails; here it is the affine map it is, whose gradient every backend takes.
- Class ids given as floats to cross_entropy or nll_loss: eager refuses them, torch_xla trains
  on them silently. Here they are refused, naming what to give instead.

    import torch
    from accel.backends.as_eager import AsEager

    bn = torch.nn.BatchNorm1d(3)
    with AsEager():
        bn(torch.randn(8, 3))
    assert int(bn.num_batches_tracked) == 1
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

BATCH_NORM = inspect.signature(F.batch_norm)
INSTANCE_NORM = inspect.signature(F.instance_norm)
CLASS_ID_LOSSES = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """F.batch_norm as eager computes it: in training, the batch's statistics normalise it and
    update the running ones in place (the variance's unbiased estimate, as eager's kernels
    keep); in evaluation, the running statistics in the input's dtype (eager's kernel returns
    the input's dtype whatever the statistics' dtype)."""
    if running_mean is None or running_var is None:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if not training:
        mean, var = running_mean.to(input.dtype), running_var.to(input.dtype)
        if not torch.is_grad_enabled():
            return F.batch_norm(input, mean, var, weight, bias, False, momentum, eps)
        return frozen_batch_norm(input, mean, var, weight, bias, eps)
    out = F.batch_norm(input, None, None, weight, bias, True, momentum, eps)
    update_running(input, [0, *range(2, input.dim())], running_mean, running_var, momentum, 1)
    return out


def frozen_batch_norm(
    input: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """A BatchNorm in eval mode inside a training step (a frozen one), as the affine map it is:
    torch_xla's backward of an evaluation-mode batch norm fails (it asks for the batch
    statistics a training one saves), while this map's gradient is the same on every backend."""
    shape = [1, -1] + [1] * (input.dim() - 2)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight.to(input.dtype)
    out = (input - mean.view(shape)) * scale.view(shape)
    return out if bias is None else out + bias.to(input.dtype).view(shape)


def update_running(
    input: torch.Tensor,
    dims: list[int],
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    instances: int,
) -> None:
    """Running statistics updated in place, as eager's kernels update them, from the input's
    mean and unbiased variance over `dims`, averaged over its first `instances` entries."""
    with torch.no_grad():
        x = input.detach().float()
        count = x.numel() // (x.size(1) * instances)
        mean = x.mean(dims).reshape(instances, -1).mean(0)
        var = x.var(dims, correction=1 if count > 1 else 0).reshape(instances, -1).mean(0)
        for running, batch in ((running_mean, mean), (running_var, var)):
            updated = running.float() * (1.0 - momentum) + batch * momentum
            running.copy_(updated.to(running.dtype))


def instance_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """F.instance_norm as eager computes it: each instance normalised by its own statistics,
    and where running statistics are kept, each instance's (the variance's unbiased estimate)
    updates them and the batch's updates are averaged, as eager's kernel does (it runs batch
    norm over the instances, then takes the mean of their running statistics)."""
    if running_mean is None or running_var is None or not use_input_stats:
        return F.instance_norm(
            input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
        )
    out = F.instance_norm(input, None, None, weight, bias, True, momentum, eps)
    update_running(
        input, list(range(2, input.dim())), running_mean, running_var, momentum, len(input)
    )
    return out


def check_class_ids(name: str, input: torch.Tensor, target: torch.Tensor) -> None:
    """Class ids must be integers; a floating target is cross_entropy's class probabilities,
    of the input's shape."""
    if not target.is_floating_point():
        return
    if name == "cross_entropy" and tuple(target.shape) == tuple(input.shape):
        return
    raise TypeError(
        f"{name} got class ids as {target.dtype} (shape {list(target.shape)}): give them as "
        "integers (target.long())"
        + (
            f", or class probabilities of the input's shape {list(input.shape)}"
            if name == "cross_entropy"
            else ""
        )
    )


class AsEager(TorchFunctionMode):
    """While active, F.batch_norm and F.instance_norm keep their running statistics as eager
    does, and a loss of class ids refuses floating ids as eager does (the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            bound = BATCH_NORM.bind(*args, **kwargs)
            return batch_norm(*bound.args, **bound.kwargs)
        if func is F.instance_norm:
            bound = INSTANCE_NORM.bind(*args, **kwargs)
            return instance_norm(*bound.args, **bound.kwargs)
        name = CLASS_ID_LOSSES.get(func)
        if name is not None and len(args) >= 2:
            check_class_ids(name, args[0], args[1])
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_fast_paths() -> Iterator[None]:
    """torch's fused fast path of nn.TransformerEncoder and MultiheadAttention (taken in
    evaluation, without gradients) off in the block: a compiling backend has no lowering of its
    nested-tensor ops (aten::_nested_tensor_from_mask_left_aligned: jax cannot trace it, xla
    runs it on the host), and the path training takes computes the same values."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@contextlib.contextmanager
def modes_kept(model: torch.nn.Module) -> Iterator[None]:
    """Each module's train or eval mode as it was before the block: an evaluation (or a trace
    that sets a mode) leaves the model as it was given, a frozen BatchNorm in eval mode
    included."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def running_stat_names(model: torch.nn.Module) -> set[str]:
    """The names of the running statistics a BatchNorm-like module keeps (its `running_mean` and
    `running_var` buffers, and the count of batches it tracked)."""
    names = set()
    for prefix, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if "running_mean" in buffers and "running_var" in buffers:
            dot = f"{prefix}." if prefix else ""
            names |= {f"{dot}{b}" for b in buffers if b.startswith(("running_", "num_batches"))}
    return names


__all__ = [
    "AsEager",
    "batch_norm",
    "check_class_ids",
    "instance_norm",
    "modes_kept",
    "no_fast_paths",
    "running_stat_names",
]
