"""What prepare checks of a script's model and optimizer against the settled configuration,
and of the ranks against each other: each refusal one line, before anything is built."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from accel.checkpoint import flatten
from accel.config import AccelError, BackendConfig
from accel.distributed import first_difference
from accel.optim import OptimizerSpec
from accel.parallel.pipeline import check_micro_batch, check_stages
from accel.parallel.tensor_parallel import resolve_plan, weight_splits
from accel.parallel.tp_head import linear_classifier
from accel.settings import Settled
from accel.ties import tied_names


def check_model(
    model: nn.Module, optimizer: torch.optim.Optimizer, settled: Settled
) -> OptimizerSpec:
    """The model and its optimizer against the settled config (trainable parameters, float32,
    backward hooks the step would run, what the layout cuts, tied weights a layout would part,
    the optimizer's flags); the optimizer described, as the backends rebuild it.

    >>> import torch, accel
    >>> model = torch.nn.Linear(2, 2).requires_grad_(False)
    >>> settled = accel.settle(accel.with_keywords(backend="eager"))
    >>> try:
    ...     check_model(model, torch.optim.SGD(model.parameters(), lr=0.1), settled)
    ... except accel.AccelError as err:
    ...     print(str(err).split(":")[0])
    Linear has no trainable parameter (requires_grad is False on every one)
    """
    config = settled.config
    if not any(p.requires_grad for p in model.parameters()):
        raise AccelError(
            f"{type(model).__name__} has no trainable parameter (requires_grad is False on every "
            "one): there is nothing to train"
        )
    check_float32(model)
    check_hooks(model, settled.supports.gradient_hooks, settled.backend)
    check_ties(model, config, check_layout(model, config))
    spec = OptimizerSpec.of(optimizer, model)
    refused = spec.refusals()
    if refused:
        raise AccelError(f"accel cannot run {spec.kind} with {', '.join(refused)}")
    return spec


def check_layout(model: nn.Module, config: BackendConfig) -> dict[str, int]:
    """What the layout cuts, given by the model, refused in one line before anything is built:
    the tensor-parallel plan over its layers (tp=), the parts a pipeline cuts and a block for
    each of its stages (pp=), a linear classifier to split (tp_head=). Returns the weights tp=
    splits (name -> axis). `prepare` runs it; a launcher may run it first on the model built
    on the meta device (`accel.check_layout`), before it starts any process.

    >>> import torch, accel
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    >>> try:
    ...     accel.check_layout(model, accel.with_keywords(backend="eager", pp=2))
    ... except accel.AccelError as err:
    ...     print(str(err).split(" (")[0])
    pp= cuts a model that gives pipeline_parts()
    """
    mesh = config.mesh
    try:
        if mesh.pp > 1:
            check_stages(model, mesh.pp, mesh.pp_schedule)
        if mesh.tp_head > 1:
            linear_classifier(model)
    except ValueError as err:  # accel/parallel's own error, naming what the model must give
        raise AccelError(str(err)) from None
    if mesh.tp < 2:
        return {}
    return weight_splits(model, resolve_plan(model, mesh.tp_plan, mesh.tp))


def check_batch(config: BackendConfig, rows: int) -> None:
    """A micro-step's batch of `rows` (a step's batch, or each of its accum= parts) against what
    the layout splits it into, refused in one line: a pipeline's pp_microbatches= equal
    micro-batches. The step checks each batch; a launcher may check its batch size first
    (`accel.check_batch`), before it starts any process.

    >>> import accel
    >>> try:
    ...     accel.check_batch(accel.with_keywords(pp=2, pp_microbatches=4), 6)
    ... except accel.AccelError as err:
    ...     print(err)
    a batch of 6 does not split into pp_microbatches=4 equal micro-batches
    """
    if config.mesh.pp > 1:
        try:
            check_micro_batch(rows, config.mesh.pp_microbatches)
        except ValueError as err:
            raise AccelError(str(err)) from None


def check_same_on_every_rank(cfg: BackendConfig) -> None:
    """Every rank builds the same backend: a setting that differs between ranks (a seed or a
    mesh read from the rank or the host) is refused in one line on every rank before anything is
    built, where the build would hang in a collective or each rank would train differently. The
    compile cache is the host's own, and may differ."""
    settings = flatten(dataclasses.asdict(cfg))
    mine = {
        k.split(".", 1)[-1]: described(v) for k, v in settings.items() if k != "compiler.cache_dir"
    }
    difference = first_difference(mine)
    if difference:
        raise AccelError(f"the ranks called prepare with different options: {difference}")


def described(value: object) -> object:
    """A setting as the ranks compare it: a function (an EMA decay's) by its qualified name,
    a callable object by its repr, the same on every rank where their addresses are not."""
    if not callable(value):
        return value
    name = getattr(value, "__qualname__", None)
    return f"{value.__module__}.{name}" if name else repr(value)


def check_ties(model: nn.Module, cfg: BackendConfig, splits: dict[str, int]) -> None:
    """A tensor the model holds under two names (tied weights) stays one tensor on every
    layout but two: a pipeline may put the two names on different stages, and tp= splitting
    one of them would leave the other whole. Those are refused in one line, naming both."""
    for alias, name in tied_names(model).items():
        if cfg.mesh.pp > 1:
            why = "a pipeline may put them on different stages"
        elif alias in splits or name in splits:
            why = "tp= would split one and leave the other whole"
        else:
            continue
        raise AccelError(
            f"{alias} is tied to {name} (one tensor under two names): {why}; untie them "
            "(give each its own parameter) or train without it"
        )


def check_hooks(model: nn.Module, runs: tuple[str, ...], backend: str) -> None:
    """Backward hooks the backend's step would not run (jax differentiates its trace itself;
    xla's step runs no tensor hook) are refused in one line naming the module or parameter,
    rather than trained without. torch lists a module's and a tensor's backward hooks only in
    their own dicts (no public API reads them)."""
    cure = (
        f"the {backend} backend's step would not run it: remove it, or train with eager or compile"
    )
    if "module" not in runs:
        for name, module in model.named_modules():
            if module._backward_hooks or module._backward_pre_hooks:
                where = name or type(model).__name__
                raise AccelError(
                    f"{where} has a backward hook (register_full_backward_hook): {cure}"
                )
    if "tensor" not in runs:
        for name, parameter in model.named_parameters():
            if parameter._backward_hooks:
                raise AccelError(f"{name} has a gradient hook (register_hook): {cure}")


def check_float32(model: nn.Module) -> None:
    """accel trains a float32 model, in the precision `amp=` asks for; a model given in another
    floating dtype is refused in one line on every backend alike, rather than cast (eager's
    and xla's steps would cast it to the AMP level's dtype, jax cannot take it)."""
    found = next(
        ((n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point()
         and p.dtype != torch.float32),
        None,
    )  # fmt: skip
    if found is None:
        return
    name, dtype = found
    raise AccelError(
        f"{type(model).__name__}'s parameters are {dtype} ({name}): give prepare the float32 "
        "model (model.float()) and choose the precision with amp= ('O1' autocast, 'O2' "
        "bfloat16 weights with float32 masters, 'O3' all in bfloat16)"
    )


__all__ = ["check_model", "check_same_on_every_rank"]
