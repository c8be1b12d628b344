"""The rules that keep the structure simple, read from the code's own imports: no import circles;
accel/parallel/ below the backends; accel/data/ and accel/models/ independent of the rest of
accel; each framework
imported only by its backend; the loop and the launcher ask a backend nothing its contract does
not declare."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("accel",)
STANDALONE = ("accel.data", "accel.models")  # usable without the rest of accel
# Framework packages and the one file (with its helpers) that may import each.
FRAMEWORKS = {
    "torch_xla": ("accel/backends/xla.py",),
    "jax": (
        "accel/backends/jax.py",
        "accel/backends/jax_attention.py",
        "accel/backends/jax_step.py",
    ),
    "torchax": ("accel/backends/jax.py",),
    "optax": ("accel/backends/jax.py", "accel/backends/jax_step.py"),
}


def _module(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in _imports(p) if m in files} - {name} for name, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _is_package_of(a: str, b: str) -> bool:
    """A package's __init__ importing its own module is not a circle between two files."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_import_circles():
    graph = _graph()
    # A package and its own submodules import each other by design (the registry in
    # accel/backends/__init__.py); any other pair is a circle.
    cycles = [c for c in _cycles(graph) if not all(_is_package_of(c[0], m) for m in c[1:])]
    assert cycles == []


def test_parallel_and_data_import_no_backend_and_data_no_accel():
    for name, deps in _graph().items():
        if name.startswith(("accel.parallel", *STANDALONE)):
            assert not any(d.startswith("accel.backends") for d in deps), (name, deps)
        if name.startswith(STANDALONE):
            assert all(d.startswith(STANDALONE) for d in deps), (name, deps)


def test_each_framework_is_imported_by_its_backend_only():
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for framework, owners in FRAMEWORKS.items():
                used = {m for m in _imports(path) if m.split(".")[0] == framework}
                assert not used or rel in owners, (rel, used)


def test_the_loop_and_the_launcher_do_not_probe_the_backend():
    """Everything they use of a backend is declared in accel/backends/base.py."""
    for rel in ("accel/train.py", "accel/launch_single_task.py", "accel/checkpoint.py"):
        text = (ROOT / rel).read_text()
        assert "hasattr(" not in text and "getattr(self.backend" not in text, rel
        assert 'backend == "' not in text and "backend.name ==" not in text, rel


def test_no_save_path_gathers_the_whole_state():
    """Each rank writes only what it holds: nothing pickles tensors across ranks, and the one
    DTensor gathered whole is a gradient norm (one number, accel/parallel/fsdp.py)."""
    for path in (ROOT / "accel").rglob("*.py"):
        text = path.read_text()
        assert "gather_object" not in text, path
        if path.name != "fsdp.py":
            assert "full_tensor()" not in text, path


def _backend_calls(rel: str) -> set[str]:
    """The methods a file calls on an attribute named backend (`self.backend.x(...)`)."""
    calls = set()
    for node in ast.walk(ast.parse((ROOT / rel).read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "backend":
                calls.add(node.func.attr)
    return calls


def test_the_command_line_trains_through_the_public_engine():
    """The Trainer and its Evaluator step, fetch, evaluate, agree across ranks and checkpoint
    through accel.engine.Engine, as a user's script does: no second copy of those paths. What
    they ask the backend itself is setup and bookkeeping (timing, compile counts, stats)."""
    engine_only = {"train_step", "fetch_results", "evaluate_sums", "any_rank", "device_batches"}
    engine_only |= {"checkpoint_state", "load_checkpoint_state", "rng_state", "load_rng_state"}
    for rel in ("accel/train.py", "accel/evaluation.py"):
        assert not _backend_calls(rel) & engine_only, (rel, _backend_calls(rel) & engine_only)
    assert _backend_calls("accel/train.py") == {"setup", "synchronize", "mark_warmup_done", "stats"}
