"""Ways to spread a model over devices beyond data-parallel replicas, as functions applied to a
model in order over one mesh description (mesh.py's `ParallelDims`): `cut_vit` and
`schedule_stages` (pipeline.py), `apply_tp` and the plans of what splits (tensor_parallel.py),
`apply_tp_head` (tp_head.py), `apply_fsdp` (fsdp.py), and building only a rank's part
(materialize.py). Nothing here imports a backend."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.parallel.mesh import ParallelDims
    from accel.parallel.pipeline import is_vit, stages_per_rank
    from accel.parallel.tensor_parallel import resolve_plan


def effective_shard(requested: str, world_size: int) -> str:
    """shard= as it applies: with one replica there is nothing to split (said once)."""
    if requested != "none" and world_size < 2:
        warnings.warn(
            f"shard='{requested}' with world size 1: nothing to shard, training unsharded",
            stacklevel=2,
        )
        return "none"
    return requested


# The public names, each loaded from its module on first use (importing accel.parallel imports
# none of them): what a script, and the command line, may use.
HOMES = {
    "ParallelDims": "accel.parallel.mesh",
    "is_vit": "accel.parallel.pipeline",
    "stages_per_rank": "accel.parallel.pipeline",
    "resolve_plan": "accel.parallel.tensor_parallel",
}
__all__ = ["ParallelDims", "effective_shard", "is_vit", "resolve_plan", "stages_per_rank"]


def __getattr__(name: str) -> Any:
    if name in HOMES:
        return getattr(importlib.import_module(HOMES[name]), name)
    raise AttributeError(f"module 'accel.parallel' has no attribute {name!r}")
