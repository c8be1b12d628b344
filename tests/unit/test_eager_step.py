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
