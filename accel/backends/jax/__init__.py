"""JAX backend: the same torch model lowered to JAX by torchax and compiled by XLA (CPU, GPU, TPU).

The training step is one pure function under jax.jit: forward, soft-target loss, JAX autodiff,
an explicit gradient mean over the devices of a 1-D data mesh (shard_map + pmean, the same
contract as the xla backend's all-reduce), then optax AdamW. With tensor parallelism (tp=) the
mesh is 2-D, data x tensor (accel.parallel.mesh.Axis names them: 'dp', or 'fsdp' where the
weights split, and 'tp'): the plan's linear layers split their weights over 'tp' (and with
shard='full' every weight over 'fsdp' too), the step is one program over the global batch,
and XLA's SPMD partitioner adds the collectives. Weights and optimizer state are donated. The
learning rate comes in as an argument each step, read from the same timm schedule as the torch
backends, so it never triggers a recompile.

One process drives its local devices (devices= of them). Multi-host: start one process per host
with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set; the backend calls
jax.distributed.initialize(), the mesh spans every host's devices and each process feeds its shard.

The parts, one job each: runtime.py (torchax loaded, processes joined, the devices as a mesh,
batches put on them, collectives), state.py (the trained arrays, their layout on the mesh, the
checkpoint's names, the random keys' count), values.py (torch and JAX values each way),
optimizer.py (a torch optimizer as optax), step.py (the training step as a pure function),
tracing.py (the torch model run by torchax, attention routed to attention.py's kernels),
compiled.py (the compiled step and evaluation, compile accounting), runner.py (JaxRunner: their
composition), torchax_compat.py (the shim that lets torchax import on a newer torch).
"""

from __future__ import annotations

import os

from accel.backends.base import BackendUnavailable, Supports
from accel.config import BackendConfig
from accel.distributed import DistContext
from accel.versions import installed

INSTALL = "pip install 'accel[jax]' (jax, torchax, optax)"
SUPPORTS = Supports(
    shard=("none", "full", "grad_op"),
    tp=True,
    remat=True,
    cuda_batches=True,
    replicas="devices",
    one_process=("tp", "shard"),
    optimizers="AdamW, Adam, SGD (optax); RMSprop, Adagrad, Adamax, Adadelta, NAdam, RAdam "
    "(torch's arithmetic, accel/backends/jax/torch_optax.py)",
    kernel_opt="nothing more: attention= picks cuDNN flash attention, a fused Pallas kernel "
    "(Swin's windows) or XLA's ops per shape",
)

try:
    # The parts import jax and optax, not torchax (require() loads it: see runtime.py).
    from accel.backends.jax.ops import overridden
    from accel.backends.jax.runner import JaxRunner
    from accel.backends.jax.runtime import join, load_torchax
    from accel.backends.jax.tracing import attention_lowerings

    IMPORT_ERROR: BaseException | None = None
except Exception as err:  # reported by require() as one line: missing, or not for this torch
    IMPORT_ERROR = err

# JAX's GPU client takes this fraction of the card when it starts (its default, 0.75, leaves a
# quarter of an 80 GB card unused); set before the first device query, a user's value wins.
RUNTIME_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}


def require() -> None:
    """Refuses in one line where jax, optax or torchax is missing or cannot import on this torch;
    otherwise imports torchax (see load_torchax)."""
    error = IMPORT_ERROR or load_torchax()
    if isinstance(error, ImportError):
        raise BackendUnavailable(f"the jax backend needs jax, torchax and optax: {INSTALL}")
    if error is not None:
        versions = ", ".join(f"{p} {installed(p)}" for p in ("torch", "torchax", "jax"))
        raise BackendUnavailable(
            f"the jax backend cannot start: importing torchax failed with {versions} "
            f"({type(error).__name__}: {error}); install a torchax release "
            "made for this torch, or a torch torchax supports"
        )


def context(cfg: BackendConfig) -> DistContext:
    """One process drives its local devices; several processes (hosts) join through
    jax.distributed into one mesh, and each feeds its own shard of the data. JAX's client
    starts here (its first device query): RUNTIME_ENV is set just before, not while a
    configuration is only checked (settle)."""
    for name, value in RUNTIME_ENV.items():
        os.environ.setdefault(name, value)
    return join(cfg)


def build(cfg: BackendConfig, ctx: DistContext) -> JaxRunner:
    require()  # torchax in, where prepare's check did not already bring it
    return JaxRunner(cfg, ctx)


__all__ = [
    "INSTALL",
    "SUPPORTS",
    "JaxRunner",
    "attention_lowerings",
    "build",
    "context",
    "load_torchax",
    "overridden",
    "require",
]
