"""remat= on the jax backend: each block of the model (accel.parallel.remat) recomputed in the
backward under jax.checkpoint while a training loss is traced, its weights, tensor arguments and
a random key going in as arrays, its output and the buffers it wrote coming out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import torch

import accel.backends.jax.runtime as runtime
from accel.batches import ModelCall
from accel.parallel.remat import remat_blocks


class WeightReads(Protocol):
    """The traced loss's record of the weights it read (tracing.py's ParameterReads)."""

    def read_all(self, tensors: Any) -> None: ...


class BlockCall(torch.nn.Module):
    """A block's own forward (not the one BlockRemat installs) as a module's, so that
    functional_call runs it with the weights it is given."""

    def __init__(self, block: torch.nn.Module, forward: Callable):
        super().__init__()
        self.block, self.run = block, forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class BlockRemat:
    """remat= on the jax backend: while a training loss is traced, each block of the model
    (accel.parallel.remat) runs under jax.checkpoint ("dots": its matmul outputs saved, as
    jax's dots_with_no_batch_dims_saveable says; "full": nothing saved), its weights, tensor
    arguments and a random key going in as arrays, its output and the buffers it wrote coming
    out."""

    def __init__(self, model: torch.nn.Module, env: Any, choice: str):
        self.env, self.choice = env, choice
        self.blocks = [b for _, b in remat_blocks(model)] if choice != "none" else []
        self.reads: WeightReads | None = None  # the traced loss's, while it is traced
        saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        self.policy = saveable if choice == "dots" else None  # "full": nothing saved

    @contextlib.contextmanager
    def installed(self, reads: WeightReads | None) -> Iterator[None]:
        """The blocks' forwards recomputed within the block (restored after it)."""
        saved = [(block, block.__dict__.get("forward")) for block in self.blocks]
        self.reads = reads
        for block in self.blocks:
            block.forward = self.recomputed(block, block.forward)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for block, own in saved:
                if own is None:
                    del block.forward
                else:
                    block.forward = own  # type: ignore[method-assign]
            self.reads = None

    def recomputed(self, block: torch.nn.Module, forward: Callable) -> Callable:
        interop, owner = runtime.interop, BlockCall(block, forward)

        def run(*args: Any, **kwargs: Any) -> Any:
            weights = {**dict(block.named_parameters()), **dict(block.named_buffers())}
            if self.reads is not None:
                self.reads.read_all(weights.values())
            call = ModelCall.of(args, kwargs)  # its tensors traced, the rest as they are
            # The block draws from the step's key as it would unrecomputed: the key goes in,
            # and the key its draws left comes out as the step's key.
            key = self.env.param.prng

            def pure(arrays: dict, inputs: tuple, key_: Any) -> tuple:
                given = interop.torch_view(arrays)
                args_, kwargs_ = call.rebuild(interop.torch_view(inputs))
                with self.env.override_property(prng=key_):
                    named = {f"block.{n}": v for n, v in given.items()}
                    out = torch.func.functional_call(owner, named, args_, kwargs_)
                    key_ = self.env.param.prng
                written = {
                    n: interop.jax_view(v) for n, v in given.items()
                    if interop.jax_view(v) is not arrays[n]
                }  # fmt: skip
                return interop.jax_view(out), written, key_

            recompute = jax.checkpoint(pure, policy=self.policy)
            out, written, key = recompute(
                interop.jax_view(weights), interop.jax_view(call.tensors), key
            )
            self.env.param.prng = key
            for name, value in written.items():  # a buffer the block wrote (running statistics)
                weights[name].copy_(interop.torch_view(value))
            return interop.torch_view(out)

        return run
