"""The one configuration a backend is built from, checked once. `prepare`'s keywords are a
shorthand for accel.config's BackendConfig (`with_keywords`: `config=` is the base, each keyword
given sets its field), and `settle` checks it, fills in what was left open (the backend, the
devices from ACCEL_DEVICES, the compile cache) and refuses what the backend cannot run, in one
line: for `prepare` and the command line alike.

    from accel.config import BackendConfig, StepConfig
    from accel.settings import settle, with_keywords

    config = with_keywords(BackendConfig("eager", StepConfig(amp="O1")), ema=0.999)
    settled = settle(config, env={})
    assert settled.config.step.ema == 0.999 and settled.config.mesh.devices == 1
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

from accel.backends import backend_module, refusals, resolve_backend
from accel.backends.base import Supports
from accel.backends.runner import BackendModule
from accel.config import (
    AMP_LEVELS,
    ATTENTION_CHOICES,
    PP_SCHEDULES,
    REMAT_CHOICES,
    SHARD_MODES,
    AccelError,
    BackendConfig,
    BackendName,
    MeshConfig,
    StepConfig,
    shared_compile_cache,
)
from accel.parallel.mesh import ParallelDims

# The config's fields a keyword sets, and where each lives ("" the config's own), read from the
# configs themselves: prepare's signature is the one place its keywords are written.
KEYWORD_FIELDS: dict[str, str] = {
    **{f.name: "" for f in fields(BackendConfig) if f.default_factory is MISSING},  # backend
    **{f.name: "step" for f in fields(StepConfig)},
    **{f.name: "mesh" for f in fields(MeshConfig)},
}


def with_keywords(config: BackendConfig | None = None, **keywords: Any) -> BackendConfig:
    """`config` (default: every default, the backend open) with each keyword given (not None)
    set over its field: `config=` is the base, a keyword the change to it.

    >>> from accel.config import BackendConfig, StepConfig
    >>> cfg = with_keywords(BackendConfig("eager", StepConfig(amp="O1")), ema=0.999, tp=None)
    >>> (cfg.step.amp, cfg.step.ema, cfg.mesh.tp)
    ('O1', 0.999, 1)
    """
    unknown = sorted(keywords.keys() - KEYWORD_FIELDS.keys())
    if unknown:
        raise TypeError(f"not a setting of the config: {', '.join(unknown)}")
    cfg = config if config is not None else BackendConfig()  # the backend not settled yet
    sections: dict[str, dict[str, Any]] = {}
    for name, value in keywords.items():
        if value is not None:
            sections.setdefault(KEYWORD_FIELDS[name], {})[name] = value
    top = sections.pop("", {})
    parts = {
        section: replace(getattr(cfg, section), **given) for section, given in sections.items()
    }
    return replace(cfg, **top, **parts)


@dataclass(frozen=True)
class Settled:
    """A configuration checked and settled: every field filled in, the backend known to run it
    here. `why`: why this backend (asked for by name, ACCEL_BACKEND, USE_ACCEL, the default)."""

    config: BackendConfig
    why: str
    module: BackendModule

    @property
    def backend(self) -> BackendName:
        """The backend's name: `config.backend`, chosen once settled."""
        return cast(BackendName, self.config.backend)

    @property
    def supports(self) -> Supports:
        """What the settled backend runs (accel.backends.support_matrix() shows all)."""
        return self.module.SUPPORTS

    def mesh_line(self, world: int) -> str:
        """The mesh the config lays over `world` processes (or devices, where the backend runs
        its replicas on one process's devices), in one line for a launcher to print.

        >>> import accel
        >>> accel.settle(accel.with_keywords(backend="eager", tp=2)).mesh_line(4)
        'mesh dp 2 x tp 2 (4 processes)'
        """
        ranks = "processes" if self.supports.replicas == "processes" else "devices"
        return ParallelDims.of(self.config.mesh, world).describe(ranks)


