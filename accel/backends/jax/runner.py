"""The jax backend's Runner, composed of its parts: Runtime (runtime.py: the devices as a mesh,
batches onto them, collectives), TrainState (state.py: the arrays trained and their layout),
Tracer (tracing.py: the torch model run by torchax), CompiledStep and Evaluation (compiled.py:
the programs XLA compiles)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import torch

import accel.backends.jax.runtime as runtime
from accel.backends.base import (
    BackendStats,
    Batch,
    LossFn,
    MetricFn,
    ModelInit,
    RunnerBase,
    SinceStart,
    StepResult,
    split_batch,
)
from accel.backends.jax.attention import AttentionKernels
from accel.backends.jax.compiled import CompiledStep, CompileMonitor, Evaluation
from accel.backends.jax.optimizer import OptaxGroups
from accel.backends.jax.runtime import Runtime
from accel.backends.jax.state import TrainState
from accel.backends.jax.torchax_compat import removed_ops
from accel.backends.jax.tracing import Tracer, torch_sdpa
from accel.backends.jax.values import Precision
from accel.backends.quiet import quiet_imports
from accel.batches import ModelCall
from accel.config import AccelError, BackendConfig
from accel.distributed import DistContext
from accel.optim import OptimizerSpec
from accel.parallel.materialize import whole


class JaxRunner(RunnerBase):
    """JAX's XLA through torchax: the torch model traced into one jitted step over arrays of
    its own."""

    name = "jax"
    pin_memory = False  # device_put stages host arrays itself
    trains_in_place = False  # arrays of its own; the torch module is traced, never run
    compiles_per_shape = True
    explain_compiles = "JAX_EXPLAIN_CACHE_MISSES=1 prints the cause of each compile"
    threaded = True  # JAX's runtime runs threads of its own
    sharded_checkpoint = False  # one process holds every array it trains: one file

    def __init__(self, cfg: BackendConfig, ctx: DistContext):
        super().__init__(cfg, ctx)  # float16 is refused before (SUPPORTS.float16: refusals)
        step = cfg.step
        self.precision = Precision.of(self.amp)
        # Before the first compile: JAX reads the cache settings once per process. Every
        # program is kept, not only those that took a second to compile (JAX's default): a
        # second launch would compile the small ones again (the optimizer's init, the
        # evaluation's sums), seconds before its first step.
        jax.config.update("jax_compilation_cache_dir", cfg.compiler.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        self.compile_events = SinceStart(CompileMonitor.get().snapshot)
        self.runtime = Runtime(cfg, ctx)
        self.data_parallel = self.runtime.data_parallel
        self.local_replicas = self.runtime.local_replicas
        self.step_devices = cfg.mesh.devices  # this process's, tensor-parallel ones included
        with quiet_imports(), removed_ops():  # torchax registers its ops here
            self.env = runtime.torchax.default_env()
        on_gpu = jax.default_backend() == "gpu"
        self.attention = AttentionKernels(flash=on_gpu, choice=step.attention)
        # Attention always goes through jax.nn.dot_product_attention (cuDNN flash or XLA's own
        # ops, per shape as step.attention says):
        # torchax's own lowering computes it in fp32 and hands fp32 on to the rest of the
        # block, so O1-O3 would run most matmuls in fp32.
        self.sdpa = torch_sdpa(self.attention)

    def adopt(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerSpec,
        loss_fn: LossFn,
        init: ModelInit | None = None,
    ) -> None:
        model = whole(model, init)
        # The torch side (names, shapes, checkpoint layout): traced, never run.
        self.tracer = Tracer(model, self.env, self.sdpa, self.amp, self.cfg.step.remat)
        optax_groups = OptaxGroups(optimizer)
        self.state = TrainState(model, optax_groups, self.precision, self.runtime, self.cfg)
        self.step = CompiledStep(
            self.cfg, self.runtime, self.state, self.tracer, self.attention, loss_fn
        )
        self.evaluation = Evaluation(self.runtime, self.state, self.tracer)

    # --- the state, as the parts keep it --------------------------------------------------------
    @property
    def optimizer(self) -> OptaxGroups:
        """The user's optimizer as optax, one chain per parameter group."""
        return self.state.optimizer

    # --- what its parts do ---------------------------------------------------------------------
    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Any]:
        return self.runtime.device_batches(batches)

    def any_rank(self, flag: bool) -> bool:
        return self.runtime.any_rank(flag)

    def broadcast_bytes(self, data: bytes) -> bytes:
        return self.runtime.broadcast_bytes(data)

    def gather_host(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.runtime.gather_host(tensor)

    def fetch_results(self, handles: list[jax.Array]) -> list[StepResult]:
        return self.step.fetch_results(handles)

    def step_compiles(self) -> int:
        return self.step.compiled()

    def evaluate_sums(
        self, batches: Iterable[Any], metric_fn: MetricFn, ema: bool = False
    ) -> dict[str, float]:
        return self.evaluation.sums(batches, metric_fn, ema)

    def forward(self, call: ModelCall) -> Any:
        return self.evaluation.forward(call)

    def checkpoint_state(self) -> dict[str, Any]:
        return self.state.checkpoint_state()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.state.load_checkpoint_state(state)

    def live_state(self) -> dict[str, Any]:
        return self.state.live_state()

    def rng_state(self) -> dict[str, torch.Tensor]:
        return self.state.rng_state()

    def load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.state.load_rng_state(state)

    # --- training -----------------------------------------------------------------------------
    def split(self, batch: tuple, parts: int) -> list[tuple]:
        """Host tensors are cut on the host (sent once stacked, by `stacked`); a batch on the
        devices is cut there."""
        on_host = self.runtime.on_host(batch)
        return split_batch(batch if on_host else self.runtime.arrays(batch), parts)

    def train_step(
        self, micro_batches: list[tuple], lr: float | list[float], ema_decay: float = 0.0
    ) -> jax.Array:
        """Returns [mean loss, 1.0 if the update was applied else 0.0] on the devices."""
        return self.step(self.stacked(micro_batches), lr, ema_decay)

    def freeze(self, names: frozenset[str]) -> None:
        thawed = self.step.frozen - names
        if thawed and self.state.optimizer.spec.kind != "SGD":
            raise AccelError(
                f"{sorted(thawed)[0]} requires a gradient again: the jax backend keeps one "
                f"{self.state.optimizer.spec.kind} step count a param group, which went on while "
                "it was frozen (torch's stopped): call accel.prepare again after unfreezing it, "
                "or train on eager, compile or xla"
            )
        self.step.freeze(names)

    def lowered_step(
        self, micro_batches: list[tuple], lr: float | list[float], platforms: Sequence[str] = ()
    ) -> Any:
        batch = self.stacked(micro_batches)
        if platforms:
            return self.step.export(batch, lr, 0.0, platforms)
        return self.step.lower(batch, lr, 0.0)

    def stacked(self, micro_batches: list[tuple]) -> tuple:
        """The micro-batches as the step takes them: each tensor [micro-steps, batch, ...]."""
        return self.runtime.stacked(micro_batches)

    # --- processes, devices, compiles ---------------------------------------------------------
    def synchronize(self) -> None:
        jax.block_until_ready(self.state.params)

    def stats(self) -> BackendStats:
        spent = self.compile_events()
        hits = int(spent.pop("cache_hits"))
        return BackendStats(
            graphs_compiled=self.step.compiled(),
            compile_time_s=sum(spent.values()),
            compile_phases_s=spent,
            persistent_cache=True,
            persistent_cache_hits=hits,
            devices=self.runtime.mesh.size,
            shard=self.runtime.shard,
            state_bytes=self.state.bytes(),
            peak_memory_bytes=self.runtime.peak_memory_bytes(),
            details={
                **self.runtime.details(),
                **self.attention.stats(),
                # steps loaded from an earlier launch's export, not traced (saved.py)
                "steps_loaded": self.step.loaded,
            },
        )
