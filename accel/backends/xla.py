"""torch_xla backend: the torch model traced into lazy tensors and compiled by XLA (PJRT).

One graph per optimizer step (cut by torch_xla.sync), uint8 batches through MpDeviceLoader, XLA
autocast for AMP, and compile accounting from torch_xla's metrics.

`--nproc_per_node N` trains on an N-device SPMD mesh from this one process (torch_xla's SPMD
mode, as it scales on TPU pods): MpDeviceLoader hands over each global batch split along the
mesh's `data` axis, the weights are replicated, and the step's gradient all-reduce is the one
XLA's SPMD partitioner inserts into the step graph (the loss is the global batch's mean, so the
partitioner turns the gradient into per-device sums and an all-reduce over `data`). `--shard
full` is torch_xla's FSDPv2 on the same mesh (axis `fsdp`): weights and optimizer state split on
their first axis. `--tp N` makes the mesh 2-D, `data` x `model` (N devices along `model`): each
linear layer of the plan (accel.parallel.tensor_parallel) has its weight, its optimizer moments
and its EMA split along `model` (Megatron's columns and rows), batches split along `data` only,
and the partitioner makes the collectives of both axes. On PJRT CPU the mesh's devices are
CPU_NUM_DEVICES.

Processes started one a chip by torchrun on a TPU host (torch_xla's multi-process replicas) take
the explicit path: gradients all-reduced with xm.all_reduce, scale 1/world size, before clipping
and the update. PJRT CPU's multi-process collectives do not reliably meet, so that path is not
tested here.

The XLA runtime must start before the first autograd backward of the process (the autograd engine
sizes its per-device queues then): run eager and xla in separate processes, or xla first; a process
whose first backward ran before is refused in one line (check_autograd).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from accel.amp import amp_policy
from accel.backends.base import (
    BackendStats,
    BackendUnavailable,
    Batch,
    LossFn,
    MetricFn,
    ModelInit,
    StepResult,
    Supports,
    split_batch,
)
from accel.backends.host_reads import RefuseHostReads
from accel.backends.quiet import quiet_imports
from accel.backends.torch_core import (
    TorchCore,
    accumulate,
    init_optimizer_state,
    local_norm,
    metric_sums,
    where_guard,
)
from accel.config import BackendConfig, ConfigError, MeshConfig
from accel.distributed import DistContext, env_context, launched_by_torchrun
from accel.models.factory import ImageClassifier
from accel.optim import OptimizerSpec
from accel.parallel import effective_shard
from accel.parallel.materialize import whole
from accel.parallel.mesh import ParallelDims
from accel.parallel.tensor_parallel import resolve_plan, weight_splits

INSTALL = "pip install 'accel[xla]' (torch 2.9 with torch_xla 2.9)"
SUPPORTS = Supports(
    shard=("none", "full"),
    tp=True,
    exclusive=(
        ("--tp", "--shard", "FSDPv2 splits every weight on its first axis over the whole mesh"),
    ),
    replicas="devices",
    kernel_opt="torch_xla's syncfree AdamW (O0-O2: its kernel needs fp32 weights)",
)

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
    torch_xla = None  # type: ignore[assignment]  # None where it cannot be imported


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


def build(cfg: BackendConfig, ctx: DistContext) -> XlaBackend:
    return XlaBackend(cfg, ctx)


def runs_on_cpu() -> bool:
    """Where PJRT will run, without starting the runtime."""
    device = os.environ.get("PJRT_DEVICE", "")
    return device == "CPU" or (not device and importlib.util.find_spec("libtpu") is None)


def context(cfg: BackendConfig) -> DistContext:
    """One process: over a device mesh (SPMD) when --nproc_per_node > 1; one of several
    processes when torchrun started it (TPU hosts)."""
    processes = launched_by_torchrun()
    check_tp(cfg.mesh, processes)
    if processes:
        return env_context()
    devices = cfg.mesh.devices
    if devices > 1:
        if cfg.mesh.tp > 1:  # the sizes refused before the runtime starts
            ParallelDims.of(cfg.mesh, devices)
        start_spmd(devices)
    return DistContext()


def check_tp(mesh: MeshConfig, processes: bool) -> None:
    """tp splits the devices of the SPMD mesh one process drives: refused in one line without
    one (one device, or one of several processes, each driving its own device)."""
    if mesh.tp < 2 or (mesh.devices > 1 and not processes):
        return
    have = "this process is one of several started by torchrun" if processes else "devices=1"
    raise ConfigError(
        f"--tp {mesh.tp} on xla splits the devices of the SPMD mesh one process drives: give "
        f"devices=N (--nproc_per_node N), N a multiple of {mesh.tp}; {have}"
    )


def start_spmd(devices: int) -> None:
    """SPMD mode over `devices` devices, before the runtime starts (PJRT CPU: CPU_NUM_DEVICES,
    set here where the user did not)."""
    if runs_on_cpu():
        have = os.environ.setdefault("CPU_NUM_DEVICES", str(devices))
        if int(have) < devices:
            raise ConfigError(
                f"--nproc_per_node {devices} needs {devices} XLA CPU devices, "
                f"CPU_NUM_DEVICES is {have}"
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
        raise ConfigError(f"--nproc_per_node {devices}: the XLA runtime sees {found} devices")


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
        raise ConfigError(
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


def compile_count() -> int:
    return met.counter_value("UncachedCompile") or 0


def fallback_ops() -> dict[str, int]:
    """aten ops that ran on the CPU outside the XLA graph, with their call counts."""
    return {name: met.counter_value(name) or 0 for name in met.executed_fallback_ops()}


def keyed_batches(batches: Iterable[Batch], shapes: set) -> Iterator[dict[str, torch.Tensor]]:
    """Host batches as MpDeviceLoader takes them (dicts: "0", "1", ... by position, every
    tensor of the tuple whatever its rank), recording their shapes."""
    for batch in batches:
        shapes.add(tuple(tuple(t.shape) for t in batch))
        yield {str(i): t for i, t in enumerate(batch)}


def unkeyed(batch: dict[str, torch.Tensor]) -> Batch:
    return tuple(batch[str(i)] for i in range(len(batch)))


class ParamGroups:
    """The optimizer view xm.reduce_gradients reads: the model's own parameters, whose gradients
    exist before they are copied to fp32 masters (O2)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.param_groups = [{"params": params}]


