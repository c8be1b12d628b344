"""Ways to spread a model over devices beyond data-parallel replicas, as functions applied to a
model in order over one mesh description (mesh.py's `ParallelDims`): `cut_vit` and
`schedule_stages` (pipeline.py), `apply_tp` and the plans of what splits (tensor_parallel.py),
`apply_tp_head` (tp_head.py), `apply_fsdp` (fsdp.py), and building only a rank's part
(materialize.py). Nothing here imports a backend."""

from __future__ import annotations

import warnings


def effective_shard(requested: str, world_size: int) -> str:
    """shard= as it applies: with one replica there is nothing to split (said once)."""
    if requested != "none" and world_size < 2:
        warnings.warn(
            f"shard='{requested}' with world size 1: nothing to shard, training unsharded",
            stacklevel=2,
        )
        return "none"
    return requested


# A script reaches these through accel.prepare (its keywords and config) and accel.check_layout;
# the command line too, as a script does.
__all__ = ["effective_shard"]
