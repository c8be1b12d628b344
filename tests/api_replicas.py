"""A user's script on several replicas, for the public API's tests: each replica trains on its
part of the same global batches; writes the losses and final weights to OUT.

    python -m tests.api_replicas BACKEND DEVICES OUT [SHARD]  (one process, DEVICES devices)
    torchrun --nproc_per_node 2 -m tests.api_replicas eager 1 OUT [SHARD]

It saves its checkpoint through the API to OUT/checkpoint (a folder when sharded over ranks).
Like many scripts, it never destroys its process group: at its exit each rank writes to
OUT/exit_RANK.json whether the group was still there when its own exit functions ran.
"""

import atexit
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch

import accel
from tests.helpers import Net, api_loss_fn, api_metric_fn, colour_batches, grouped


def record_group_at_exit(out: Path) -> None:
    """Registered before `prepare`, so it runs after whatever exit functions `prepare` adds."""

    def record() -> None:
        rank = os.environ.get("RANK", "0")
        still = torch.distributed.is_initialized()
        (out / f"exit_{rank}.json").write_text(json.dumps({"group_alive": still}))

    atexit.register(record)


def main() -> None:
    backend, devices, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    shard = sys.argv[4] if len(sys.argv) > 4 else "none"
    out.mkdir(parents=True, exist_ok=True)
    record_group_at_exit(out)
    torch.manual_seed(0)
    model = Net()
    engine = accel.prepare(
        model, grouped(model, "adamw"), api_loss_fn, backend=backend, devices=devices,
        clip_grad=1.0, shard=shard, quiet=True,
    )  # fmt: skip
    rank, ranks = engine.rank, engine.replicas // devices  # processes split the data
    part = 16 // ranks
    mine = [tuple(t[rank * part : (rank + 1) * part] for t in b) for b in colour_batches(4)]
    losses = [r.loss for r in engine.fetch([engine.step(*b) for b in engine.loader(mine)])]
    state = engine.state_dict()  # whole, on the host, on every rank (split weights gathered)
    held_out = colour_batches(2, seed=9)
    sums = engine.evaluate([tuple(t[rank * part : (rank + 1) * part] for t in b)
                            for b in held_out], api_metric_fn)  # fmt: skip
    engine.save(out / "checkpoint")
    if rank == 0:
        weights = {n: t.float().flatten()[:4].tolist() for n, t in state.items()}
        fresh = Net()
        fresh.load_state_dict(state)  # the user's own model, loaded with what was trained
        fresh.eval()
        with torch.no_grad():
            plain = [api_metric_fn(fresh, b) for b in held_out]
        split = {
            "shard": engine.stats().shard,
            "state_bytes": engine.stats().state_bytes,
            "evaluated": sums,
            "plain_evaluated": {k: float(sum(float(p[k]) for p in plain)) for k in sums},
            "dtypes": sorted({str(t.dtype) for t in state.values()}),
            "devices": sorted({t.device.type for t in state.values()}),
            # how the script's DataLoaders would start their workers (it chose no method)
            "start_method": multiprocessing.get_start_method(allow_none=True),
        }
        if backend == "xla":  # its state bytes are whole tensors': the params' own sharding
            import torch_xla.distributed.spmd as xs

            views = [xs.wrap_if_sharded(p) for p in model.parameters()]  # public sharded views
            specs = [v.sharding_spec if isinstance(v, xs.XLAShardedTensor) else "" for v in views]
            split["xla_shardings"] = specs
        record = {"losses": losses, "weights": weights, **split}
        (out / "result.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