def syncfree_extra_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """What syncfree AdamW keeps unlike torch's AdamW, as its first step makes it: the step
    count on the device, and an empty max_exp_avg_sq."""
    return {
        "step": torch.zeros((), dtype=torch.float, device=param.device),
        "max_exp_avg_sq": torch.empty(0, dtype=torch.float, device=param.device),
    }


def syncfree_guard(optimizer: torch.optim.Optimizer, scaler: Any, finite: torch.Tensor) -> None:
    """torch_xla's syncfree AdamW skips the update in its own kernel."""
    # syncfree AdamW's step takes found_inf; torch's Optimizer.step type does not.
    optimizer.step(found_inf=(~finite).float())  # type: ignore[call-overload]


class XlaBackend:
    name = "xla"
    pin_memory = False  # MpDeviceLoader stages host batches itself
    trains_in_place = True  # the model's own parameters, moved to the XLA device
    compiles_per_shape = True
    explain_compiles = "PT_XLA_DEBUG_LEVEL=2 prints the cause of each compile"
    threaded = False
    sharded_checkpoint = False  # one process holds every array: one file

    def __init__(self, cfg: BackendConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        cache = Path(cfg.compiler.cache_dir)
        self.persistent_cache = init_compile_cache(cache, not ctx.is_main)
        self.amp = amp_policy(cfg.step.amp, cfg.step.amp_dtype)
        self.device = torch_xla.device()
        check_autograd(self.device)
        self.data_parallel = (ctx.rank, ctx.world_size)
        # A device mesh driven by this process: one host batch a step, split along its axis.
        self.spmd = xr.is_spmd() and not ctx.distributed
        check_tp(cfg.mesh, ctx.distributed)
        self.mesh_devices = cfg.mesh.devices if self.spmd else 1
        # Devices the global batch is split over: the mesh's `data` axis.
        self.local_replicas = self.mesh_devices
        self.shard = effective_shard(cfg.mesh.shard, self.local_replicas)
        self.axis = "fsdp" if self.shard == "full" else "data"
        self.tp = cfg.mesh.tp if self.spmd else 1
        self.splits: dict[str, int] = {}  # split parameter name -> its axis along `model`
        if self.spmd:
            n = self.mesh_devices
            if self.tp > 1:
                dims = ParallelDims.of(cfg.mesh, n)
                self.local_replicas = dims.dp
                self.mesh = xs.Mesh(np.arange(n), (dims.dp, dims.tp), (self.axis, "model"))
            else:
                self.mesh = xs.Mesh(np.arange(n), (n,), (self.axis,))
        # syncfree AdamW's fused kernel takes fp32 parameters only (bf16 ones at O3 fail XLA's
        # verifier or give NaN), so O3 keeps torch's AdamW.
        self.syncfree = cfg.step.kernel_opt and self.amp.level != "O3"
        if cfg.step.kernel_opt and not self.syncfree:
            warnings.warn(
                "--kernel-opt on xla: syncfree AdamW needs fp32 weights, O3 uses torch's AdamW",
                stacklevel=2,
            )
        guard = syncfree_guard if self.syncfree else where_guard
        extra = syncfree_extra_state if self.syncfree else None
        self.core = TorchCore(self.amp, self.device, self.amp.master_weights, guard, extra)
        # (device type, backend) -> the context the step runs in: RefuseHostReads once adopted
        self.host_reads: Callable[[str, str], contextlib.AbstractContextManager]
        self.host_reads = lambda *_: contextlib.nullcontext()
        self.compiles_at_start = compile_count()  # the counters are per process, not per run
        self.compiles_at_warmup: int | None = None
        self.input_shapes: set = set()

    def adopt(
        self,
        model: nn.Module,
        optimizer: OptimizerSpec,
        loss_fn: LossFn,
        init: ModelInit | None = None,
    ) -> None:
        model = whole(model, init)
        head = model.classifier_parameters() if isinstance(model, ImageClassifier) else []
        self.attach(model, lambda named: self.optimizer(optimizer, dict(named)), loss_fn, head)
        self.host_reads = RefuseHostReads  # a loss that reads the host: name its line

    def optimizer(self, spec: OptimizerSpec, named: dict) -> torch.optim.Optimizer:
        """The user's optimizer over the tensors this backend updates: with --kernel-opt, AdamW
        as torch_xla's syncfree one (the skip inside its kernel); otherwise capturable (Adam's
        step count on the device, so where_guard restores it inside the graph)."""
        if self.syncfree and spec.kind == "AdamW":
            from torch_xla.amp import syncfree

            return spec.build(named, optimizer_class=syncfree.AdamW)
        flags: dict[str, Any] = {} if spec.kind == "SGD" else {"capturable": True}
        return spec.build(named, **flags)

    def attach(
        self, model: nn.Module, build_optimizer: Callable, loss_fn: LossFn, head: list
    ) -> None:
        self.module = self.forward_module = model.to(self.device, dtype=self.amp.param_dtype)
        if self.ctx.distributed:  # every replica starts from replica 0's weights
            xm.broadcast_master_param(self.module)
        if self.tp > 1:  # names as the module trained has them (it is never wrapped with tp)
            plan = resolve_plan(self.module, self.cfg.mesh.tp_plan, self.tp)
            self.splits = weight_splits(self.module, plan)
            # Split before the fp32 masters, the optimizer's moments and the EMA are made from
            # the weights, so that none of them is ever held whole.
            self.mark_tp()
        if self.shard == "full":  # FSDPv2: the weights split on their first axis over `fsdp`
            from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
                SpmdFullyShardedDataParallel,
            )

            self.forward_module = SpmdFullyShardedDataParallel(self.module, mesh=self.mesh)
        # Device random draws (dropout, stochastic depth) differ between replicas.
        xm.set_rng_state(self.cfg.step.seed + self.ctx.rank, str(self.device))
        self.core.attach([self.module], build_optimizer, head, self.cfg.step.ema)
        if self.tp > 1:
            # The moments made now (zeros, as the first step would make them), to be split as
            # their weight is: made by the step, they would be whole until it ends.
            init_optimizer_state(self.core.optimizer, self.core.extra_state)
            self.mark_tp()
        self.loss_fn = loss_fn

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Every tensor of each batch on the device; on a mesh, each split along its first
        axis over the mesh's axis (the tensors' ranks are read from the first batch)."""
        keyed = keyed_batches(batches, self.input_shapes)
        first = next(keyed, None)
        if first is None:
            return
        compiler = self.cfg.compiler
        loader = pl.MpDeviceLoader(
            itertools.chain([first], keyed),
            self.device,
            loader_prefetch_size=compiler.loader_prefetch,
            device_prefetch_size=compiler.device_prefetch,
            batches_per_execution=self.cfg.step.accum,
            input_sharding=self.batch_sharding(first),
        )
        for batch in loader:
            yield unkeyed(batch)

    def batch_sharding(self, batch: dict[str, torch.Tensor]) -> dict | None:
        if not self.spmd:
            return None
        return {key: xs.ShardingSpec(self.mesh, self.split_first(t)) for key, t in batch.items()}

    def split_first(self, tensor: torch.Tensor) -> tuple[str | None, ...]:
        """A batch tensor's partition spec: its first axis over the mesh's data axis."""
        return (self.axis,) + (None,) * (tensor.dim() - 1)

    # --- the step -----------------------------------------------------------------------------
    def autocast(self):
        if not self.amp.autocast:
            return contextlib.nullcontext()
        if xr.device_type() == "TPU":
            return torch_xla.amp.autocast(self.device, dtype=self.amp.dtype)
        # torch_xla.amp.autocast does nothing off TPU in 2.9; torch.autocast('xla') works.
        return torch.autocast("xla", dtype=self.amp.dtype)

    def split(self, batch: tuple, parts: int) -> list[tuple]:
        return split_batch(batch, parts)

    def train_step(
        self, micro_batches: list[Batch], lr: float | list[float], ema_decay: float = 0.0
    ) -> torch.Tensor:
        """One graph: forward and backward of every micro-batch, the explicit gradient
        all-reduce, clipping, the guarded update and the EMA's; returns [mean loss, applied,
        *extras]."""
        micro_batches = [tuple(t.to(self.device) for t in batch) for batch in micro_batches]
        means = accumulate(micro_batches, self.forward_loss, self.core, self.scope)
        self.reduce_gradients()
        means = self.all_reduce(means, mean=True)  # [loss, *extras] over the replicas
        clip = self.cfg.step.clip_grad
        applied = self.core.update(lr, means[0], clip, self.grad_norm, ema_decay)
        self.step_done()
        return torch.cat([means[:1], applied.float()[None], means[1:]])

    def forward_loss(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.forward_module, batch)

    @contextlib.contextmanager
    def scope(self, last: bool):
        """A micro-step's: autocast, and a user's loss refused where it reads the host."""
        with self.autocast(), self.host_reads("xla", "xla"):
            yield

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return local_norm([p.grad for p in params if p.grad is not None])

    def reduce_gradients(self) -> None:
        """Processes: the explicit all-reduce. A mesh (one process, global tensors): nothing
        here, the SPMD partitioner reduces the gradients inside the step graph."""
        if not self.ctx.distributed:
            return
        if self.cfg.compiler.grad_reduce == "optimizer_step":  # what xm.optimizer_step does
            # ParamGroups stands in for the optimizer: reduce_gradients reads only param_groups.
            xm.reduce_gradients(ParamGroups(self.core.params))  # type: ignore[arg-type]
            return
        grads = [p.grad for p in self.core.params if p.grad is not None]
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / self.ctx.world_size)

    def all_reduce(self, value: torch.Tensor, mean: bool = False) -> torch.Tensor:
        if not self.ctx.distributed:
            return value
        scale = 1.0 / self.ctx.world_size if mean else 1.0
        # A tensor in, a tensor out (a list only for a list in).
        return cast(torch.Tensor, xm.all_reduce(xm.REDUCE_SUM, value, scale=scale))

    def step_done(self) -> None:
        torch_xla.sync()

    def fetch_results(self, handles: list[torch.Tensor]) -> list[StepResult]:
        # Each handle is already materialised by its step's sync: a transfer, no new graph
        # (stacking them first would compile one per group size).
        rows = [handle.cpu().tolist() for handle in handles]
        return StepResult.from_rows(rows, self.core.extra_keys)

    def evaluate_sums(
        self, batches: Iterable[Batch], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        before = compile_count()
        try:
            with self.weights(ema):
                keys, sums = metric_sums(
                    self.module, self.forward_module, map(self.on_device, batches), metric_fn,
                    self.autocast, self.device, after_batch=torch_xla.sync,
                )  # fmt: skip
                sums = self.all_reduce(sums)
                torch_xla.sync()
        finally:  # evaluation's own graphs (--eval_every) are not recompiles of the step
            if self.compiles_at_warmup is not None:
                self.compiles_at_warmup += compile_count() - before
        return dict(zip(keys, sums.cpu().tolist(), strict=True))

    @torch.no_grad()
    def forward(self, inputs: tuple) -> Any:
        self.module.eval()
        try:
            with self.autocast():
                return self.forward_module(*self.on_device(tuple(inputs)))
        finally:
            self.module.train()

    @contextlib.contextmanager
    def weights(self, ema: bool):
        """The live weights, or with `ema` the EMA's in their place (sharded alike)."""
        if not ema:
            yield
            return
        with self.core.ema_weights():
            self.reshard()
            yield
        self.reshard()

    def on_device(self, batch: Batch) -> Batch:
        """A host batch on the device; on a mesh, each tensor split along its first axis over
        the mesh's axis (batches from device_batches arrive split already)."""
        if batch[0].device.type == "xla":
            return batch
        batch = tuple(t.to(self.device) for t in batch)
        if self.spmd:
            for tensor in batch:
                if tensor.dim():
                    xs.mark_sharding(tensor, self.mesh, self.split_first(tensor))
        return batch

    # --- state --------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return self.core.named_state()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.core.load_named_state(state)
        self.reshard()
        torch_xla.sync()

    def reshard(self) -> None:
        """A copy into a tensor drops its sharding: FSDPv2's again, or tp's."""
        self.mark_tp()
        if self.shard != "full":
            return
        for param in self.module.parameters():
            if param.dim():
                xs.mark_sharding(param, self.mesh, (self.axis,) + (None,) * (param.dim() - 1))

    def mark_tp(self) -> None:
        """Each weight of the tp plan split along the mesh's `model` axis on its axis, and the
        tensors laid out as it (its fp32 master, its optimizer moments, its EMA) alike; the rest
        stays replicated. Marking a tensor split the same way again changes nothing."""
        if not self.splits:
            return
        params = dict(self.module.named_parameters())
        for name, axis in self.splits.items():
            param = params[name]
            spec = tuple("model" if i == axis else None for i in range(param.dim()))
            for tensor in self.laid_out_as(param):
                xs.mark_sharding(tensor, self.mesh, spec)

    def laid_out_as(self, param: nn.Parameter) -> list[torch.Tensor]:
        """`param` and what the optimizer keeps of its shape for it (once attached): its fp32
        master, its moments (not the step count, not syncfree's empty buffer), its EMA."""
        core = self.core
        if not hasattr(core, "optimizer"):
            return [param]
        updated = core.updated(param)
        state = core.optimizer.state.get(updated, {})
        ema = {id(p): e for p, e in zip(core.params, core.ema, strict=False)}
        found = [param, updated, *state.values(), ema.get(id(param))]
        out: dict[int, torch.Tensor] = {}
        for tensor in found:
            if torch.is_tensor(tensor) and tensor.shape == param.shape:
                out.setdefault(id(tensor), tensor)
        return list(out.values())

    def rng_state(self) -> dict[str, torch.Tensor]:
        seed = xm.get_rng_state(str(self.device))  # an unsigned 64-bit seed: kept as two halves
        return {"xla": torch.tensor([seed >> 32, seed & 0xFFFFFFFF], dtype=torch.int64)}

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        if "xla" in state:
            high, low = state["xla"].tolist()
            xm.set_rng_state((high << 32) | low, str(self.device))

    def any_rank(self, flag: bool) -> bool:
        if not self.ctx.distributed:
            return flag
        local = torch.tensor([float(flag)], device=self.device)
        value = cast(torch.Tensor, xm.all_reduce(xm.REDUCE_MAX, local))
        return bool(value.cpu().item())

    def synchronize(self) -> None:
        xm.wait_device_ops()

    # --- compile accounting -------------------------------------------------------------------
    def mark_warmup_done(self) -> None:
        self.compiles_at_warmup = compile_count()

    def compiles_after_warmup(self) -> int:
        return 0 if self.compiles_at_warmup is None else compile_count() - self.compiles_at_warmup

    def stats(self) -> BackendStats:
        compile_time = met.metric_data("CompileTime")
        return BackendStats(
            graphs_compiled=compile_count() - self.compiles_at_start,
            compiles_after_warmup=self.compiles_after_warmup(),
            compile_time_s=compile_time[1] / 1e9 if compile_time else 0.0,
            persistent_cache=self.persistent_cache,
            persistent_cache_hits=met.counter_value("PersistentCacheHit") or 0,
            fallback_ops=fallback_ops(),
            devices=self.mesh_devices,
            shard=self.shard,
            state_bytes=self.core.measured,
            details={
                "input_shapes": sorted(str(s[0]) for s in self.input_shapes),
                "tp": self.tp,
            },
        )
