"""Will the job's state fit? Before anything is built: the bytes of weights, gradients and AdamW
state each process holds in the requested layout, against the memory it has (the host's
available memory when training on the CPU, each GPU's own on CUDA). Activations come on top, so
this refuses only what cannot fit at all."""

from __future__ import annotations

from pathlib import Path

import torch

from accel.cli.config import RunConfig
from accel.cli.models.factory import create_model
from accel.config import AccelError

GIB = 2**30


def bytes_per_parameter(amp_level: str) -> int:
    """Weights, gradients and AdamW's two moments: fp32 (16 bytes), O2 (bf16 weights and
    gradients beside fp32 masters, their gradients and moments: 20), O3 (all bf16: 8)."""
    return {"O2": 20, "O3": 8}.get(amp_level, 16)


def process_state_bytes(cfg: RunConfig, replicas: str) -> tuple[int, int]:
    """(bytes one process holds, processes on this host), from the model built on meta;
    `replicas`: how the backend runs --nproc_per_node (Supports.replicas)."""
    with torch.device("meta"):
        model = create_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    classifier = model.get_classifier()
    head = sum(p.numel() for p in classifier.parameters()) if classifier is not None else 0
    mesh, per = cfg.accel.mesh, bytes_per_parameter(cfg.accel.step.amp)
    procs = mesh.devices
    tp = max(mesh.tp, mesh.tp_head)
    dp = max(1, cfg.hosts.nnodes * procs // (tp * mesh.pp))
    # Each split divides what a rank holds (the tensor split's replicated norms and embeddings
    # are left out: this is the least a rank can hold, and only that is refused).
    held = params / mesh.pp
    if mesh.tp > 1:
        held /= mesh.tp
    elif mesh.tp_head > 1:
        held = held - head + head / mesh.tp_head
    if mesh.shard == "full" and dp > 1:
        held /= dp
    if replicas == "devices" and mesh.shard == "none":
        return int(held * per * procs), 1  # one process drives every device's replica
    return int(held * per), procs


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def check_memory(cfg: RunConfig, replicas: str, on_gpu: bool) -> None:
    """One line, before any work, when the state alone exceeds the memory there is."""
    held, procs = process_state_bytes(cfg, replicas)
    have: int | None
    if on_gpu:
        have, where = torch.cuda.mem_get_info()[1], "of GPU memory per process"
        need = held
    else:
        have, where = available_host_bytes(), "of host memory available"
        need = held * procs
    if have is None or need <= have:
        return
    raise AccelError(
        f"not enough memory: {cfg.model.name}'s weights, gradients and AdamW state take "
        f"{need / GIB:.1f} GiB here ({procs} process(es)), {have / GIB:.1f} GiB {where}; "
        "use --shard full, --pp, a lower --amp_level or fewer processes"
    )
