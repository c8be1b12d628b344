"""Checkpoints: what a run saves, how it is written so that a crash never leaves a half file, and
how it is read back without running anything a file holds.

Every file loads with `torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts
only (the config travels as JSON, random generator states as tensors). A run whose model is whole
on every rank writes one file; a run whose ranks each hold a part (FSDP shards, a split
classifier, pipeline stages) writes a folder, through
torch.distributed.checkpoint: each rank writes what it holds, rank 0 the loop state (`meta.pt`),
and the folder takes its name once all have written. Either kind loads into any layout.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from accel.config import AccelError
from accel.parallel.materialize import local_region

FORMAT = "accel-checkpoint-2"
# What a writer names its work until it is whole (a file's or a folder's temporary name): a
# killed writer may leave one, which nothing reads.
PARTIAL = ".*.tmp"
META = "meta.pt"


class CheckpointError(AccelError):
    """A checkpoint that cannot be used: one line, exit 2."""


# --- random generator states as tensors ------------------------------------------------------
def host_rng_state() -> dict[str, torch.Tensor]:
    """Python, numpy and torch CPU generators (a device's belongs to the backend), as tensors."""
    version, internal, gauss = random.getstate()
    # numpy's stubs type the default (legacy) state as the dict form; it is this tuple.
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    _, keys, pos, has_gauss, cached = legacy
    return {
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }


def set_host_rng_state(state: dict[str, torch.Tensor]) -> None:
    version, *internal = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((version, tuple(internal), gauss if has_gauss else None))
    pos, np_has_gauss = state["numpy_pos"].tolist()
    keys = state["numpy"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, pos, np_has_gauss, float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"])


DEVICE_PREFIX = "device_"


def rng_states(runner: Any) -> dict[str, torch.Tensor]:
    """This process's generator states: the host's, and the runner's device ones by prefix."""
    device = {DEVICE_PREFIX + k: v for k, v in runner.rng_state().items()}
    return {**host_rng_state(), **device}


def restore_rng_states(state: dict[str, torch.Tensor], runner: Any) -> None:
    """What rng_states saved, back into the host's generators and the runner's."""
    set_host_rng_state(state)
    n = len(DEVICE_PREFIX)
    runner.load_rng_state({k[n:]: v for k, v in state.items() if k.startswith(DEVICE_PREFIX)})


def gather_rng(mine: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every rank's generator states in rank order, as one byte tensor a rank (the states have
    the same shapes on every rank), gathered with one all_gather."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    keys = sorted(mine)
    packed = torch.cat([mine[k].contiguous().view(-1).view(torch.uint8) for k in keys])
    parts = [torch.empty_like(packed, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, packed.to(device))
    out = []
    for part in parts:
        part, state, offset = part.cpu(), {}, 0
        for k in keys:
            size = mine[k].numel() * mine[k].element_size()
            chunk = part[offset : offset + size].view(mine[k].dtype).view(mine[k].shape)
            state[k], offset = chunk.clone(), offset + size
        out.append(state)
    return out


# --- reading files safely ---------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    """A file of ours, read without unpickling anything but tensors and plain values."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path} holds Python objects{what}, which are not loaded (they could run code): "
            "it is not an accel checkpoint, or one written before accel's tensor-only format; "
            "resume that one with the accel version that wrote it"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint ({reason})") from None


def read_meta(path: Path) -> dict[str, Any]:
    """The loop state, config and (one-file checkpoints) random states of a checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    raw = _load(path / META if path.is_dir() else path)
    meta = raw.get("meta") if isinstance(raw, dict) else None
    if not isinstance(meta, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an accel checkpoint (no '{FORMAT}' marker)")
    return meta


def sharded_keys(path: Path) -> set[str]:
    """The flattened keys ('model.x', 'optim.x.exp_avg', ...) a checkpoint folder holds."""
    from accel.dcp_reader import UnsafeCheckpoint, read_index

    try:
        return set(read_index(path).state_dict_metadata)
    except UnsafeCheckpoint as err:
        raise CheckpointError(f"{path}: {err}") from None
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path} is not a readable checkpoint ({first_line(err)})") from None


def _folder_tensors(path: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each key of a checkpoint folder, read alone (DCP reads only its chunks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from accel.dcp_reader import SafeReader, TensorsOnly, read_index

    index = read_index(path).state_dict_metadata
    for key in keys:
        meta = cast(TensorStorageMetadata, index[key])  # the keys of stored tensors
        target = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        dcp.load({key: target}, storage_reader=SafeReader(path), planner=TensorsOnly())
        yield key, target


def section_tensors(path: Path, section: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(flattened key, tensor) of one section ('model', 'optim', 'ema', 'rng') of a checkpoint, a
    file or a folder, read on the host one tensor at a time where it is a folder (an exporter's
    read: nothing loaded into a layout, nothing unpickled but tensors)."""
    if path.is_dir():
        keys = sorted(k for k in sharded_keys(path) if k.startswith(section + "."))
        yield from _folder_tensors(path, keys)
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state"]
    for key, value in flatten(state).items():
        if key.startswith(section + "."):
            yield key, value


# --- loading into a layout ---------------------------------------------------------------------
def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def fill_from_whole(template: dict[str, Any], whole: dict[str, Any], path: Path) -> None:
    """Copy a one-file checkpoint's whole tensors into `template` (this rank's tensors: plain,
    or DTensor views of its part), naming the first keys or shapes that do not fit."""
    have, want = flatten(whole), flatten(template)
    missing = [k for k in want if k not in have]
    if missing:
        raise CheckpointError(f"{path} does not fit this model: missing {', '.join(missing[:3])}")
    with torch.no_grad():
        for key, target in want.items():
            if key not in have:
                continue
            storage, region = local_region(target)
            full_shape = tuple(target.shape)
            if tuple(have[key].shape) != full_shape:
                raise CheckpointError(
                    f"{path} does not fit this model: {key} is {tuple(have[key].shape)} there, "
                    f"{full_shape} here"
                )
            storage.copy_(have[key][region])


def load_sharded(path: Path, template: dict[str, Any]) -> None:
    """Fill `template` in place from a checkpoint folder written by any layout at any world
    size (DCP reshards); works without a process group too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from accel.dcp_reader import SafeReader, TensorsOnly, UnsafeCheckpoint

    want, have = set(flatten(template)), sharded_keys(path)
    missing = sorted(want - have)
    if missing:
        raise CheckpointError(f"{path} does not fit this model: missing {', '.join(missing[:3])}")
    with warnings.catch_warnings():  # one process, no process group: DCP says it loads whole
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(template, storage_reader=SafeReader(path), planner=TensorsOnly())
        except CheckpointException as err:  # DCP wraps every rank's failure in this
            first = next(iter(err.failures.values()))[0]
            raise CheckpointError(f"{path}: {first_line(first)}") from None
        except (RuntimeError, ValueError, UnsafeCheckpoint) as err:
            raise CheckpointError(f"{path} does not fit this model: {first_line(err)}") from None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


# Parts of a backend's state a checkpoint may lack: the fp16 loss scaler's, and the EMA (a
# checkpoint without one starts the EMA from its weights).
OPTIONAL = ("scaler", "ema")


def load_state(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (a backend's checkpoint_state) from a file or folder checkpoint; returns
    it, less the optional parts the checkpoint does not hold."""
    whole = None if Path(path).is_dir() else _load(path)["state"]
    held = {k.split(".", 1)[0] for k in (sharded_keys(path) if whole is None else flatten(whole))}
    template = {k: v for k, v in template.items() if k not in OPTIONAL or k in held}
    if whole is None:
        load_sharded(path, template)
    else:
        fill_from_whole(template, whole, path)
    return template


# --- writing -----------------------------------------------------------------------------------
def _unique_tmp(final: Path) -> Path:
    """A temporary name no other writer uses (two runs must never share one)."""
    return final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def to_cpu(tree: Any) -> Any:
    """A state's tensors on the host, float ones in fp32: what a one-file checkpoint holds (a
    copy only where the device or dtype differs). Moved to the host first: converting on an XLA
    device would compile a graph per tensor."""
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, DTensor):
        raise TypeError("a one-file checkpoint holds whole tensors; this layout saves sharded")
    value = tree.detach().cpu()
    return value.float() if value.is_floating_point() else value


def write_file(final: Path, payload: dict[str, Any]) -> None:
    """Write to a temporary name, flush and fsync, then rename: a crash never leaves half a
    file under the final name. torch.save reports a failed write as a RuntimeError of its zip
    writer: it becomes an OSError naming the file."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_tmp(final)
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except RuntimeError as err:
        raise OSError(errno.EIO, f"write failed ({first_line(err)})", str(final)) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_folder(final: Path, state: dict[str, Any], meta: dict[str, Any], main: bool) -> None:
    """Called on every rank: each writes its part of `state`; rank 0 `meta`, then the rename."""
    import torch.distributed.checkpoint as dcp

    tmp = final.with_name(f".{final.name}.tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    with warnings.catch_warnings():  # raised inside torch's writer, nothing to act on here
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))  # fsyncs; ends in a barrier
    if main:
        write_file(tmp / META, {"format": FORMAT, "meta": meta})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()


# --- what must match to resume -----------------------------------------------------------------
class Stateful(Protocol):
    """One part of a checkpoint (as torch.distributed.checkpoint's Stateful)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BackendTensors:
    """The backend's model, optimizer and EMA, by the model's parameter names."""

    def __init__(self, runner: Any):
        self.runner = runner

    def state_dict(self) -> dict[str, Any]:
        return self.runner.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runner.load_checkpoint_state(state)


class RandomStates:
    """This process's random generators: the host's, and the backend's device ones."""

    def __init__(self, runner: Any):
        self.runner = runner

    def state_dict(self) -> dict[str, torch.Tensor]:
        return rng_states(self.runner)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        restore_rng_states(state, self.runner)


@dataclass
class CheckpointParts:
    """What a checkpoint holds, part by part; the command line and the public API save the
    same parts (their loop states differ) through save_checkpoint and load_checkpoint."""

    tensors: Stateful  # `state`: whole tensors from rank 0, or each rank's own (DCP)
    loop: Stateful  # where training stands, in numbers and lists: the meta's `loop`
    rng: Stateful  # each rank's random states: all gathered into the meta, or each rank's own


def plain(value: Any) -> Any:
    """`value` with numpy's scalars as Python numbers (a fetched loss is a numpy float64), so
    that it loads without unpickling anything."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def save_checkpoint(
    final: Path, parts: CheckpointParts, meta: dict[str, Any], main: bool, rank: int, sharded: bool
) -> None:
    """Called on every rank: one file from rank 0, or a folder each rank writes its part of."""
    meta = plain({**meta, "loop": parts.loop.state_dict()})
    if sharded:
        state = {**parts.tensors.state_dict(), "rng": {f"rank{rank}": parts.rng.state_dict()}}
        write_folder(final, state, meta, main)
        return
    rngs = gather_rng(parts.rng.state_dict())
    if main:
        state = to_cpu(parts.tensors.state_dict())
        write_file(final, {"format": FORMAT, "meta": {**meta, "rng": rngs}, "state": state})


def load_checkpoint(
    path: Path, parts: CheckpointParts, meta: dict[str, Any], rank: int, rng: bool = True
) -> None:
    """Load each part from a file or folder checkpoint (into any layout); the random states
    only with `rng` (the same replicas as the saved run's), and where it holds them."""
    try:
        template = load_state(path, parts.tensors.state_dict())
    except KeyError as err:
        raise CheckpointError(f"{path} holds no tensor {err} of this model") from None
    parts.tensors.load_state_dict(template)
    parts.loop.load_state_dict(meta["loop"])
    states = saved_rng(path, meta, rank, parts.rng) if rng else None
    if states is not None:
        parts.rng.load_state_dict(states)


def saved_rng(path: Path, meta: dict, rank: int, current: Stateful) -> dict | None:
    """This rank's saved generator states (the first rank's where it has none of its own)."""
    if "rng" in meta:
        states = meta["rng"]
        return states[min(rank, len(states) - 1)] if states else None
    key = f"rng.rank{rank}."
    mine = current.state_dict()
    # The states this run keeps too (another backend's saved streams are not its own).
    names = {k[len(key) :] for k in sharded_keys(path) if k.startswith(key)} & set(mine)
    if not names:
        return None
    template = {"rng": {f"rank{rank}": {n: torch.empty_like(mine[n]) for n in names}}}
    load_sharded(path, template)
    return template["rng"][f"rank{rank}"]
