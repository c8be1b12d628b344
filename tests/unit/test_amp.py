import math

import pytest
import torch

from accel.amp import amp_policy
from accel.config import AccelError
from tests.helpers import backend_tensors, job_backend, micro_config


def _backend(tmp_path, level):
    cfg = micro_config(tmp_path, amp_level=level)
    backend = job_backend(cfg)
    return backend


def _matmul_dtype(backend) -> torch.dtype:
    seen = []
    module = backend.layout.module
    linear = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
    handle = linear.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with backend.core.autocast():
        module(images)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize(
    ("level", "model_dtype", "optimizer_dtype", "matmul_dtype"),
    [
        ("O0", torch.float32, torch.float32, torch.float32),
        ("O1", torch.float32, torch.float32, torch.bfloat16),
        ("O2", torch.bfloat16, torch.float32, torch.bfloat16),
        ("O3", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_each_amp_level_gives_its_dtypes(
    tmp_path, level, model_dtype, optimizer_dtype, matmul_dtype
):
    backend = _backend(tmp_path, level)
    assert {p.dtype for p in backend.layout.module.parameters()} == {model_dtype}
    assert {p.dtype for p in backend.core.optimizer_params} == {optimizer_dtype}
    assert _matmul_dtype(backend) == matmul_dtype


def test_o2_steps_update_the_low_precision_model_from_fp32_masters(tmp_path):
    backend = _backend(tmp_path, "O2")
    before = {k: v.clone() for k, v in backend_tensors(backend).items() if k.startswith("model.")}
    batch = (
        torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8),
        torch.softmax(torch.randn(4, 10), -1),
    )
    (result,) = backend.fetch_results([backend.train_step([batch], lr=1e-2)])
    assert result.applied and math.isfinite(result.loss)
    after = {k: v for k, v in backend_tensors(backend).items() if k.startswith("model.")}
    assert all(v.dtype == torch.float32 for v in after.values() if v.is_floating_point())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    master = next(iter(backend.core.master.values()))
    assert master.dtype == torch.float32


def test_o3_warns_and_unknown_levels_are_refused():
    with pytest.warns(UserWarning, match="may cost accuracy"):
        amp_policy("O3")
    with pytest.raises(AccelError, match="unknown AMP level"):
        amp_policy("O4")
