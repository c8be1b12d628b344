"""Ways to spread a model over devices beyond data-parallel replicas, as functions applied to a
model: `apply_fsdp` (fsdp.py), `apply_tp_head` (tp_head.py), `cut_vit` and `schedule_stages`
(pipeline.py), the process mesh (mesh.py), and building only a rank's part (materialize.py).
Nothing here imports a backend."""

from __future__ import annotations

import warnings


def effective_shard(requested: str, world_size: int) -> str:
    """--shard as it applies: with one replica there is nothing to split (said once)."""
    if requested != "none" and world_size < 2:
        warnings.warn(
            f"--shard {requested} with world size 1: nothing to shard, training unsharded",
            stacklevel=2,
        )
        return "none"
    return requested
