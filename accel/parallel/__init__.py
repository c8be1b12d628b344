"""Ways to spread a model over devices beyond data parallel replicas."""

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
