"""Backends by name, what each supports, and which one a process runs. Adding one means adding
a folder `accel/backends/<name>/` whose __init__ gives SUPPORTS, require(), context() and
build() (see base.py), a loader for it in REGISTRY and its name to config.BackendName."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import cast

import torch

from accel.backends.base import BackendUnavailable, Supports
from accel.backends.runner import BackendModule, Runner
from accel.config import BACKENDS, AccelError, BackendConfig, BackendName
from accel.distributed import processes_joining

USE_ACCEL_VALUES = {"": False, "0": False, "false": False, "1": True, "true": True}


# Each backend's module (or package whose __init__ gives BackendModule's names), imported when a
# backend of that name is first asked for: importing accel imports no framework. Written as
# imports, not module names, so that a reader (and an editor's "go to definition") follows each
# to the module whose build() makes the backend.
def _eager() -> BackendModule:
    from accel.backends.torch_family import eager

    return eager  # type: ignore[return-value]  # a module that provides BackendModule's names


def _compile() -> BackendModule:
    from accel.backends.torch_family import compile

    return compile  # type: ignore[return-value]


def _xla() -> BackendModule:
    from accel.backends import xla

    return xla  # type: ignore[return-value]


def _jax() -> BackendModule:
    from accel.backends import jax

    return jax  # type: ignore[return-value]


REGISTRY: dict[str, Callable[[], BackendModule]] = {
    "eager": _eager,
    "compile": _compile,
    "xla": _xla,
    "jax": _jax,
}


def resolve_backend(
    requested: str | None, env: Mapping[str, str] | None = None
) -> tuple[BackendName, str]:
    """(backend, why) from a name asked for (`backend=`), else ACCEL_BACKEND, else USE_ACCEL=1
    (the XLA compiler: jax on a CUDA GPU, xla elsewhere), else eager.

    >>> resolve_backend(None, {"ACCEL_BACKEND": "jax"})
    ('jax', 'ACCEL_BACKEND')
    """
    env = os.environ if env is None else env
    raw = env.get("USE_ACCEL", "")
    if raw.strip().lower() not in USE_ACCEL_VALUES:
        raise AccelError(f"USE_ACCEL must be 0, 1, true or false, got '{raw}'")
    if requested:
        if requested not in BACKENDS:
            raise AccelError(f"unknown backend '{requested}' (choose from {', '.join(BACKENDS)})")
        return cast(BackendName, requested), "asked for by name"
    named = env.get("ACCEL_BACKEND", "").strip()
    if named:
        if named not in BACKENDS:
            raise AccelError(f"ACCEL_BACKEND must be one of {', '.join(BACKENDS)}, got '{named}'")
        return cast(BackendName, named), "ACCEL_BACKEND"
    if USE_ACCEL_VALUES[raw.strip().lower()]:
        if torch.cuda.is_available():
            return "jax", "USE_ACCEL=1 and a CUDA GPU is visible (XLA:GPU through JAX)"
        return "xla", "USE_ACCEL=1 and no CUDA GPU is visible (torch_xla)"
    return "eager", "default, USE_ACCEL unset"


def backend_module(name: str, check: bool = True) -> BackendModule:
    """The module of backend `name`; with `check`, raises BackendUnavailable where it cannot run."""
    if name not in BACKENDS:
        raise AccelError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
    module = REGISTRY[name]()
    if check:
        module.require()
    return module


def refusals(cfg: BackendConfig, supports: Supports) -> list[str]:
    """Every setting of `cfg` the backend cannot run, one line each (empty: it can run them),
    naming prepare's keywords (`tp=2`, `shard='fsdp'`)."""
    step, mesh, name = cfg.step, cfg.mesh, cfg.backend
    checks = [
        (step.amp not in supports.amp_levels, f"amp='{step.amp}'"),
        (
            step.amp != "O0" and step.amp_dtype == "float16" and not supports.float16,
            "amp_dtype='float16'",
        ),
        (mesh.shard not in supports.shard, f"shard='{mesh.shard}'"),
        (mesh.tp > 1 and not supports.tp, "tp="),
        (mesh.tp_head > 1 and not supports.tp_head, "tp_head="),
        (mesh.pp > 1 and not supports.pp, "pp="),
        (step.remat != "none" and not supports.remat, f"remat='{step.remat}'"),
    ]
    lines = [
        f"{setting} is not supported by the {name} backend (accel.backends.support_matrix() "
        "shows what each backend runs)"
        for refused, setting in checks
        if refused
    ]
    given = {"tp": mesh.tp > 1, "tp_head": mesh.tp_head > 1, "pp": mesh.pp > 1}
    given["shard"] = mesh.shard != "none"
    processes = processes_joining()
    lines += [
        f"{k}= on the {name} backend splits over one process's devices, not across the "
        f"{processes} processes of this job (accel.backends.support_matrix() shows what each "
        "backend runs)"
        for k in supports.one_process
        if given[k] and processes > 1
    ]
    pairs = [(a.strip("-"), b.strip("-"), why) for a, b, why in supports.exclusive]
    lines += [
        f"{a}= and {b}= cannot be combined on the {name} backend: {why}"
        for a, b, why in pairs
        if given[a] and given[b]
    ]
    return lines


# The support table's rows: (what, in prepare's keywords; the Supports field)
SUPPORT_ROWS = (
    ("amp=", "amp_levels"),
    ("amp_dtype='float16'", "float16"),
    ("shard=", "shard"),
    ("tp=", "tp"),
    ("tp_head=", "tp_head"),
    ("pp=", "pp"),
    ("not together", "exclusive"),
    ("remat=", "remat"),
    ("batches on a CUDA GPU", "cuda_batches"),
    ("devices=N as", "replicas"),
    ("N replicas on CPU", "cpu_replicas"),
    ("one process only", "one_process"),
    ("kernel_opt=True", "kernel_opt"),
    ("backward hooks", "gradient_hooks"),
    ("optimizers", "optimizers"),
)


def support_matrix(label: Callable[[str], str] = str) -> str:
    """What each backend runs, as a Markdown table: one row per feature (named by prepare's
    keywords, or by what `label` makes of them), one column per backend.

    >>> print(support_matrix().splitlines()[2])
    | amp= | O0, O1, O2, O3 | O0, O1, O2, O3 | O0, O1, O2, O3 | O0, O1, O2, O3 |
    """
    tables = {b: REGISTRY[b]().SUPPORTS for b in BACKENDS}

    def mark(value, key: str) -> str:
        if isinstance(value, bool):
            return "yes" if value else "-"
        if isinstance(value, tuple) and value and isinstance(value[0], tuple):
            return "; ".join(label(f"{a.strip('-')}= + {b.strip('-')}=") for a, b, _ in value)
        if isinstance(value, tuple) and key == "one_process":  # keywords
            return ", ".join(label(f"{v}=") for v in value) or "-"
        if isinstance(value, tuple):
            return ", ".join(v for v in value if v != "none") or "-"
        return label(str(value))

    lines = ["| | " + " | ".join(BACKENDS) + " |", "|---" * (len(BACKENDS) + 1) + "|"]
    for what, key in SUPPORT_ROWS:
        cells = [mark(getattr(tables[b], key), key) for b in BACKENDS]
        lines.append(f"| {label(what)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "BackendUnavailable",
    "Runner",
    "Supports",
    "backend_module",
    "refusals",
    "resolve_backend",
    "support_matrix",
]
