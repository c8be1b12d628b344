"""Backends by name, and what each supports. Adding one means adding `accel/backends/<name>.py`
with SUPPORTS, require(), context() and build() (see base.py), and its name to config.BACKENDS."""

from __future__ import annotations

import importlib

from accel.backends.base import Backend, BackendModule, BackendUnavailable, Supports
from accel.config import BACKENDS, ConfigError, RunConfig
from accel.distributed import DistContext


def backend_module(name: str, check: bool = True) -> BackendModule:
    """The module of backend `name`; with `check`, raises BackendUnavailable where it cannot run."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
    module = importlib.import_module(f"accel.backends.{name}")
    if check:
        module.require()
    return module


def create_backend(cfg: RunConfig, ctx: DistContext) -> Backend:
    return backend_module(cfg.backend).build(cfg, ctx)


def refusals(cfg: RunConfig, supports: Supports) -> list[str]:
    """Every option of `cfg` the backend cannot run, one line each (empty: it can run them)."""
    par, name = cfg.parallel, cfg.backend
    checks = [
        (cfg.amp_level not in supports.amp_levels, "--amp_level " + cfg.amp_level),
        (
            cfg.amp_level != "O0" and cfg.amp_dtype == "float16" and not supports.float16,
            "--amp_dtype float16",
        ),
        (par.shard not in supports.shard, "--shard " + par.shard),
        (par.tp_head > 1 and not supports.tp_head, "--tp_head"),
        (par.pp > 1 and not supports.pp, "--pp"),
        (cfg.remat and not supports.remat, "--remat"),
        (cfg.data.data_device == "gpu" and not supports.data_device_gpu, "--data_device gpu"),
    ]
    return [
        f"{flag} is not supported by the {name} backend (launch_single_task --backends "
        "shows what each backend runs)"
        for refused, flag in checks
        if refused
    ]


def check_supported(cfg: RunConfig) -> BackendModule:
    """The backend's module, once it is known to run here and to support every option given."""
    module = backend_module(cfg.backend)
    problems = refusals(cfg, module.SUPPORTS)
    if problems:
        raise ConfigError(problems[0])
    return module


def support_matrix() -> str:
    """What `launch_single_task --backends` prints: one row per feature, one column per backend."""
    tables = {b: importlib.import_module(f"accel.backends.{b}").SUPPORTS for b in BACKENDS}

    def mark(value) -> str:
        if isinstance(value, bool):
            return "yes" if value else "-"
        if isinstance(value, tuple):
            return ", ".join(v for v in value if v != "none") or "-"
        return str(value)

    rows = [
        ("--amp_level", "amp_levels"),
        ("--amp_dtype float16", "float16"),
        ("--shard", "shard"),
        ("--tp_head", "tp_head"),
        ("--pp", "pp"),
        ("--remat", "remat"),
        ("--data_device gpu", "data_device_gpu"),
        ("--nproc_per_node N as", "replicas"),
        ("N replicas on CPU", "cpu_replicas"),
        ("--kernel-opt", "kernel_opt"),
    ]
    lines = ["| | " + " | ".join(BACKENDS) + " |", "|---" * (len(BACKENDS) + 1) + "|"]
    for label, key in rows:
        cells = [mark(getattr(tables[b], key)) for b in BACKENDS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "Backend",
    "BackendUnavailable",
    "Supports",
    "backend_module",
    "check_supported",
    "create_backend",
    "refusals",
    "support_matrix",
]
