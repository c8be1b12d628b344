"""Backends by name. Adding one means adding `accel/backends/<name>.py` with
`require() -> None` (raise BackendUnavailable with the install command) and
`build(cfg, ctx) -> Backend`."""

from __future__ import annotations

import importlib
from types import ModuleType

from accel.backends.base import Backend, BackendUnavailable
from accel.config import BACKENDS, ConfigError, RunConfig
from accel.distributed import DistContext


def backend_module(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
    try:
        module = importlib.import_module(f"accel.backends.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"accel.backends.{name}":
            raise BackendUnavailable(f"backend '{name}' is not available in this version") from None
        raise
    module.require()
    return module


def create_backend(cfg: RunConfig, ctx: DistContext) -> Backend:
    return backend_module(cfg.backend).build(cfg, ctx)


__all__ = ["Backend", "BackendUnavailable", "backend_module", "create_backend"]
