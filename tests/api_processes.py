"""A user's evaluation loop on several processes, as an Accelerate script writes it, for the
process helpers' tests: the main process first, waiting for everyone, predictions gathered
from every replica for the metric (the sampler's padding dropped). Writes OUT/result.json on
the main process.

    torchrun --nproc_per_node 2 -m tests.api_processes OUT
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accel

SAMPLES = 11  # not a multiple of 2 replicas x 2 a batch: the sampler pads the last batch


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main_before_prepare = accel.is_main_process()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    engine = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                           backend="eager", quiet=True)  # fmt: skip
    order = out / "order.txt"
    with engine.main_process_first():  # the main process prepares, the others then read
        if engine.is_main:
            time.sleep(0.5)  # were the others not held back, they would write first
        with order.open("a") as f:
            f.write(f"{engine.rank}\n")
    engine.wait_for_everyone()
    inputs = torch.arange(SAMPLES * 3, dtype=torch.float32).reshape(SAMPLES, 3)
    dataset = TensorDataset(inputs, torch.arange(SAMPLES))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))
    for _epoch in range(2):  # the second epoch starts afresh
        indices = []
        for _, index in loader:
            indices.append(engine.gather_for_metrics((index,), loader)[0])
    if engine.is_main:
        result = {
            "main_before_prepare": main_before_prepare,
            "order": order.read_text().split(),
            "indices": torch.cat(indices).tolist(),
        }
        (out / "result.json").write_text(json.dumps(result))
    engine.wait_for_everyone()


if __name__ == "__main__":
    main()
