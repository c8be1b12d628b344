"""The eager step queues its work and returns: nothing in it reads a value back to the host."""

import pytest
import torch

from tests.helpers import HostReads, job_backend, micro_config


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_the_eager_step_reads_nothing_back_to_the_host(tmp_path, level):
    cfg = micro_config(tmp_path, amp_level=level)
    backend = job_backend(cfg)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    (batch,) = backend.device_batches([(images, torch.softmax(torch.randn(8, 10), -1))])
    with HostReads() as reads:
        handles = [backend.train_step([batch], lr=1e-3) for _ in range(2)]
    assert reads.seen == []
    assert all(r.applied for r in backend.fetch_results(handles))


def _fp16_engine(scale: float, amp: str = "O1", lr: float = 0.1):
    """A two-layer model at `amp` in float16 on eager (the CPU), with an EMA; the loss is the
    output's mean square times `scale` squared, computed in float32."""
    import accel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def loss_fn(m: torch.nn.Module, batch: tuple) -> torch.Tensor:
        return (m(batch[0]).float() * scale).pow(2).mean()

    return accel.prepare(
        model, optimizer, loss_fn, backend="eager", amp=amp, amp_dtype="float16", ema=0.5,
        quiet=True,
    )  # fmt: skip


def test_float16_keeps_a_loss_scaler_on_the_cpu_too():
    """Gradients under float16's smallest value train as in float32: torch's loss scaler (its
    CPU one here) lifts them; without it they would round to zero and nothing would move."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    moved = {}
    for amp in ("O0", "O1"):
        engine = _fp16_engine(scale=1e-4, amp=amp, lr=1e4)
        before = engine.state_dict()["0.weight"]
        (result,) = engine.fetch([engine.step(x)])
        assert result.applied
        moved[amp] = engine.state_dict()["0.weight"] - before
    assert moved["O0"].abs().max() > 1e-5
    torch.testing.assert_close(moved["O1"], moved["O0"], rtol=0.05, atol=1e-6)


def test_a_step_the_loss_scaler_skips_is_not_applied_and_leaves_the_ema():
    """Gradients that overflow float16 once scaled: the scaler skips the update, and the step
    says so (applied False, counted as skipped), the weights and the EMA as they were."""
    engine = _fp16_engine(scale=3000.0)
    x = torch.randn(8, 4)
    before, ema_before = engine.state_dict(), engine.state_dict(ema=True)
    results = engine.fetch([engine.step(x) for _ in range(2)])
    assert [r.applied for r in results] == [False, False]
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)  # the loss was finite
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), name
    for name, value in engine.state_dict(ema=True).items():
        assert torch.equal(value, ema_before[name]), name
