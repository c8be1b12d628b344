"""Eager baseline: DDP over real gloo processes, gradient accumulation, the launcher."""

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accel.distributed import DistContext, destroy_process_group
from tests.helpers import job_backend, micro_config, read_summary, run_cli


def _batch(n: int = 8):
    gen = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=gen)
    targets = torch.softmax(torch.randn(n, 10, generator=gen), -1)
    return images, targets


def _gradients(tmp_path, ctx: DistContext, micro_batches) -> dict[str, torch.Tensor]:
    cfg = micro_config(tmp_path)
    backend = job_backend(cfg, ctx)
    backend.layout.forward_backward(micro_batches, backend.forward_loss, backend.core)
    return {n: p.grad.clone() for n, p in backend.layout.module.named_parameters()}


def _ddp_worker(rank: int, world: int, init_file: str, tmp_path, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    images, targets = _batch()
    shard = slice(rank * 4, (rank + 1) * 4)
    grads = _gradients(tmp_path, DistContext(rank, rank, world), [(images[shard], targets[shard])])
    if rank == 0:
        torch.save(grads, out_file)
    destroy_process_group()


def test_two_process_ddp_gradients_equal_one_process_on_the_whole_batch(tmp_path):
    out_file = tmp_path / "ddp_grads.pt"
    args = (2, str(tmp_path / "init"), tmp_path, str(out_file))
    mp.start_processes(_ddp_worker, args=args, nprocs=2, start_method="forkserver")
    ddp = torch.load(out_file)
    single = _gradients(tmp_path, DistContext(), [_batch()])
    assert ddp.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    images, targets = _batch()
    accumulated = _gradients(
        tmp_path, DistContext(), [(images[:4], targets[:4]), (images[4:], targets[4:])]
    )
    whole = _gradients(tmp_path, DistContext(), [(images, targets)])
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-4, atol=1e-6)


def test_launch_two_processes_writes_world_size_two_and_six_finite_losses(tmp_path):
    result = run_cli(
        "--backend",
        "eager",
        "--nproc_per_node",
        "2",
        "--model",
        "vit_micro",
        "--data",
        "synthetic",
        "--steps",
        "6",
        "--batch_size",
        "8",
        "--output",
        str(tmp_path),
        "--workers",
        "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 16
    assert len(summary["losses"]) == 6 and all(math.isfinite(x) for x in summary["losses"])
    run_dir = tmp_path / "vit_micro" / "eager"
    run = next(run_dir.iterdir())
    for name in ("config.json", "train.log", "metrics.jsonl", "metrics.rank1.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir())
    assert summary["images_per_sec"] > 0 and 0 <= summary["data_wait_fraction"] <= 1
