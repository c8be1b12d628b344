"""torch_xla backend: the torch model traced into lazy tensors and compiled by XLA (PJRT).

One graph per optimizer step (cut by torch_xla.sync), uint8 batches through MpDeviceLoader,
gradients all-reduced explicitly with scale 1/world_size before the optimizer step, XLA autocast
for AMP, and compile accounting from torch_xla's metrics.

Several replicas start through torch_xla.launch (one process per TPU chip). On PJRT CPU,
torch_xla runs several devices as threads of one process, and their in-process all-reduce does not
reliably meet (two threads compiling one graph get executables with different collective ids, and a
sync can wait on an all-reduce the other thread has not issued), so more than one CPU replica is
refused rather than left to hang.

The XLA runtime must start before the first autograd backward of the process (the autograd engine
sizes its per-device queues then): run eager and xla in separate processes, or xla first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.backends.base import BackendUnavailable, Batch, RecompileError, StepResult
from accel.backends.eager import EagerBackend
from accel.config import ConfigError, RunConfig
from accel.distributed import DistContext

INSTALL = "pip install 'accel[xla]' (torch 2.9 with torch_xla 2.9)"
KERNEL_OPTS = "torch_xla's syncfree AdamW (O0-O2: its kernel needs fp32 weights)"

try:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr
except ImportError:  # reported by require() as one line with the install command
    torch_xla = None


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


def build(cfg: RunConfig, ctx: DistContext) -> XlaBackend:
    return XlaBackend(cfg, ctx)


def runs_on_cpu() -> bool:
    """Where PJRT will run, without starting the runtime (torch_xla.launch must start it)."""
    device = os.environ.get("PJRT_DEVICE", "")
    return device == "CPU" or (not device and importlib.util.find_spec("libtpu") is None)


def launch_replicas(cfg: RunConfig, fn: Callable[[int, RunConfig], Any]) -> None:
    """Run `fn(index, cfg)` on every replica (one process per chip)."""
    if runs_on_cpu():
        raise ConfigError(
            "--backend xla runs one replica on PJRT CPU (its in-process all-reduce between "
            "threads is unreliable); use --nproc_per_node 1, or eager/compile for CPU DDP"
        )
    torch_xla.launch(fn, args=(cfg,))


def replica_context() -> DistContext:
    return DistContext(xr.global_ordinal(), xr.local_ordinal(), xr.world_size())


def init_compile_cache(path: Path, readonly: bool) -> bool:
    """Set the persistent cache before the first computation, once per process; False where the
    device cannot use one (PJRT CPU cannot deserialise executables)."""
    if xr.device_type() == "CPU":
        return False
    if not os.environ.get("XLA_PERSISTENT_CACHE_PATH"):
        path.mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(path), readonly=readonly)
    return True


def compile_count() -> int:
    return met.counter_value("UncachedCompile") or 0


def fallback_ops() -> dict[str, int]:
    """aten ops that ran on the CPU outside the XLA graph, with their call counts."""
    return {name: met.counter_value(name) or 0 for name in met.executed_fallback_ops()}


def record_shapes(batches: Iterable[Batch], shapes: set) -> Iterator[Batch]:
    for images, targets in batches:
        shapes.add((tuple(images.shape), tuple(targets.shape)))
        yield images, targets


class ParamGroups:
    """The optimizer view xm.reduce_gradients reads: the model's own parameters, whose gradients
    exist before they are copied to fp32 masters (O2)."""

    def __init__(self, params: list[torch.Tensor]):
        self.param_groups = [{"params": params}]


def updated_tensors(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """What an optimizer step changes for `param`: the parameter and its state tensors."""
    state = {k: v for k, v in optimizer.state.get(param, {}).items() if torch.is_tensor(v)}
    return {"param": param, **state}


class XlaBackend(EagerBackend):
    name = "xla"

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        if cfg.amp_level != "O0" and cfg.amp_dtype != "bfloat16":
            raise ConfigError("the xla backend does low precision in bfloat16 (--amp_dtype)")
        if cfg.remat:
            raise ConfigError("--remat is not supported by the xla backend (eager, compile, jax)")
        if cfg.shard != "none":
            raise ConfigError("--shard is not supported by the xla backend (eager, compile, jax)")
        self.persistent_cache = init_compile_cache(cfg.compile_cache_dir(), not ctx.is_main)
        super().__init__(cfg, ctx)
        if cfg.kernel_opt and not self.syncfree:
            warnings.warn(
                "--kernel-opt on xla: syncfree AdamW needs fp32 weights, O3 uses torch's AdamW",
                stacklevel=2,
            )
        self.compiles_at_start = compile_count()  # the counters are per process, not per run
        self.compiles_at_warmup: int | None = None
        self.input_shapes: set = set()

    def default_device(self) -> torch.device:
        return torch_xla.device()

    def wrap_model(self, module: nn.Module) -> nn.Module:
        if self.ctx.distributed:  # every replica starts from replica 0's weights
            xm.broadcast_master_param(module)
        # Device random draws (dropout, stochastic depth) differ between replicas.
        xm.set_rng_state(self.cfg.seed + self.ctx.rank, self.device)
        return module

    @property
    def syncfree(self) -> bool:
        """--kernel-opt's syncfree AdamW; its fused kernel takes fp32 parameters only (bf16 ones
        at O3 fail XLA's verifier or give NaN), so O3 keeps torch's AdamW."""
        return self.cfg.kernel_opt and self.amp.level != "O3"

    def adamw(self, groups: list[dict]) -> torch.optim.Optimizer:
        lr, betas = self.cfg.optim.lr, self.cfg.optim.betas
        if self.syncfree:
            from torch_xla.amp import syncfree

            return syncfree.AdamW(groups, lr=lr, betas=betas)
        # capturable: the step count lives on the device, so a skipped step can leave it as it
        # was inside the graph (torch keeps it on the host otherwise).
        return torch.optim.AdamW(groups, lr=lr, betas=betas, capturable=True)

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        loader = pl.MpDeviceLoader(
            record_shapes(batches, self.input_shapes),
            self.device,
            loader_prefetch_size=self.cfg.loader_prefetch,
            device_prefetch_size=self.cfg.device_prefetch,
            batches_per_execution=self.cfg.optim.grad_accum,
        )
        return iter(loader)

    # --- the step -----------------------------------------------------------------------------
    def autocast(self):
        if not self.amp.autocast:
            return contextlib.nullcontext()
        if xr.device_type() == "TPU":
            return torch_xla.amp.autocast(self.device, dtype=self.amp.dtype)
        # torch_xla.amp.autocast does nothing off TPU in 2.9; torch.autocast('xla') works.
        return torch.autocast("xla", dtype=self.amp.dtype)

    def accumulation_context(self, last: bool):
        return contextlib.nullcontext()  # no DDP: gradients are reduced explicitly below

    def reduce_gradients(self) -> None:
        if not self.ctx.distributed:
            return
        if self.cfg.grad_reduce == "optimizer_step":  # what xm.optimizer_step reduces with
            xm.reduce_gradients(ParamGroups(self.params))
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / self.ctx.world_size)

    def guarded_step(self, finite: torch.Tensor) -> None:
        """In the graph, without a host sync: the update is computed, then undone where
        `finite` is false (syncfree AdamW skips it in its own kernel)."""
        if self.syncfree:
            self.optimizer.step(found_inf=(~finite).float())
            return
        params = self.optimizer_params
        # Lazy tensors: a clone is a reference to the value in the graph, not a device copy.
        before = {
            p: {k: v.clone() for k, v in updated_tensors(self.optimizer, p).items()} for p in params
        }
        self.optimizer.step()
        with torch.no_grad():
            for p in params:
                for name, new in updated_tensors(self.optimizer, p).items():
                    # State the first step creates starts at zero (AdamW's moments and count).
                    old = before[p].get(name, torch.zeros_like(new))
                    new.copy_(torch.where(finite, new, old))

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if not self.ctx.distributed:
            return value
        return xm.all_reduce(xm.REDUCE_SUM, value, scale=1.0 / self.ctx.world_size)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return xm.all_reduce(xm.REDUCE_SUM, value) if self.ctx.distributed else value

    def step_done(self) -> None:
        torch_xla.sync()
        self.check_recompiles()

    def fetch_results(self, handles: list[torch.Tensor]) -> list[StepResult]:
        # Each handle is already materialised by its step's sync: a transfer, no new graph
        # (stacking them first would compile one per group size).
        rows = [handle.cpu().tolist() for handle in handles]
        return [StepResult(loss, applied > 0) for loss, applied in rows]

    def rng_state(self) -> dict[str, Any]:
        return {"xla": xm.get_rng_state(self.device)}

    def load_rng_state(self, state: dict[str, Any]) -> None:
        if "xla" in state:
            xm.set_rng_state(state["xla"], self.device)

    def host_values(self, value: torch.Tensor) -> list[float]:
        torch_xla.sync()
        return value.cpu().tolist()

    def synchronize(self) -> None:
        xm.wait_device_ops()

    # --- compile accounting -------------------------------------------------------------------
    def mark_warmup_done(self) -> None:
        self.compiles_at_warmup = compile_count()

    def compiles_after_warmup(self) -> int:
        return 0 if self.compiles_at_warmup is None else compile_count() - self.compiles_at_warmup

    def check_recompiles(self) -> None:
        limit = self.cfg.max_recompiles
        if limit >= 0 and self.compiles_after_warmup() > limit:
            raise RecompileError(
                f"{self.compiles_after_warmup()} graphs compiled after warm-up (limit "
                f"{limit}): {self.recompile_cause()}"
            )

    def recompile_cause(self) -> str:
        if len(self.input_shapes) > 1:
            shapes = ", ".join(str(s[0]) for s in sorted(self.input_shapes))
            return (
                f"the batch shape changed between steps ({shapes}); keep shapes fixed "
                "(drop_last for training, padded and masked evaluation batches)"
            )
        return (
            "the traced step changed with fixed input shapes (a Python branch on a tensor "
            "value, .item() inside the step, or a changing Python constant); "
            "PT_XLA_DEBUG_LEVEL=2 prints the cause of each compile"
        )

    def stats(self) -> dict[str, Any]:
        compile_time = met.metric_data("CompileTime")
        return {
            "compiles_after_warmup": self.compiles_after_warmup(),
            "graphs_compiled": compile_count() - self.compiles_at_start,
            "compile_time_s": compile_time[1] / 1e9 if compile_time else 0.0,
            "persistent_cache": self.persistent_cache,
            "persistent_cache_hits": met.counter_value("PersistentCacheHit") or 0,
            "fallback_ops": fallback_ops(),
            "input_shapes": sorted(str(s[0]) for s in self.input_shapes),
        }
