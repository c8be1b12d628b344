"""A step's input on a 2-device mesh of one process, for the public API's tests: from host
tensors (engine.step(x, y)) and from the loader, with and without accumulation. Writes to
OUT/result.json, per case, the global shape and (xla) sharding each micro-batch reached the
loss with, and the losses; the compiled step's programs are read by the test (xla: XLA's dump,
XLA_FLAGS=--xla_dump_to; jax: the lowered step compiled here).

    CPU_NUM_DEVICES=2 XLA_FLAGS=--xla_dump_to=DIR python -m tests.mesh_inputs xla OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.mesh_inputs jax OUT
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import accel

FEATURES, BATCH = 5, 8  # inputs [8, 5]: each device's part [4, 5], a micro-batch's [2, 5]


def batches(count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(count)
    ]


def run(backend: str, devices: int, source: str, accum: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 3))
    seen: list = []

    def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
        inputs, labels = batch
        spec = None
        if backend == "xla" and devices > 1:
            import torch_xla.distributed.spmd as xs

            # torch_xla's public view; a slice of a split tensor has none of its own
            spec = getattr(xs.wrap_if_sharded(inputs), "sharding_spec", None)
        seen.append([list(inputs.shape), spec])
        return nn.functional.cross_entropy(model(inputs), labels)

    engine = accel.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, backend=backend,
        devices=devices, accum=accum, quiet=True,
    )  # fmt: skip
    data = batches() if source == "host" else engine.loader(batches())
    losses = [r.loss for r in engine.fetch([engine.step(*b) for b in data])]
    found = {"seen": seen, "losses": losses}
    if backend == "jax":  # the compiled program of a host batch's step, each device's part
        found["program"] = engine.lowered_step(*batches(1)[0]).compile().as_text()
    return found


def main() -> None:
    backend, out = sys.argv[1], Path(sys.argv[2])
    devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    cases = {
        f"{source}-{accum}": run(backend, devices, source, accum)
        for source in ("host", "loader")
        for accum in (1, 2)
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(cases))


if __name__ == "__main__":
    main()
