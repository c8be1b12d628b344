"""The jax step kept between launches: jax.export's serialization of the lowered step, beside
XLA's persistent cache of compiled programs, so that a second launch of the same job loads the
step instead of tracing the torch model through torchax and lowering it again (Swin-T at batch 8
on a CPU: 2.7 s of the 12.7 s before its first step), and XLA's cache then gives the compiled
program.

A step is kept under a key made of everything that decides its program, and a launch that
differs in any of it traces anew:
- the code: the files that define the model's classes and the loss function (a file the user
  edits is a new step), accel's own files (its lowerings), the library versions;
- the model: each module's type, mode, plain attributes (sizes, flags such as timm's
  fused_attn) and hooks, and each parameter's and buffer's name, shape, dtype and whether it
  trains; what the loss function closes over (tensors by value);
- the optimizer's kind and hyperparameters, the backend's config, the platform and devices;
- the arguments: every array's shape, dtype and sharding (the batch's among them).
Where the code is not all in files (a class or a loss function defined in a notebook cell or an
interactive session), nothing is kept: what it calls could change unseen.

What tracing tells beside the program (the loss function's extra names, the attention each
shape took) is kept with it. The export is jax's own format (flatbuffers, no pickle), read back
only by the same jax and jaxlib: their versions are part of the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import inspect
import json
import marshal
import os
import sys
import types
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch

from accel.config import BackendConfig

PACKAGES = ("jax", "jaxlib", "torch", "torchax", "optax", "flax", "timm", "numpy", "accel")
ACCEL_ROOT = Path(__file__).resolve().parents[2]  # the accel package
PLAIN = (bool, int, float, str, type(None))
# jax.export's serialization is flatbuffers (accel's jax extra installs it; without it nothing
# is kept).
SERIALIZES = importlib.util.find_spec("flatbuffers") is not None


@functools.cache
def versions() -> tuple[tuple[str, str], ...]:
    found = []
    for name in PACKAGES:
        try:
            found.append((name, md.version(name)))
        except md.PackageNotFoundError:
            continue
    return (("python", sys.version), *found)


@functools.lru_cache(maxsize=512)
def file_digest(path: str, mtime_ns: int, size: int) -> str:
    """A file's SHA-256 (cached by path, modification time and size)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digest_of(path: str) -> str:
    stat = os.stat(path)
    return file_digest(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def accel_digest() -> str:
    """accel's own code: its lowerings and the step decide the program."""
    files = sorted(str(p) for p in ACCEL_ROOT.rglob("*.py"))
    return hashlib.sha256("".join(digest_of(f) for f in files).encode()).hexdigest()


def code_of(obj: Any) -> list[types.CodeType]:
    """The Python code of a function, or of a class's own methods (none for a builtin)."""
    obj = inspect.unwrap(obj.func if isinstance(obj, functools.partial) else obj)
    if not isinstance(obj, type):
        code = getattr(obj, "__code__", None)
        return [code] if code is not None else code_of(type(obj))
    found = []
    for member in vars(obj).values():
        member = getattr(member, "__func__", member)  # staticmethod, classmethod
        member = getattr(member, "fget", member)  # property
        if isinstance(member, types.FunctionType):
            found.append(member.__code__)
    return found


def source_files(obj: Any) -> set[str] | None:
    """The files a class's methods or a function were read from; None where one was not read
    from a file (a notebook cell, an interactive session, a string given to exec)."""
    files = {code.co_filename for code in code_of(obj)}
    return None if any(not os.path.isfile(f) for f in files) else files


def value_digest(value: Any) -> Any:
    """What a loss function closes over, as the key holds it: tensors and arrays by value."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return ["tensor", list(value.shape), str(value.dtype), hashlib.sha256(data).hexdigest()]
    if isinstance(value, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return ["array", list(value.shape), str(value.dtype), digest]
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, list | tuple):
        return [value_digest(v) for v in value]
    if isinstance(value, dict):
        return [[value_digest(k), value_digest(v)] for k, v in value.items()]
    if isinstance(value, types.FunctionType):
        return f"{value.__module__}.{value.__qualname__}"
    return type(value).__qualname__


def function_identity(fn: Callable) -> dict:
    """A function by its code (marshal's bytes: its instructions, constants and nested
    functions) and what it closes over."""
    if isinstance(fn, functools.partial):
        return {
            "partial": function_identity(fn.func),
            "args": value_digest(list(fn.args)),
            "kwargs": value_digest(sorted(fn.keywords.items())),
        }
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: its class's code
        return {"callable": type(fn).__qualname__}
    cells = [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not fn]
    return {
        "code": hashlib.sha256(marshal.dumps(code)).hexdigest(),
        "closure": value_digest(cells),
        "defaults": value_digest(list(fn.__defaults__ or ())),
    }


def module_identity(module: torch.nn.Module) -> list:
    """Each submodule's type, mode, plain attributes and hooks, by name."""
    out = []
    for name, sub in module.named_modules():
        plain = {
            k: value_digest(v)
            for k, v in sorted(vars(sub).items())
            if not k.startswith("_") and isinstance(v, (*PLAIN, tuple, list, torch.Tensor))
        }
        hooks = {
            k: [function_identity(h) for h in v.values()]
            for k, v in sorted(vars(sub).items())
            if k.startswith("_") and k.endswith("hooks") and isinstance(v, dict) and v
        }
        kind = type(sub)
        out.append([name, f"{kind.__module__}.{kind.__qualname__}", sub.training, plain, hooks])
    return out


def tensors_identity(module: torch.nn.Module) -> list:
    params = [
        [n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()
    ]
    buffers = [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()]
    return [params, buffers]


def code_files(module: torch.nn.Module, loss_fn: Callable) -> list[str] | None:
    """The files defining the model's classes (and their bases) and the loss function; None
    where one of them is not in a file."""
    classes = {cls for m in module.modules() for cls in type(m).__mro__ if cls is not object}
    files: set[str] = set()
    for obj in (*classes, loss_fn):
        found = source_files(obj)
        if found is None:
            return None
        files |= found
    return sorted(files)


def arguments_identity(args: Any) -> str:
    """Every argument's shape, dtype and sharding."""

    def one(a: Any) -> str:
        return f"{getattr(a, 'shape', ())}/{getattr(a, 'dtype', type(a).__name__)}/" + str(
            getattr(a, "sharding", "")
        )

    leaves, tree = jax.tree.flatten(args)
    return f"{tree}|" + ";".join(one(a) for a in leaves)


def serializable(tree: Any, seen: set[type] = set()) -> None:  # noqa: B006 (the process's)
    """The named tuples in `tree` (optax's states) made known to jax.export's serialization of
    tree structures, once a process, by their class's full name."""
    if isinstance(tree, dict):
        items: Iterable = tree.values()
    elif isinstance(tree, list | tuple):
        items = tree
    else:
        return
    kind = type(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields") and kind not in seen:
        seen.add(kind)
        name = f"{kind.__module__}.{kind.__qualname__}"
        jax.export.register_namedtuple_serialization(kind, serialized_name=name)
    for item in items:
        serializable(item, seen)


@contextlib.contextmanager
def shardy() -> Iterator[None]:
    """jax's Shardy partitioner (its default) while an exported step is exported, lowered and
    called: torch_xla, once it has run in the process, turns it off for the whole process (its
    jax workarounds, for its own SPMD), and a step exported and called without it does not lower
    (jax 0.10: its sharding annotations fail MLIR's verifier). Set back after."""
    before = bool(jax.config.values["jax_use_shardy_partitioner"])
    if before:
        yield
        return
    jax.config.update("jax_use_shardy_partitioner", True)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


class SavedSteps:
    """The steps of one model and loss function kept in `folder`: a key per set of argument
    shapes, the exported step and what tracing told beside it."""

    def __init__(
        self,
        folder: Path | None,
        module: torch.nn.Module,
        loss_fn: Callable,
        optimizer: Any,
        cfg: BackendConfig,
    ):
        # The batch's structure the step gives the user's function (BatchTrees.loss): read at
        # each key, since it is known from the first step; the function's code, unwrapped.
        self.batch_tree: Callable[[], str] = getattr(loss_fn, "batch_tree", lambda: "")
        loss_fn = inspect.unwrap(loss_fn)
        files = code_files(module, loss_fn) if folder is not None and SERIALIZES else None
        self.folder = folder if files is not None else None
        if self.folder is None:
            self.identity = ""
            return
        compiler = dataclasses.replace(cfg.compiler, cache_dir="")  # where, not what
        # whether an EMA is kept, not its decay: the decay is the step's input, not its code
        step = dataclasses.replace(cfg.step, ema=bool(cfg.step.ema))
        identity = {
            "versions": versions(),
            "accel": accel_digest(),
            "files": [[f, digest_of(f)] for f in files or ()],
            "modules": module_identity(module),
            "tensors": tensors_identity(module),
            "loss_fn": function_identity(loss_fn),
            "optimizer": repr(optimizer),
            "config": repr(dataclasses.replace(cfg, step=step, compiler=compiler)),
            "platform": [jax.default_backend(), jax.devices()[0].device_kind, jax.device_count()],
        }
        self.identity = json.dumps(identity, sort_keys=True, default=str)

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def key(self, args: Any, frozen: Collection[str] = ()) -> str:
        """The step's for these arguments, with the weights `frozen` since prepare."""
        text = f"{self.identity}|{self.batch_tree()}|{arguments_identity(args)}|{sorted(frozen)}"
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def load(self, key: str, args: Any) -> tuple[jax.export.Exported, dict] | None:
        """The step kept under `key` (for `args`) and what tracing told beside it; None where
        none is (or it cannot be read: it is traced anew)."""
        if self.folder is None:
            return None
        serializable(args)
        program, info = self.folder / f"{key}.jaxexport", self.folder / f"{key}.json"
        try:
            return jax.export.deserialize(bytearray(program.read_bytes())), json.loads(
                info.read_text()
            )
        except (OSError, ValueError):
            return None

    def save(self, key: str, exported: jax.export.Exported, info: dict) -> None:
        """Kept atomically (a file appears whole or not at all), the program last: a launch
        that finds it finds its info too. A folder that cannot be written keeps nothing."""
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for name, data in (
                (f"{key}.json", json.dumps(info).encode()),
                (f"{key}.jaxexport", bytes(exported.serialize())),
            ):
                partial = self.folder / f".{name}.{os.getpid()}"
                partial.write_bytes(data)
                os.replace(partial, self.folder / name)
        except OSError:
            return
