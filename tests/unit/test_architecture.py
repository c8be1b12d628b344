"""The rules that keep the structure simple, read from the code's own imports: no import circles;
the library never imports the command line or the report, and knows neither; accel/parallel/
below the backends; the command line's task (accel/cli/data/, accel/cli/models/) independent of
the rest of accel; each framework imported only by its backend; the command line trains through
accel.prepare and reads no backend member."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from accel.engine import Engine
from tests.helpers import ROOT

PACKAGES = ("accel",)
STANDALONE = ("accel.cli.data", "accel.cli.models")  # usable without the rest of accel
CLIENTS = ("accel.cli", "accel.report")  # the library's clients, in folders of their own
# `python -m accel.launch_single_task` keeps its name: the one library-level file that imports
# the command line (it is its entry point, nothing imports it).
ENTRY_POINTS = ("accel.launch_single_task",)
# Framework packages and the backend folder that may import each (by path prefix).
FRAMEWORKS = {
    "torch_xla": ("accel/backends/xla",),
    "jax": ("accel/backends/jax",),
    "torchax": ("accel/backends/jax",),
    "optax": ("accel/backends/jax",),
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
        if name.startswith(STANDALONE):  # and the loader workers the library starts
            assert all(d.startswith((*STANDALONE, "accel.workers")) for d in deps), (name, deps)


def test_each_framework_is_imported_by_its_backend_only():
    owners_named = {owner for owners in FRAMEWORKS.values() for owner in owners}
    assert all((ROOT / owner).is_dir() for owner in owners_named), owners_named
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for framework, owners in FRAMEWORKS.items():
                used = {m for m in _imports(path) if m.split(".")[0] == framework}
                assert not used or rel.startswith(owners), (rel, used)


def test_the_library_never_imports_its_clients():
    graph = _graph()
    library = [n for n in graph if not n.startswith(CLIENTS) and n not in ENTRY_POINTS]
    assert len(library) > 20 and "accel.engine" in library
    for name in library:
        assert not any(d.startswith(CLIENTS) for d in graph[name]), (name, graph[name])
    # The report reads finished runs: it needs the library's records, never the command line.
    for name in (n for n in graph if n.startswith("accel.report")):
        assert not any(d.startswith("accel.cli") for d in graph[name]), (name, graph[name])


def _imported_names(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every `from module import name` in a file, at any depth."""
    return {
        (node.module, alias.name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
        for alias in node.names
    }


def test_the_command_line_uses_only_the_public_names_of_the_backends_and_parallel():
    """The command line is a client like a user's script: from accel.backends and
    accel.parallel it imports only the names those packages export (their __all__), never a
    module inside them, so that a change inside a backend cannot break it."""
    import accel.backends
    import accel.parallel

    public = {"accel.backends": accel.backends.__all__, "accel.parallel": accel.parallel.__all__}
    seen = set()
    for path in (ROOT / "accel" / "cli").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for module, name in _imported_names(path):
            if module.startswith(("accel.backends.", "accel.parallel.")):
                raise AssertionError(f"{rel} imports {name} from {module}, inside the package")
            if module in public:
                assert name in public[module], (rel, module, name)
                seen.add(name)
        plain = [
            alias.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith(("accel.backends.", "accel.parallel."))
        ]
        assert not plain, (rel, plain)
    assert {"support_matrix"} <= seen  # the check reads what it means to
    # The library resolves the tensor-parallel plan and the pipeline's stages from the
    # configuration (accel.check_layout, Settled.mesh_line): the command line imports none of
    # the parallel package, whose mesh, plan and stage count it once read itself.
    imported = [(m, n) for p in (ROOT / "accel/cli").rglob("*.py") for m, n in _imported_names(p)]
    assert not [m for m, _ in imported if m.startswith("accel.parallel")]
    # A checkpoint's tensors by section are the library's to read (accel.checkpoint's
    # section_tensors), not its nested dicts flattened by the command line.
    assert not [m for m, n in imported if n == "flatten"]
    # Its loaders' fork server is the public accel.workers.worker_context, as a script's is, and
    # its task's loss and metric are its own (accel/cli/task.py), not the library's.
    modules = {m for m, _ in imported} | {f"{m}.{n}" for m, n in imported}
    assert not modules & {"accel.workers.fork_server", "accel.losses"}
    # Where jax's hosts meet is the library's to set and read (accel.distributed.meet_as_hosts,
    # hosts_joining): the command line names none of its variables.
    assert not [p for p in (ROOT / "accel/cli").rglob("*.py") if "JAX_" in p.read_text()]


def test_the_loop_and_the_launcher_do_not_probe_the_backend():
    """Nothing of the command line branches on a backend's name or probes its attributes (its
    task's models and data, in folders of their own, know no backend)."""
    for path in (ROOT / "accel" / "cli").glob("*.py"):
        text = path.read_text()
        assert "hasattr(" not in text and "getattr(self.backend" not in text, path
        assert 'backend == "' not in text and "backend.name ==" not in text, path


def test_no_save_path_gathers_the_whole_state():
    """Each rank writes only what it holds: nothing pickles tensors across ranks, and the one
    DTensor gathered whole is a gradient norm (one number, accel/parallel/fsdp.py)."""
    for path in (ROOT / "accel").rglob("*.py"):
        text = path.read_text()
        assert "gather_object" not in text, path
        if path.name != "fsdp.py":
            assert "full_tensor()" not in text, path


def _reads(rel: str) -> list[tuple[str, str]]:
    """(owner, attribute) of every `X.owner.attribute` or `owner.attribute` read in a file."""
    found = []
    for node in ast.walk(ast.parse((ROOT / rel).read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if isinstance(owner, ast.Attribute):
                found.append((owner.attr, node.attr))
            elif isinstance(owner, ast.Name):
                found.append((owner.id, node.attr))
    return found


def _calls(rel: str) -> set[str]:
    """Every name a file calls, as `f(...)` or `x.f(...)`."""
    names = set()
    for node in ast.walk(ast.parse((ROOT / rel).read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


CLI_LOOP = ("accel/cli/train.py", "accel/cli/evaluation.py", "accel/cli/checkpoints.py")


def test_the_command_line_builds_its_engine_through_prepare_only():
    """The job is handed to accel.prepare as a user's is: no file of the command line builds a
    backend, adopts a model into one or constructs an Engine itself."""
    assert "prepare" in _calls("accel/cli/job.py")
    assert "build_engine" in _calls("accel/cli/train.py")
    for path in (ROOT / "accel" / "cli").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        called = _calls(rel)
        assert not called & {"create_backend", "adopt", "Engine", "setup"}, (rel, called)


# What joins a process to its peers: a backend module's context() (xla's runtime, jax.distributed,
# torchrun's variables read) and torch's process group.
JOINS = {"context", "init_process_group"}


def test_only_prepare_joins_the_process_to_its_peers():
    """One way in: accel.prepare alone makes the process context, and the command line reads it
    from the engine it gets back (`engine.ctx`), as a user's script does. The backends define
    their context(), and accel/distributed.py torch's group; nothing else calls either."""
    callers = set()
    for path in (ROOT / "accel").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if _calls(rel) & JOINS and rel != "accel/distributed.py":
            callers.add(rel)
    assert callers == {"accel/api.py"}, callers
    prepare = _prepare()
    called = {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(prepare)
        if isinstance(n, ast.Call)
    }
    assert called >= JOINS


def test_the_engine_is_complete_when_made():
    """prepare sets no field of the Engine after making it: the constructor takes them all."""
    prepare = _prepare()
    stores = [
        n
        for n in ast.walk(prepare)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "engine"
    ]
    assert not stores, [ast.unparse(n) for n in stores]


def _prepare() -> ast.Module:
    """accel/api.py: prepare and the steps it reads as (settle, check, join, build, the
    engine), each a function of its own there."""
    return ast.parse((ROOT / "accel/api.py").read_text())


def _function(rel: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((ROOT / rel).read_text())
    (found,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found


def test_the_trainer_reads_no_backend_member():
    """The loop, its evaluation and its checkpoints use the Engine's public names only: no read
    of the Engine's backend (its `runner`, a `self.backend`) and no import of the backends."""
    for rel in CLI_LOOP:
        reads = _reads(rel)
        assert not [r for r in reads if r[1] == "runner" or r[0] in ("runner", "backend")], rel
        assert not any(m.startswith("accel.backends") for m in _imports(ROOT / rel)), rel
        engine_reads = {attr for owner, attr in reads if owner == "engine"}
        public = {n for n in dir(Engine) if not n.startswith("_")}
        assert engine_reads <= public, (rel, engine_reads - public)


def test_the_trainer_class_stays_small():
    tree = ast.parse((ROOT / "accel/cli/train.py").read_text())
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    assert trainer.end_lineno - trainer.lineno + 1 <= 160


def test_one_torch_layout_over_the_mesh_not_a_class_per_parallelism():
    """Parallelisms compose as functions over ParallelDims: the torch backends have two layouts
    (the whole model on each rank, and one split over the mesh, with the parts only a pipeline
    or a split classifier adds), no class per parallelism, and each transform lives in
    accel/parallel/ as a function."""
    classes = set()
    for path in (ROOT / "accel/backends/torch_family").glob("*.py"):
        tree = ast.parse(path.read_text())
        classes |= {n.name for n in tree.body if isinstance(n, ast.ClassDef) and "Lay" in n.name}
    assert classes == {"Layout", "WholeLayout", "SplitLayout"}
    functions = {"apply_tp", "apply_tp_head", "apply_fsdp", "cut_vit"}
    defined = set()
    for path in (ROOT / "accel/parallel").glob("*.py"):
        defined |= {
            n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)
        }
    assert functions <= defined


# --- the backend seam: small parts, a library that knows no task, tests on the public API ------
BACKEND_CLASS_LINES = 200
BACKEND_FILE_LINES = 400
# The room every file and class keeps under those ceilings, so that the next change lands without
# trimming comments or joining lines: each is shaped (split by what it does) before it nears one.
ROOM = 0.85
# The command line's task and its run folder's policy: its model, its loss and metrics (the
# soft-target cross-entropy, the top-1/top-5 sums and their names), its summary's names, its
# checkpoints' names and pruning (accel/cli/task.py, accel/cli/checkpoints.py). The library
# computes a loss or metric from split logits through accel.logits.FromLogits, whichever it is.
TASK_NAMES = (
    "ImageClassifier", "classifier_loss", "classifier_metrics", "summarise", "summary.json",
    "eval_acc", "latest_checkpoint", "list_checkpoints", "prune(", "step_N", "run_dir",
    "SoftTargetCrossEntropy", "soft_target", "SoftTarget", "eval_sums", "EVAL_SUMS",
    "masked_sums", "correct5", "top-5", "classifier_parameters", "ClassifierLoss",
    "ClassifierMetrics",
)  # fmt: skip


def test_no_backend_class_over_200_lines_and_no_backend_file_or_engine_over_400():
    files = [*(ROOT / "accel" / "backends").rglob("*.py"), ROOT / "accel" / "engine.py"]
    for path in files:
        lines = len(path.read_text().splitlines())
        assert lines <= BACKEND_FILE_LINES * ROOM, (str(path.relative_to(ROOT)), lines)
        if path.name == "engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= BACKEND_CLASS_LINES * ROOM, (
                    str(path.relative_to(ROOT)), node.name, size
                )  # fmt: skip


def test_the_library_knows_no_task_and_no_command_line_flag():
    """The command line's classifier reaches the library through hooks any model can give, its
    task and run folder stay under accel/cli/, and library messages name prepare's keywords
    (`tp=2`), which the command line shows as flags."""
    library = [
        p
        for p in (ROOT / "accel").rglob("*.py")
        if not str(p.relative_to(ROOT)).startswith(("accel/cli/", "accel/report/"))
        and _module(p) not in ENTRY_POINTS
    ]
    assert len(library) > 40
    for path in library:
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        assert not [name for name in TASK_NAMES if name in text], rel
        if rel.startswith(("accel/backends/", "accel/parallel/")):
            flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
            assert not flags, (rel, flags)


# prepare's keywords for what a backend may not run: the Supports table refuses them, in
# accel/backends/__init__.py's refusals(), and no backend part raises its own line for them.
SUPPORTED_KEYWORDS = ("shard=", "tp_head=", "pp=", "remat=", "amp_dtype=", "kernel_opt=")


def test_what_a_backend_cannot_run_is_refused_from_its_support_table_only():
    for folder in ("jax", "xla", "torch_family"):
        for path in (ROOT / "accel" / "backends" / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    text = ast.unparse(node.exc)
                    named = [k for k in SUPPORTED_KEYWORDS if k in text]
                    assert not named, (str(path.relative_to(ROOT)), node.lineno, named)


# What only the command line knows: its commands, and the classes of its task and its options.
COMMANDS = ("launch_single_task", "accel-report", "accel-export", "accel-prepare")
CLI_CLASSES = ("ImageClassifier", "ModelConfig", "DataConfig", "MixupConfig", "RunConfig")


def _library_files() -> list[Path]:
    """Every file of accel/ but its clients (the command line, the report) and the command
    line's entry point."""
    clients = tuple(ROOT / c.replace(".", "/") for c in CLIENTS)
    entry = {ROOT / f"{e.replace('.', '/')}.py" for e in ENTRY_POINTS}
    return [
        p for p in (ROOT / "accel").rglob("*.py")
        if not p.is_relative_to(clients[0]) and not p.is_relative_to(clients[1]) and p not in entry
    ]  # fmt: skip


def test_the_library_knows_no_command_line():
    """No file of the library holds flag text, a command's name or a class of the command
    line's task (its models and data, with their options' flags, live under accel/cli/)."""
    files = _library_files()
    assert ROOT / "accel" / "api.py" in files and ROOT / "accel" / "workers" in {
        p.parent for p in files
    }
    for path in files:
        text, rel = path.read_text(), str(path.relative_to(ROOT))
        flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
        named = [n for n in (*COMMANDS, *CLI_CLASSES) if n in text]
        assert not flags and not named, (rel, flags, named)


def test_no_test_reads_an_engines_backend():
    for path in (ROOT / "tests").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if path.name == "test_architecture.py":
            continue
        reads = [r for r in _reads(rel) if r[1] == "runner"]
        assert not reads, (rel, reads)


# Calls that take mesh axis names: jax's and torch_xla's meshes, partition specs, collectives.
AXIS_TAKERS = {
    "P", "PartitionSpec", "Mesh", "NamedSharding", "pmean", "psum", "axis_index", "all_gather",
    "ShardingSpec", "mark_sharding", "init_device_mesh", "get_group", "get_local_rank", "of",
}  # fmt: skip


def _literal_axes(node: ast.Call) -> list[str]:
    """String constants among a call's arguments (in tuples and lists too), and its
    mesh_dim_names= keyword's."""
    values = [*node.args, *(k.value for k in node.keywords if k.arg == "mesh_dim_names")]
    found = []
    for value in values:
        items = value.elts if isinstance(value, ast.Tuple | ast.List) else [value]
        found += [
            i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)
        ]
    return found


def test_no_backend_names_a_mesh_axis_but_through_one_vocabulary():
    """accel.parallel.mesh.Axis names the axes once; torch's, xla's and jax's meshes, their
    partition specs and collectives take the names from it, never a literal."""
    for folder in ("backends", "parallel"):
        for path in (ROOT / "accel" / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in AXIS_TAKERS:
                    assert not _literal_axes(node), (rel, node.lineno, _literal_axes(node))


def test_the_mesh_describes_itself_with_its_axes_names():
    from accel.config import MeshConfig
    from accel.parallel.mesh import Axis, ParallelDims

    dims = ParallelDims.of(MeshConfig(shard="full", tp=2, pp=2), 8)
    assert dims.describe("processes") == (
        f"mesh {Axis.DATA_SHARD} 2 x {Axis.TENSOR} 2 x {Axis.PIPELINE} 2 (8 processes)"
    )
    assert ParallelDims.of(MeshConfig(), 2).data_axis == Axis.DATA


def test_one_name_for_each_thing_no_alias_of_a_class_or_a_function():
    """One meaning per name: no module-level `A = B` where B is a class or function of accel's
    (`AccelError = ConfigError`), and no module-level function that only calls another with
    its own arguments (`choose_backend` for `resolve_backend`)."""
    trees = [(p, ast.parse(p.read_text())) for p in _library_files()]
    functions = {n.name for _, t in trees for n in t.body if isinstance(n, ast.FunctionDef)}
    defined = functions | {
        n.name for _, t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)
    }
    aliases = []
    for path, tree in trees:
        for node in tree.body:
            value = node.value if isinstance(node, ast.Assign) else None
            if isinstance(value, ast.Name) and value.id in defined:
                aliases.append(f"{path.name}: {ast.unparse(node)}")
            if isinstance(node, ast.FunctionDef):
                body = [s for s in node.body if not isinstance(s, ast.Expr)]  # the docstring
                params = [a.arg for a in node.args.args]
                if len(body) == 1 and isinstance(body[0], ast.Return):
                    call = body[0].value
                    if (
                        isinstance(call, ast.Call)
                        and getattr(call.func, "id", None) in functions
                        and params
                        and [getattr(a, "id", None) for a in call.args] == params
                    ):
                        aliases.append(f"{path.name}: {node.name} -> {ast.unparse(call.func)}")
    assert not aliases, aliases


def test_prepare_reads_as_its_steps_each_a_short_function():
    """prepare is its keywords and its steps (settle, check, join, build, the engine), each a
    named function; no function of accel/api.py has a body of over 40 lines (docstrings aside),
    where prepare's was 71 doing about fifteen jobs."""
    tree = _prepare()
    steps = {"settled_here", "check_model", "join", "build", "Engine"}
    body = _function("accel/api.py", "_engine_for")
    called = {getattr(n.func, "id", "") for n in ast.walk(body) if isinstance(n, ast.Call)}
    assert steps <= called, steps - called
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            statements = [s for s in node.body if not isinstance(s, ast.Expr)]
            lines = sum(s.end_lineno - s.lineno + 1 for s in statements)
            assert lines <= 40, (node.name, lines)


def test_prepares_keywords_are_written_once_in_its_signature():
    """Each keyword of prepare's that sets a config field is written in its signature only: not
    again in its body (a call naming them all) nor in a table beside it (settings reads the
    fields from the configs); and every one of them is a field of the config."""
    import inspect

    from accel.api import prepare
    from accel.settings import KEYWORD_FIELDS

    own = {"model", "optimizer", "loss_fn", "schedule", "quiet", "init", "state", "config"}
    keywords = set(inspect.signature(prepare).parameters) - own
    assert keywords and keywords <= set(KEYWORD_FIELDS), keywords - set(KEYWORD_FIELDS)
    body = _function("accel/api.py", "prepare").body[1:]  # its docstring aside
    named = {n.id for s in body for n in ast.walk(s) if isinstance(n, ast.Name)} & keywords
    assert not named, named
    settings = (ROOT / "accel" / "settings.py").read_text()
    assert not [k for k in keywords if f'"{k}": "' in settings]


def test_the_object_a_backend_builds_is_a_runner_and_nothing_else_is_named_backend():
    """One word each (ARCHITECTURE.md, Words): "backend" is the name the user gives, the
    backend package builds a runner. No class named ...Backend (the protocol and the three
    classes were), no module named backend.py inside a backend package."""
    classes = [
        n.name
        for p in _library_files()
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and n.name.endswith("Backend")
    ]
    assert not classes, classes
    assert not list((ROOT / "accel" / "backends").rglob("backend.py"))
    builds = [
        n
        for p in (ROOT / "accel" / "backends").rglob("*.py")
        for n in ast.parse(p.read_text()).body
        if isinstance(n, ast.FunctionDef) and n.name == "build"
    ]
    assert len(builds) == 4 and all(ast.unparse(b.returns).endswith("Runner") for b in builds)


def test_jaxs_step_is_made_of_functions_called_one_at_a_time_not_nested_closures():
    """make_train_step builds its step from StepParts' methods (each callable on its own): no
    function of accel/backends/jax/step.py holds more than one function inside it (a scan's
    body), where make_train_step held ten closures."""
    tree = ast.parse((ROOT / "accel/backends/jax/step.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            inner = [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n is not node]
            assert len(inner) <= 1, (node.name, [n.name for n in inner])


def test_the_command_line_holds_the_librarys_config_and_declares_none_of_its_settings_again():
    """One configuration: RunConfig.accel is the library's BackendConfig; none of the command
    line's own fields is one of the library's settings under its name or its flag's (amp_level,
    grad_accum, nproc_per_node, seed, compile_cache were); the table of the two spellings
    (LIBRARY_FLAGS) is the one place they meet, read by the parser and the messages alike; the
    bridge to prepare needs no `type: ignore`."""
    from accel.cli import messages
    from accel.cli.config import LIBRARY_FLAGS, RunConfig, field_types, leaf_fields
    from accel.config import BackendConfig

    assert field_types(RunConfig)["accel"] is BackendConfig
    library = {path.rsplit(".", 1)[-1] for path, _, _ in leaf_fields(BackendConfig)}
    flags = {f.flag.lstrip("-").replace("-", "_") for p in LIBRARY_FLAGS for f in p.flags}
    own = [path for path, _, _ in leaf_fields(RunConfig) if not path.startswith("accel.")]
    twice = [p for p in own if p.rsplit(".", 1)[-1] in library | flags]
    assert not twice, twice
    offered = {f"accel.{f.field}" for p in LIBRARY_FLAGS for f in p.flags}
    assert offered <= {path for path, _, _ in leaf_fields(RunConfig)}, "a flag of no field"
    assert {f.flag for p in LIBRARY_FLAGS for f in p.flags} <= set(messages.KEYWORD_FLAGS.values())
    assert "LIBRARY_FLAGS" in (ROOT / "accel/cli/messages.py").read_text()  # read, not copied
    assert "type: ignore" not in (ROOT / "accel/cli/job.py").read_text()


def test_the_command_line_checks_the_librarys_splits_through_the_library():
    """The ranks over the mesh's sizes (ParallelDims.of) and a pipeline's micro-batches
    (accel.check_batch) are the library's rules: the command line calls them before it starts
    any process and names its flags, but does not write them again (it did, with `%`)."""
    for path in (ROOT / "accel/cli").rglob("*.py"):
        text = path.read_text()
        assert "not divisible by" not in text, path
        assert not re.search(r"%\s*\(?(mesh\.)?(pp_microbatches|tp|pp|split)\b", text), path


def test_no_two_classes_of_accel_share_a_name():
    """One meaning per name: two CompilerConfig classes (the library's and the command line's),
    two Trainers, two Layouts were."""
    where: dict[str, list[str]] = {}
    for path in (ROOT / "accel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: files for name, files in where.items() if len(files) > 1}


def test_the_engine_holds_its_parts_as_collaborators():
    """The Engine is the public calls over the parts it holds, each a class of its own: its
    steps (Stepping), what it trained (TrainedWeights), its checkpoints (Checkpointing). Its
    methods hand over to them: none but its constructor holds more than 6 statements (the step,
    the state dict and save held 10 to 12)."""
    tree = ast.parse((ROOT / "accel/engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    methods = [n for n in engine.body if isinstance(n, ast.FunctionDef)]
    (init,) = [m for m in methods if m.name == "__init__"]
    made = {getattr(n.func, "id", "") for n in ast.walk(init) if isinstance(n, ast.Call)}
    assert {"Stepping", "TrainedWeights", "Checkpointing"} <= made
    for method in methods:
        if method is not init:
            statements = [n for n in ast.walk(method) if isinstance(n, ast.stmt)][1:]
            statements = [s for s in statements if not isinstance(s, ast.Expr)]  # docstrings
            assert len(statements) <= 6, (method.name, len(statements))
