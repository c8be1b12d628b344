"""torch_xla's runtime for this process: the one guarded import of torch_xla, which versions pair,
the process context (one process over an SPMD device mesh, or one of several processes started by
torchrun), and the checks made before the runtime starts or right after it did.

The XLA runtime must start before the first autograd backward of the process (the autograd engine
sizes its per-device queues then): run eager and xla in separate processes, or xla first; a process
whose first backward ran before is refused in one line (check_autograd).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from accel.backends.base import BackendUnavailable
from accel.backends.quiet import quiet_imports
from accel.config import AccelError, BackendConfig, MeshConfig
from accel.distributed import DistContext, env_context, launched_by_torchrun
from accel.parallel.mesh import ParallelDims

INSTALL = "pip install 'accel[xla]' (torch 2.9 with torch_xla 2.9)"

# XLA's C++ warnings (a partitioner's deprecation notice at every mesh run) say nothing about the
# run; a user's own setting wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    with quiet_imports():
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
except ImportError:  # reported by require() as one line with the install command
    # None where it cannot be imported: the package's other files import these names from here.
    torch_xla = xm = met = pl = xs = xr = None  # type: ignore[assignment]


def check_versions(torch_version: str, xla_version: str) -> None:
    """torch_xla X.Y only runs with torch X.Y (its metadata does not say so)."""
    if torch_version.split(".")[:2] != xla_version.split(".")[:2]:
        raise BackendUnavailable(
            f"torch {torch_version} does not pair with torch_xla {xla_version}: install the same "
            f"major.minor of both, e.g. {INSTALL}"
        )


def require() -> None:
    if torch_xla is None:
        raise BackendUnavailable(f"the xla backend needs torch_xla: {INSTALL}")
    check_versions(torch.__version__, torch_xla.__version__)


def runs_on_cpu() -> bool:
    """Where PJRT will run, without starting the runtime."""
    device = os.environ.get("PJRT_DEVICE", "")
    return device == "CPU" or (not device and importlib.util.find_spec("libtpu") is None)


def context(cfg: BackendConfig) -> DistContext:
    """One process: over a device mesh (SPMD) when devices=N, N > 1; one of several processes
    when torchrun started it (TPU hosts)."""
    processes = launched_by_torchrun()
    check_tp(cfg.mesh)
    if processes:
        return env_context()
    devices = cfg.mesh.devices
    if devices > 1:
        if cfg.mesh.tp > 1:  # the sizes refused before the runtime starts
            ParallelDims.of(cfg.mesh, devices)
        start_spmd(devices)
    return DistContext()


def check_tp(mesh: MeshConfig) -> None:
    """tp splits the devices of the SPMD mesh one process drives: refused in one line without
    one (devices=1; several processes are refused by SUPPORTS.one_process)."""
    if mesh.tp < 2 or mesh.devices > 1:
        return
    raise AccelError(
        f"tp={mesh.tp} on xla splits the devices of the SPMD mesh one process drives: give "
        f"devices=N, N a multiple of {mesh.tp}; devices={mesh.devices}"
    )


def start_spmd(devices: int) -> None:
    """SPMD mode over `devices` devices, before the runtime starts (PJRT CPU: CPU_NUM_DEVICES,
    set here where the user did not)."""
    if runs_on_cpu():
        have = os.environ.setdefault("CPU_NUM_DEVICES", str(devices))
        if int(have) < devices:
            raise AccelError(
                f"devices={devices} needs {devices} XLA CPU devices, CPU_NUM_DEVICES is {have}"
            )
    if not xr.is_spmd():  # prepare may run again in the same process
        xr.use_spmd()
    # torch_xla's mark_sharding imports torchax (and flax) at its first call, whose import
    # notices would land mid-run: import it now, with those notices dropped.
    with quiet_imports():
        from torch_xla._internal.jax_workarounds import maybe_get_torchax

        maybe_get_torchax()
    found = xr.global_runtime_device_count()
    if found < devices:
        raise AccelError(f"devices={devices}: the XLA runtime sees {found} devices")


def check_autograd(device: torch.device) -> None:
    """torch's autograd engine sizes its per-device queues once, at the process's first
    backward: one run before XLA's runtime started left none for XLA, and every XLA backward
    would then fail with an INTERNAL ASSERT. A backward through one lazy scalar tells (nothing
    is compiled or run: its gradient is never synced)."""
    probe = torch.zeros((), device=device, requires_grad=True)
    try:
        (probe * 2.0).backward()
    except RuntimeError as err:
        if "device_ready_queues_" not in str(err):
            raise
        raise AccelError(
            "the xla backend must start before the first backward of the process (torch's "
            "autograd engine ran one on the CPU before XLA's runtime started, and has no queue "
            "for XLA now): call accel.prepare(..., backend='xla') or torch_xla.device() before "
            "the first loss.backward(), or train on xla in a fresh process"
        ) from None


def init_compile_cache(path: Path, readonly: bool) -> bool:
    """Set the persistent cache before the first computation, once per process; False where the
    device cannot use one (PJRT CPU cannot deserialise executables)."""
    if xr.device_type() == "CPU":
        return False
    if not os.environ.get("XLA_PERSISTENT_CACHE_PATH"):
        path.mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(path), readonly=readonly)
    return True
