"""Every backend in one process: a jax engine leaves torch as it found it.

torchax renames torch's PrivateUse1 device when it is imported, and that cannot be undone; on a
CUDA GPU it stops every later CUDA backward (pytorch/pytorch#161129). So torchax comes in only
when a jax engine is built, its modes are entered only around the jax backend's own calls, and
eager on CUDA after it is refused in one line by prepare. What of that a CPU shows is checked
here, in a fresh interpreter (the suite's own process has run jax long before)."""

import json

import pytest

from accel.backends.torch_family.eager import cuda_refusal
from tests.helpers import run_python

pytestmark = pytest.mark.jax

SCRIPT = r"""
import json, sys
import torch
import accel
from accel.backends import support_matrix
import accel.backends.jax  # the module alone: torchax stays out

support_matrix()
before = "torchax" in sys.modules

def train(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=data), torch.randint(0, 3, (4,), generator=data))
               for _ in range(3)]
    handles = [engine.step(x, y) for x, y in engine.loader(batches)]
    return [r.loss.item() for r in engine.fetch(handles)], engine

eager_first, _ = train("eager")
jax_losses, jax_engine = train("jax")
x, w = torch.randn(2, 8), torch.randn(3, 8)
after = {
    "torchax": "torchax" in sys.modules,
    "ones": [type(torch.ones(2)).__name__, torch.ones(2).device.type],
    "linear": [type(torch.nn.functional.linear(x, w)).__name__,
               torch.nn.functional.linear(x, w).device.type],
    "module": sorted({p.device.type for p in torch.nn.Linear(2, 2).parameters()}),
    "accelerator": str(torch.accelerator.current_accelerator()),
}
eager_again, engine = train("eager")
devices = sorted({t.device.type for t in engine.state_dict().values()})
print(json.dumps({"before": before, "eager_first": eager_first, "jax": jax_losses,
                  "after": after, "eager_again": eager_again, "devices": devices}))
"""


def test_eager_after_a_jax_engine_trains_as_if_jax_had_never_run():
    result = run_python(SCRIPT, timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["before"] is False  # importing accel and listing backends leave torchax out
    after = found["after"]
    assert after["torchax"] is True  # the jax engine did bring it in
    # No torchax mode is left active: torch's own factories and functions give torch's own
    # tensors on torch's own devices (under torchax's modes they give its tensors on "jax").
    assert after["ones"] == ["Tensor", "cpu"] and after["linear"] == ["Tensor", "cpu"]
    assert after["module"] == ["cpu"] and found["devices"] == ["cpu"]
    assert after["accelerator"] == "jax"  # what cannot be undone: see eager.cuda_refusal
    # Bit-equal: the same floats, not close ones.
    assert found["eager_again"] == found["eager_first"]
    assert len(found["jax"]) == 3 and found["jax"][0] == pytest.approx(found["eager_first"][0])


def test_cuda_after_torchax_is_refused_in_one_line_naming_the_cure():
    line = cuda_refusal(True, "jax")
    assert line is not None and "\n" not in line
    assert "'jax'" in line and "process of their own" in line and "in a process each" in line
    assert cuda_refusal(True, "cuda") is None  # a process jax never touched
    assert cuda_refusal(True, None) is None
    assert cuda_refusal(False, "jax") is None  # the CPU needs no accelerator
