"""A batch as a script gives it: any nesting of dicts, lists and tuples of tensors (a DataLoader
of dicts, Accelerate's and Hugging Face datasets' way, as well as `(images, labels)`).

The backends see a batch's tensors alone, in order (its leaves); the user's loss and metric
functions get it back in its own structure. Each tensor is split along its first axis, as a
tuple's are; anything else in a batch (a string, a number) is refused in one line naming where
it is. torch's and jax's pytree utilities would do the same, but torch's is private and jax's
would make the library need jax on every backend. A call of the model (`engine.model(...)`) is
a ModelCall: its tensors, and its other arguments (flags, None) kept as they are.

    >>> import torch
    >>> from accel.batches import flatten
    >>> leaves, tree = flatten({"image": torch.zeros(4, 3), "label": torch.ones(4)})
    >>> len(leaves), tree.unflatten(leaves)["label"].shape
    (2, torch.Size([4]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from accel.config import AccelError
from accel.logits import FromLogits


@dataclass(frozen=True)
class Tree:
    """Where a batch's tensors sit: `kind` is "leaf" (a tensor), "tuple", "list" or "dict"
    (`keys`, in order), with a node's `children`; `cls` a namedtuple's class."""

    kind: str
    keys: tuple = ()
    children: tuple[Tree, ...] = ()
    cls: type | None = None

    @property
    def flat(self) -> bool:
        """A plain tuple of tensors: what loss functions have always been given."""
        return (
            self.kind == "tuple"
            and self.cls is None
            and all(c.kind == "leaf" for c in self.children)
        )

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """The structure with `leaves` in place of its tensors, in order."""
        return self._build(iter(leaves))

    def _build(self, leaves: Iterator[Any]) -> Any:
        if self.kind == "leaf":
            return next(leaves)
        items = [child._build(leaves) for child in self.children]
        if self.kind == "dict":
            return dict(zip(self.keys, items, strict=True))
        if self.cls is not None:
            return self.cls(*items)
        return items if self.kind == "list" else tuple(items)

    def __str__(self) -> str:
        if self.kind == "leaf":
            return "tensor"
        if self.kind == "dict":
            pairs = zip(self.keys, self.children, strict=True)
            return "{" + ", ".join(f"{k!r}: {c}" for k, c in pairs) + "}"
        inner = ", ".join(str(c) for c in self.children)
        return f"[{inner}]" if self.kind == "list" else f"({inner})"


LEAF = Tree("leaf")


def flatten(batch: Any, where: str = "the batch") -> tuple[tuple[Any, ...], Tree]:
    """(the batch's tensors in order, its Tree); anything but a tensor (or an array) in it is
    refused in one line naming where it is."""
    leaves: list[Any] = []
    if type(batch) is list:  # a DataLoader's default collate gives [images, labels]
        batch = tuple(batch)
    tree = _flatten(batch, where, leaves)
    return tuple(leaves), tree


def _flatten(value: Any, where: str, leaves: list[Any]) -> Tree:
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # torch, numpy and jax arrays
        leaves.append(value)
        return LEAF
    if isinstance(value, dict):
        keys = tuple(value)
        children = tuple(_flatten(value[k], f"{where}[{k!r}]", leaves) for k in keys)
        return Tree("dict", keys, children)
    if isinstance(value, list | tuple):
        children = tuple(_flatten(v, f"{where}[{i}]", leaves) for i, v in enumerate(value))
        named = type(value) if hasattr(value, "_fields") else None  # a namedtuple
        return Tree("list" if isinstance(value, list) else "tuple", (), children, named)
    raise AccelError(
        f"{where} is a {type(value).__name__}: a batch holds tensors only (dicts, lists and "
        "tuples of them); leave it out of the batch (in your collate_fn, say)"
    )


class BatchTrees:
    """The structures of the batches an Engine is given. The step is traced or compiled for
    one: the first training batch's, which every later one must keep. The loss function the
    backend runs (`loss`) and each metric function (`evaluation`) get their batch back in it."""

    def __init__(self) -> None:
        self.training: Tree | None = None
        # by the metric function's id (it may not hash): it, its wrapper, its batches' structure
        self.metrics: dict[int, tuple[Callable, Callable, list[Tree]]] = {}

    def step_batch(self, batch: tuple) -> tuple:
        """`step(images, labels)`, `step((images, labels))` or `step(batch_dict)`: the
        batch's tensors, in order, the structure kept."""
        if not batch:
            raise AccelError("engine.step() got no batch: give its tensors, engine.step(x, y)")
        given = batch[0] if len(batch) == 1 and isinstance(batch[0], dict | list | tuple) else batch
        leaves, tree = flatten(given)
        check_leaves(leaves)
        if self.training is None:
            self.training = tree
        elif tree != self.training:
            raise AccelError(
                f"the batch changed its structure to {tree} after {self.training}: the step "
                "was traced for the first; give every batch the same"
            )
        return leaves

    def loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn` as the backend runs it: on the batch's tensors, given back to it in the
        batch's structure. A loss that says how it reads its batch to the layouts that compute
        it their own way (accel.logits.FromLogits) takes tuples, as it is."""
        if reads_tuples(loss_fn):
            return loss_fn

        @functools.wraps(loss_fn)  # __wrapped__: jax's saved steps key on the user's function
        def on_leaves(model: Any, leaves: tuple) -> Any:
            tree = self.training
            return loss_fn(model, leaves if tree is None or tree.flat else tree.unflatten(leaves))

        on_leaves.batch_tree = lambda: str(self.training)  # type: ignore[attr-defined]
        return on_leaves

    def evaluation(
        self, batches: Iterable[Any], metric_fn: Callable
    ) -> tuple[Iterator[tuple], Callable]:
        """(the batches' tensors, `metric_fn` given each batch back in its structure): one
        wrapper per metric function, so a backend's program for it is compiled once."""
        known = self.metrics.get(id(metric_fn))
        if known is None or known[0] is not metric_fn:
            seen: list[Tree] = []

            @functools.wraps(metric_fn)
            def on_leaves(model: Any, leaves: tuple) -> Any:
                tree = seen[0]
                return metric_fn(model, leaves if tree.flat else tree.unflatten(leaves))

            wrapper = metric_fn if reads_tuples(metric_fn) else on_leaves
            known = self.metrics[id(metric_fn)] = metric_fn, wrapper, seen
        _, wrapper, seen = known
        return _same_tree(batches, seen, "engine.evaluate's batch"), wrapper

    def loader(
        self, batches: Iterable[Any], to_device: Callable[[Iterator[tuple]], Iterable[tuple]]
    ) -> Iterator[Any]:
        """A loader's batches on the device (`to_device` moves tensors alone), each in its own
        structure: tuples as tuples, dicts as dicts."""
        seen: list[Tree] = []
        for leaves in to_device(_same_tree(batches, seen, "engine.loader's batch")):
            yield leaves if seen[0].flat else seen[0].unflatten(leaves)


@dataclass(frozen=True)
class ModelCall:
    """A call of the model (`engine.model(x)`, `engine.model(pixel_values=x)`): its tensors in
    order, which a backend moves or traces, and the rest (flags, None) kept as given. `key`
    names the call's structure and other values: one compiled forward per key.

        >>> import torch
        >>> call = ModelCall.of((torch.ones(2),), {"mask": None, "labels": torch.zeros(2)})
        >>> len(call.tensors), call.rebuild([torch.ones(2), torch.ones(2)])[1]["labels"]
        (2, tensor([1., 1.]))
    """

    tensors: tuple[torch.Tensor, ...]
    template: tuple[tuple, dict]
    key: str

    @staticmethod
    def of(args: tuple, kwargs: dict) -> ModelCall:
        tensors: list[torch.Tensor] = []
        template = _holes((tuple(args), dict(kwargs)), tensors)
        return ModelCall(tuple(tensors), template, repr(template))

    def rebuild(self, tensors: Sequence[Any]) -> tuple[tuple, dict]:
        """(args, kwargs) with `tensors` in place of the call's own, in order."""
        return _filled(self.template, iter(tensors))


class _Hole:
    """Where a call's tensor sat."""

    def __repr__(self) -> str:
        return "tensor"


def map_leaves(value: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """`value` with `fn(leaf)` in place of each leaf, in order, through dicts, lists, tuples and
    namedtuples, each kept in its class; anything else that is not a leaf kept as it is."""
    if is_leaf(value):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, map_leaves(v, fn, is_leaf)) for k, v in value.items())
    if isinstance(value, list | tuple):
        items = [map_leaves(v, fn, is_leaf) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _holes(value: Any, tensors: list[torch.Tensor]) -> Any:
    def hole(tensor: torch.Tensor) -> _Hole:
        tensors.append(tensor)
        return _Hole()

    return map_leaves(value, hole, lambda v: isinstance(v, torch.Tensor))


def _filled(value: Any, tensors: Iterator[Any]) -> Any:
    return map_leaves(value, lambda _: next(tensors), lambda v: isinstance(v, _Hole))


def reads_tuples(fn: Callable) -> bool:
    """Whether `fn` says how it reads its batch to the layouts that compute it their own way
    (accel.logits.FromLogits: the command line's loss and metric): those take tuples."""
    return isinstance(fn, FromLogits)


def _same_tree(batches: Iterable[Any], seen: list[Tree], where: str) -> Iterator[tuple]:
    """Each batch's tensors; its structure put in `seen` (the first), which every later batch
    must keep."""
    for batch in batches:
        leaves, tree = flatten(batch, where)
        check_leaves(leaves)
        if not seen:
            seen.append(tree)
        elif tree != seen[0]:
            raise AccelError(f"{where} changed its structure to {tree} after {seen[0]}")
        yield leaves


def check_leaves(leaves: tuple) -> None:
    """A batch's tensors share their first, batch, axis: none is 0-dim."""
    if not leaves:
        raise AccelError("a batch holds no tensor: give its tensors, engine.step(x, y)")
    for value in leaves:
        if len(value.shape) == 0:
            raise AccelError("a batch's tensors split along their first axis, got a 0-dim tensor")
