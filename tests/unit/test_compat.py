"""What the project borrows from torch's and torchax's internals still exists where it is used,
on the pinned stack and on the newest (make test-latest), so a rename fails here, not in a run."""

from __future__ import annotations

import importlib

import pytest
import torch

from accel.backends.jax import torchax_compat
from accel.parallel.pipeline import GlooSafeStage
from accel.versions import OPS_REMOVED, release
from tests.helpers import run_python

# Private names the code imports or subclasses: (module, attribute).
PRIVATE = [
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch._dynamo.utils", "counters"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch._ops", "OpOverloadPacket"),
    ("torch._ops", "_OpNamespace"),
]


# ... of the optional frameworks, each where its backend uses it: (package, module, attribute).
OPTIONAL_PRIVATE = [
    # accel/backends/xla/runtime.py: torch_xla's own switch of torchax's import
    ("torch_xla", "torch_xla._internal.jax_workarounds", "maybe_get_torchax"),
]


@pytest.mark.parametrize(("module", "name"), PRIVATE, ids=[f"{m}.{n}" for m, n in PRIVATE])
def test_each_private_name_used_exists(module, name):
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    ("package", "module", "name"),
    OPTIONAL_PRIVATE,
    ids=[f"{m}.{n}" for _, m, n in OPTIONAL_PRIVATE],
)
def test_each_private_name_of_an_optional_framework_exists(package, module, name):
    pytest.importorskip(package, reason=f"{package} is not installed: its backend is unavailable")
    assert hasattr(importlib.import_module(module), name)


def test_the_private_members_the_jax_backend_reads_exist():
    """Members of objects rather than modules: a jitted function's compile count
    (accel/backends/jax/compiled.py: jax has no public count of a function's compiles) and
    torchax's operator table (accel/backends/jax/tracing.py: torchax 0.0.13's
    override_op_definition omits is_view_op)."""
    jax = pytest.importorskip("jax", reason="jax is not installed: its backend is unavailable")
    from accel.backends import jax as jax_backend

    jax_backend.require()  # imports torchax through the shim
    torchax = importlib.import_module("torchax")
    jitted = jax.jit(lambda x: x + 1)
    assert jitted._cache_size() == 0
    jitted(1)
    assert jitted._cache_size() == 1
    with torchax_compat.removed_ops():
        env = torchax.default_env()
    assert isinstance(env._ops, dict) and torch.ops.aten.add.Tensor in env._ops


def test_every_method_the_project_overrides_exists_on_the_base():
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.pipelining import PipelineStage

    from accel.dcp_reader import SafeReader, TensorsOnly

    overrides = [
        (SafeReader, FileSystemReader, ("read_metadata", "set_up_storage_reader", "read_data")),
        (TensorsOnly, DefaultLoadPlanner, ("load_bytes",)),
        # Defined only where this torch still has it (later releases dropped it).
        (GlooSafeStage, PipelineStage, tuple(vars(GlooSafeStage))),
    ]
    for ours, base, names in overrides:
        for name in names:
            if callable(getattr(ours, name, None)) and not name.startswith("__"):
                assert name in vars(ours), f"{ours.__name__} no longer defines {name}"
                assert hasattr(base, name), f"{ours.__name__}.{name} overrides nothing"
    for patched in (torch._ops.OpOverloadPacket, torch._ops._OpNamespace):  # torchax_compat
        assert "__getattr__" in vars(patched)


def test_release_reads_the_major_and_minor():
    assert release("2.13.0+cpu") == (2, 13) and release("2.9.0") == (2, 9)
    assert release("0.12.0.1") == (0, 12) and release("2.15.0rc1") == (2, 15)


def test_a_missing_op_is_a_stand_in_only_inside_the_shim(monkeypatch):
    monkeypatch.setattr(torchax_compat, "OPS_REMOVED", True)
    with torchax_compat.removed_ops():
        gone = torch.ops.aten.prod.names_that_never_were
        assert isinstance(gone, torchax_compat.RemovedOp)
        assert isinstance(torch.ops.aten.op_that_never_was.default, torchax_compat.RemovedOp)
        assert isinstance(torch.ops.aten.prod.default, torch._ops.OpOverload)  # real ones as ever
    with pytest.raises(AttributeError):
        _ = torch.ops.aten.prod.names_that_never_were
    with pytest.raises(AttributeError):
        _ = torch.ops.aten.op_that_never_was
    if OPS_REMOVED:  # torch >= 2.13: an overload torchax 0.0.13 names is gone
        with pytest.raises(AttributeError):
            _ = torch.ops.aten.prod.dim_Dimname


def test_torchax_imports_and_its_environment_starts_on_this_torch():
    from accel.backends import jax as jax_backend
    from accel.backends.jax import runtime

    jax_backend.require()  # imports torchax through the shim
    assert jax_backend.IMPORT_ERROR is None and runtime.torchax is not None
    with torchax_compat.removed_ops():
        assert runtime.torchax.default_env() is not None


def test_any_failure_importing_torchax_is_one_line_naming_the_versions(tmp_path):
    code = (
        "import builtins; real = builtins.__import__\n"
        "def fail(name, *a, **k):\n"
        "    if name == 'torchax':\n"
        "        raise AttributeError(\"no overload name 'dim_Dimname'\")\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = fail\n"
        "import sys; from accel.cli.launch import main\n"
        f"sys.exit(main(['--backend', 'jax', '--steps', '1', '--output', {str(tmp_path)!r}]))\n"
    )
    result = run_python(code)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "torch " in lines[0] and "torchax " in lines[0] and "dim_Dimname" in lines[0]


def test_an_eager_step_runs_in_a_process_that_imported_torchax():
    """torchax's "jax" device, torch's accelerator once torchax is in, says it is not available
    (not_an_accelerator): an optimizer step on the CPU still runs."""
    from accel.backends import jax as jax_backend

    jax_backend.require()  # imports torchax
    assert torch.accelerator.current_accelerator().type == "jax"
    assert not torch.accelerator.is_available()
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones(3)
    optimizer.step()
    assert torch.all(weight < 1)


def test_torchs_mark_of_a_stepped_optimizer_still_quiets_its_schedulers_warning():
    """accel/api.py marks the user's optimizer as stepped (`_opt_called`, what the step that
    torch's schedulers wrap sets; no public API) so that their scheduler does not warn that it
    stepped first: accel's optimizer steps, theirs never does."""
    import warnings

    def scheduler_warnings(marked: bool) -> list[str]:
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        if marked:
            optimizer._opt_called = True  # type: ignore[attr-defined]
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()
        return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]

    assert scheduler_warnings(marked=False) and not scheduler_warnings(marked=True)


def test_the_hook_dicts_prepare_reads_exist():
    """accel/checks.py's check_hooks reads a module's and a tensor's backward hooks from torch's
    own dicts (no public API lists them): a rename would let a hook through unrefused."""
    module = torch.nn.Linear(2, 2)
    assert not module._backward_hooks and not module._backward_pre_hooks
    module.register_full_backward_hook(lambda *_: None)
    module.weight.register_hook(lambda grad: grad)
    assert module._backward_hooks and module.weight._backward_hooks
