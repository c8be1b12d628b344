"""torch.compile (inductor) backend: the eager backend with the training forward and the loss
compiled as one graph, as in a user's own compiled step (the soft-target cross-entropy fuses with
the classifier instead of running eagerly)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from accel.backends.base import SinceStart, Supports
from accel.backends.torch_family import eager
from accel.backends.torch_family.eager import EagerRunner
from accel.config import AccelError, BackendConfig
from accel.distributed import DistContext, env_context

SUPPORTS = Supports(
    float16=True,
    gradient_hooks=("module", "tensor"),
    shard=("none", "full", "grad_op"),
    tp=True,
    tp_head=True,
    exclusive=(("tp_head", "shard", "the split classifier's rows are not sharded further"),),
    remat=True,
    cuda_batches=True,
    kernel_opt="inductor's max-autotune (without CUDA graphs)",
)


def require() -> None:
    """torch.compile ships with torch; it needs what eager needs (eager.require)."""
    eager.require()


def context(cfg: BackendConfig) -> DistContext:
    return env_context()


def build(cfg: BackendConfig, ctx: DistContext) -> EagerRunner:
    return EagerRunner(cfg, ctx, compiler=Inductor(cfg.step.kernel_opt))


def frames_compiled() -> dict[str, float]:
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"])}


REENTRANT_CHECKPOINT = (
    "torch.utils.checkpoint(..., use_reentrant=True) trains otherwise under torch.compile than "
    "on eager (compile gives the block gradients where eager gives it none): pass "
    "use_reentrant=False (the same gradients, and what torch recommends), or have accel "
    "recompute the blocks (prepare's remat)"
)


def refuse_reentrant_checkpoint(graph: torch.fx.GraphModule) -> None:
    """dynamo captures torch.utils.checkpoint as one higher-order op whatever its form, and
    differentiates through it: a reentrant checkpoint, which leaves its block without a gradient
    where its input needs none, would train. The op's keywords keep the form: refused in one
    line (jax refuses it the same way)."""
    checkpoint = torch.ops.higher_order.tag_activation_checkpoint
    for node in graph.graph.nodes:
        if node.target is checkpoint and node.kwargs.get("use_reentrant"):
            raise AccelError(REENTRANT_CHECKPOINT)


class Inductor:
    """Compiles the step's forward and loss; counts the frames dynamo compiles from here on."""

    def __init__(self, kernel_opt: bool):
        mode = "max-autotune-no-cudagraphs" if kernel_opt else "default"
        # What torch.compile(mode=...) hands inductor; a backend of accel's own (inductor after
        # a look at dynamo's graph) takes the options rather than the mode.
        self.options = torch._inductor.list_mode_options(mode)
        self.frames = SinceStart(frames_compiled)  # dynamo counts per process

    def compile_graph(self, graph: torch.fx.GraphModule, inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        refuse_reentrant_checkpoint(graph)
        compiled = compile_fx(graph, inputs, config_patches=self.options)
        assert callable(compiled)  # a graph's compiled callable (not an AOT export's paths)
        return compiled

    def __call__(self, fn: Callable) -> Callable:
        compiled = torch.compile(fn, backend=self.compile_graph)

        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            try:
                return compiled(*args)
            except Exception as failed:
                # dynamo wraps what a backend raises (BackendCompilerFailed): accel's own
                # refusal is the user's line, not a compiler failure.
                refused = getattr(failed, "inner_exception", None)
                if isinstance(refused, AccelError):
                    raise refused from None
                raise

        return run

    def step_compiles(self) -> int:
        return int(self.frames()["frames"])

    def stats(self) -> dict[str, Any]:
        return {"graphs_compiled": self.step_compiles()}