def settle(config: BackendConfig, env: Mapping[str, str] | None = None) -> Settled:
    """`config` checked once, in one place, with what was left open filled in: the backend
    (`config.backend`, else ACCEL_BACKEND, else USE_ACCEL, else eager), the devices
    (`mesh.devices` 0: ACCEL_DEVICES, else 1) and the compile cache. Bad input, and a setting
    the backend cannot run, are refused in one line (AccelError); a backend that cannot run
    here raises BackendUnavailable.

    >>> from accel.config import BackendConfig
    >>> settled = settle(BackendConfig(), env={"ACCEL_DEVICES": "2"})
    >>> settled.config.backend, settled.config.mesh.devices, settled.why
    ('eager', 2, 'default, USE_ACCEL unset')
    """
    env = os.environ if env is None else env
    check_choices(config)
    check_ema(config.step)
    name, why = resolve_backend(config.backend, env)
    mesh = config.mesh
    if not mesh.devices:
        mesh = replace(mesh, devices=env_int("ACCEL_DEVICES", 1, env, least=1))
    if min(config.step.accum, mesh.devices, mesh.tp, mesh.tp_head, mesh.pp) < 1:
        raise AccelError("accum, devices, tp, tp_head and pp must be at least 1")
    if mesh.tp > 1 and mesh.tp_head > 1 and mesh.tp != mesh.tp_head:
        raise AccelError(
            f"tp={mesh.tp} and tp_head={mesh.tp_head}: the classifier splits over the "
            "tensor-parallel ranks; give the same size"
        )
    if config.step.clip_grad < 0:
        raise AccelError(f"clip_grad is a norm limit (0: none), got {config.step.clip_grad}")
    compiler = config.compiler
    if not compiler.cache_dir:
        compiler = replace(compiler, cache_dir=str(cache_dir(name, env)))
    cfg = replace(config, backend=name, mesh=mesh, compiler=compiler)
    module = backend_module(name)  # BackendUnavailable where it cannot run here
    problems = refusals(cfg, module.SUPPORTS)
    if problems:
        raise AccelError(problems[0])
    return Settled(cfg, why, module)


def check_choices(config: BackendConfig) -> None:
    """Every setting with a fixed set of values holds one of them."""
    step, mesh = config.step, config.mesh
    choices = (
        ("amp", step.amp, AMP_LEVELS),
        ("amp_dtype", step.amp_dtype, ("bfloat16", "float16")),
        ("shard", mesh.shard, SHARD_MODES),
        ("remat", step.remat, REMAT_CHOICES),
        ("attention", step.attention, ATTENTION_CHOICES),
        ("pp_schedule", mesh.pp_schedule, PP_SCHEDULES),
    )
    for name, value, allowed in choices:
        if value not in allowed:
            raise AccelError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def check_ema(step: StepConfig) -> None:
    """`ema` is a decay in [0, 1) (0: no EMA) or a function of the optimizer steps giving one."""
    ema = step.ema
    if callable(ema) or ema is False:
        return
    if isinstance(ema, bool) or not isinstance(ema, int | float) or not 0 <= ema < 1:
        raise AccelError(
            f"ema is the EMA's decay in [0, 1) (0: none; {DEFAULT_EMA_DECAY} is timm's default) "
            f"or a function of the optimizer steps giving it, got {ema!r}"
        )


DEFAULT_EMA_DECAY = 0.9998  # timm's ModelEmaV3 default


def env_int(name: str, default: int, env: Mapping[str, str] | None = None, least: int = 0) -> int:
    """The whole number, at least `least`, in environment variable `name`; `default` where it
    is unset."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < least:
        raise AccelError(f"{name} must be a whole number of at least {least}, got '{raw}'")
    return int(raw)


def cache_dir(backend: str, env: Mapping[str, str] | None = None) -> Path:
    """Where compiled programs persist between runs (JAX's and torch_xla's persistent caches):
    ACCEL_COMPILE_CACHE/BACKEND where that is set, else the user's cache folder."""
    env = os.environ if env is None else env
    root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return shared_compile_cache(backend) or root / "accel" / backend


__all__ = ["DEFAULT_EMA_DECAY", "Settled", "settle", "with_keywords"]
