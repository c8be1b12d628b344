"""The step's own random stream on the torch backends (eager, compile): what `seed=` means there,
as on xla and jax. Dropout and stochastic depth inside `step` draw from a generator state of the
Engine's, seeded from `seed` and the data replica (`replica_seed`); torch's global generators,
which the user's script seeds for its data order, augmentation and initial weights, are neither
read nor advanced by a step.

torch ops draw only from the default generators (F.dropout takes no generator, nor does
inductor's compiled dropout), so the step runs inside torch.random.fork_rng with the stream's
state set, and keeps the state it leaves.

    import torch
    from accel.backends.torch_family.step_random import StepRandom

    stream = StepRandom(torch.device("cpu"), seed=0, replica=0)
    before = torch.get_rng_state()
    with stream.drawing():
        first = torch.rand(2)
    with stream.drawing():
        second = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is untouched
    assert not torch.equal(first, second)  # one stream, continued from step to step
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from accel.backends.base import replica_seed


class StepRandom:
    """The random state the step's draws come from: the CPU generator's, and the CUDA device's
    where the step runs on one."""

    def __init__(self, device: torch.device, seed: int, replica: int):
        self.device = device
        start = replica_seed(seed, replica)
        self.cpu = torch.Generator().manual_seed(start).get_state()
        on_cuda = device.type == "cuda"
        self.cuda = torch.Generator(device).manual_seed(start).get_state() if on_cuda else None

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Run the block's draws from this stream; the global generators are restored after."""
        cuda = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
            self.cpu = torch.get_rng_state()
            if self.cuda is not None:
                self.cuda = torch.cuda.get_rng_state(self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stream's state, as tensors (saved with a checkpoint's random states)."""
        state = {"step_cpu": self.cpu}
        return state if self.cuda is None else {**state, "step_cuda": self.cuda}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continue the stream `state_dict` saved (a key it lacks leaves that part as it is)."""
        self.cpu = state.get("step_cpu", self.cpu)
        if self.cuda is not None:
            self.cuda = state.get("step_cuda", self.cuda)
