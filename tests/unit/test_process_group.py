"""The process groups are freed, their gloo threads joined, before the interpreter is torn down."""

import sys

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="counts /proc/self/task")

# As at the end of a run: the trainer's modules hold the group in a reference cycle, and DTensor's
# caches hold a device mesh (which, in newer torch, holds its groups) for good.
HELD = """
import os, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from accel.distributed import destroy_process_group
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
dist.init_process_group("gloo", init_method="file://{init}", rank=0, world_size=1)
holder = {{"group": dist.group.WORLD}}
holder["self"] = holder
del holder
CACHE = [init_device_mesh("cpu", (1,))] if {mesh} else []
{destroy}()
print(before, threads())
"""
DESTROYS = {"torch": "dist.destroy_process_group", "accel": "destroy_process_group"}


def _threads(tmp_path, destroy: str, mesh: bool) -> tuple[int, int]:
    """Threads before the group was made and after it was destroyed."""
    code = HELD.format(init=tmp_path / "init", destroy=DESTROYS[destroy], mesh=mesh)
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = map(int, result.stdout.split()[-2:])
    return before, after


def test_torch_leaves_gloo_threads_held_in_a_cycle_to_the_teardown(tmp_path):
    before, after = _threads(tmp_path, "torch", mesh=False)
    assert after > before


@pytest.mark.parametrize("mesh", [False, True], ids=["cycle", "cycle-and-cached-mesh"])
def test_destroying_the_group_joins_its_gloo_threads(tmp_path, mesh):
    before, after = _threads(tmp_path, "accel", mesh)
    assert after == before
