"""What the Engine checks and keeps of the loop around it: the batches it is given, the step
count checkpoints carry, skipped steps, and a user's error in one line."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import DataLoader, DistributedSampler

from accel.backends.base import (
    BackendUnavailable,
    RecompileError,
    StepResult,
)
from accel.backends.host_reads import quoted_error, quoted_frames, user_frame
from accel.config import (
    AccelError,
)
from accel.workers import fork_server


class LoopPart(Protocol):
    """The loop state a checkpoint carries: the steps done, and whatever else the loop keeps."""

    step: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepCount:
    """The public API's loop state: the optimizer steps taken."""

    step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def check_workers(batches: Iterable) -> None:
    """A DataLoader's workers can start (its fork server started on this thread)."""
    problem = fork_server.workers_problem(batches)
    if problem:
        raise AccelError(problem)


def check_sharded(batches: Iterable, ranks: int) -> None:
    """Under several processes a DataLoader must hand each rank its own part."""
    if ranks < 2 or not isinstance(batches, DataLoader):
        return
    # A DataLoader's batch_sampler is a BatchSampler (torch types it as any iterable).
    batch_sampler: Any = batches.batch_sampler
    sampler = batch_sampler.sampler if batch_sampler else batches.sampler
    if not isinstance(sampler, DistributedSampler):
        raise AccelError(
            f"{ranks} processes read the same DataLoader: give it "
            "sampler=DistributedSampler(dataset) so each rank trains on its own part"
        )


def shape_text(shapes: tuple) -> str:
    return " ".join(str(list(shape)) for shape in shapes)


def compiled_again(backend: str, seconds: float, shapes: tuple, before: tuple) -> str:
    """The notice of a step compiled again for new batch shapes: (micro-batches, shapes)."""
    (count, now), (count_before, then) = shapes, before
    if now == then:  # the same micro-batches, fewer or more of them: an epoch's short group
        what, cure = f"{count} micro-batches, after {count_before}", "a full last group"
    else:
        what = f"batch shapes {shape_text(now)}, after {shape_text(then)}"
        cure = "a DataLoader's drop_last=True"
    return (
        f"the {backend} step compiled again ({seconds:.1f} s) for {what}: keep them fixed ({cure})"
    )


class Compiling(Protocol):
    """What CompileWatch asks of the backend."""

    name: str
    compiles_per_shape: bool
    explain_compiles: str

    def step_compiles(self) -> int: ...


class CompileWatch:
    """The step's compiles, watched from its batches: a new shape (or number of micro-batches)
    said once on a backend that compiles per shape, and the recompile limit after warm-up
    (`max_recompiles`, -1: any) checked after each step."""

    def __init__(self, runner: Compiling, max_recompiles: int = -1):
        self.runner, self.max_recompiles = runner, max_recompiles
        self.last: tuple | None = None  # the last step's (micro-batches, shapes)
        self.seen: set[tuple] = set()  # those the step was compiled for
        self.at_warmup: int | None = None  # the backend's step compiles at warm-up

    def stepped(self, micro_batches: list[tuple], seconds: float, main: bool) -> None:
        shapes = (len(micro_batches), tuple(tuple(t.shape) for t in micro_batches[0]))
        before, self.last = self.last, shapes
        new = shapes not in self.seen  # a compiling backend compiled the step for them
        self.seen.add(shapes)
        by_shape = {s for _, s in self.seen}
        check_recompiles(  # past the limit: the error, not the notice
            self.max_recompiles, self.after_warmup(), by_shape, self.runner.explain_compiles
        )
        if new and before is not None and self.runner.compiles_per_shape and main:
            say(compiled_again(self.runner.name, seconds, shapes, before))

    def mark_warmup_done(self) -> None:
        self.at_warmup = self.runner.step_compiles()

    def after_warmup(self) -> int:
        """Graphs of the step compiled since warm-up (0 before it; at least 0: jax's step
        rebuilt on XLA's attention where cuDNN refused counts afresh)."""
        at = self.at_warmup
        return 0 if at is None else max(0, self.runner.step_compiles() - at)


def check_recompiles(limit: int, compiled: int, shapes_seen: set[tuple], explain: str) -> None:
    """More graphs compiled after warm-up than `limit` (CompilerConfig's max_recompiles, -1:
    any): stop, in one line naming the likely cause. The policy of every backend that compiles."""
    if limit < 0 or compiled <= limit:
        return
    cause = recompile_cause(shapes_seen, explain)
    raise RecompileError(f"{compiled} graphs compiled after warm-up (limit {limit}): {cause}")


def recompile_cause(shapes_seen: set[tuple], explain: str) -> str:
    """Why the step compiled again after warm-up, from the batch shapes it was given."""
    if len(shapes_seen) > 1:
        shapes = ", ".join(shape_text(s) for s in sorted(shapes_seen))
        return (
            f"the batch shapes changed between steps ({shapes}); keep them fixed (a "
            "DataLoader's drop_last=True, padded and masked evaluation batches)"
        )
    return (
        "the traced step changed with fixed batch shapes (a Python branch on a tensor "
        "value, .item() inside the step, or a changing Python constant); "
        f"{explain}"
    )


def say(line: str) -> None:
    """A notice of one line on stderr."""
    print(f"accel: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def user_errors(where: str) -> Iterator[None]:
    """What the backend raises while tracing, compiling or running the user's own code becomes
    one AccelError naming the user's file and line (and the op, where the error names one);
    errors inside accel's or the libraries' own code keep their traceback."""
    try:
        yield
    except (AccelError, BackendUnavailable, RecompileError) as err:
        # Already one line (or the launcher's own exit), naming the user's line: raised anew
        # (contextlib puts the same object's traceback back) without the frames it came through
        # (accel's, the compiler's), which say nothing to the user.
        raise type(err)(*err.args) from None
    except Exception as err:
        message = str(err)
        # torch.compile's errors quote the user's frames it traced rather than run them.
        frame = user_frame(traceback.extract_tb(err.__traceback__)) or user_frame(
            quoted_frames(message)
        )
        if frame is None:
            raise
        detail = next((line.strip() for line in message.splitlines() if line.strip()), "")
        kind, detail = quoted_error(detail) or (type(err).__name__, detail)
        raise AccelError(
            f"{kind} in the {where} at {frame.filename}:{frame.lineno} "
            f"({(frame.line or '').strip()}): {detail[:300]}"
        ) from None


class SkipWatch:
    """Steps whose update was skipped (a non-finite loss or gradient): the first is said at once
    (the step it was), none applied of the first LIMIT is an error, and LIMIT in a row later
    are said once."""

    LIMIT = 10

    def __init__(self) -> None:
        self.seen = self.in_row = 0
        self.applied = self.said_first = self.said = False

    def watch(self, results: Sequence[StepResult], main: bool) -> None:
        for result in results:
            self.seen += 1
            self.applied |= result.applied
            self.in_row = 0 if result.applied else self.in_row + 1
            if not result.applied and not self.said_first and main:
                self.said_first = True
                say(
                    f"step {self.seen} skipped its update: its loss or gradients were not "
                    "finite (StepResult.applied is False; a NaN from a square root or a "
                    "division at 0, or a learning rate too high)"
                )
        if not self.applied and self.seen >= self.LIMIT:
            raise AccelError(
                f"none of the first {self.seen} steps applied its update: the loss or the "
                "gradients were not finite in every one (check the loss and the learning rate)"
            )
        if self.in_row >= self.LIMIT and not self.said and main:
            self.said = True
            say(f"the last {self.in_row} steps skipped their update (non-finite loss or gradients)")
