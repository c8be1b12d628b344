import functools
import gc
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

# Backends run for real on the CPU: torch_xla through PJRT CPU, JAX on its CPU platform.
# JAX's platform is chosen per run in pytest_configure (below), before anything imports jax.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Under make test's pytest-xdist workers, one intra-op thread a process (torch's OpenMP pool, and
# inductor's kernels with it), read as torch is imported, here and by every command a worker
# starts. Two workers keep both cores busy with processes of their own (idle 3 to 4% of a run,
# counted by vmstat), so a process's second thread only waits at OpenMP's barriers for a core
# another process holds: measured on 2 cores, four integration files on two workers took 89 s
# against 103 s. torchrun sets the same for several ranks on one host. The fast tier, one
# process alone, keeps torch's default.
WORKER = "PYTEST_XDIST_WORKER" in os.environ
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def xla_takes(flag: str) -> bool:
    """Whether this install's XLA takes `flag`: an unknown one in XLA_FLAGS aborts the process
    that starts XLA, so JAX's is asked in a process of its own. Asked by the first process of a
    run only: its pytest-xdist workers and commands inherit XLA_FLAGS. JAX and torch_xla of one
    stack share XLA's flags; without JAX, no flag is added."""
    if importlib.util.find_spec("jax") is None:
        return False
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


# XLA's CPU code generation at LLVM's lowest optimisation level (torch_xla's and JAX's alike):
# the same programs, compiled in about a third of the time (vit_micro's step on xla: 9 s -> 3 s),
# which is most of a short run's time; the steps run slower, so the runs that train for long
# (test_convergence.py) take XLA's default back (helpers.DEFAULT_XLA). And where this XLA still
# has its elemental emitters (newer ones have the fusion emitters only), the fusions' code from
# those: the same fusions, emitted in about half the time (a swin_micro run's compiles on xla:
# 3.7 s -> 1.9 s, on jax 2.8 s -> 1.6 s; the same losses), rounded alike but for the last bits
# (where a test compares runs whose graphs differ at 1e-7, it runs them at the fusion emitters:
# helpers.FUSION_EMITTERS). Before torch_xla's import below, which reads the variable.
if "XLA_FLAGS" not in os.environ:
    ELEMENTAL = "--xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0" + (
        f" {ELEMENTAL}" if xla_takes(ELEMENTAL) else ""
    )
# Inductor's CPU kernels likewise as plain C++ loops rather than SIMD (its config.cpp.vec_isa_ok,
# read from this variable as torch._inductor.config is imported): the same graphs, lowerings and
# fusions, far quicker for the C++ compiler (a cold vit_micro run on compile: 28 s -> 15 s),
# inherited by every command the suite starts. A compile test's subject is what accel does
# around the compiler, not the compiler's vector code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# And, under the workers, its kernels compiled one after another in the compiling process (its
# config's compile_threads), not by a pool of compile workers: each pool is fresh interpreters
# that import torch, started by every process that compiles, for cores the suite's other
# processes already hold (measured on 2 cores, the compile cases of three files on two workers,
# caches cold: 104 s against 120 s). The same kernels.
if WORKER:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel.backends.quiet import quiet_imports  # noqa: E402

try:
    with quiet_imports():
        import torch_xla
except ImportError:  # only where torch_xla cannot be installed (newer torch): see below
    torch_xla = None

if torch_xla is not None:
    # The XLA runtime must start before the first autograd backward of the process: the
    # autograd engine sizes its per-device queues then, and later XLA backwards fail. The suite
    # runs eager and xla tests in one process, so start it here, at collection.
    torch_xla.device()

from PIL import Image  # noqa: E402

from accel.cli.data.prepare import prepare_mock_imagenet  # noqa: E402
from tests import helpers  # noqa: E402
from tests.forking import own_fork_refusal  # noqa: E402

pytest_plugins = ["tests.shared_runs"]

# The imports' half a million objects, out of this process's garbage collections: the in-process
# runs end in one each (accel.distributed.destroy_process_group), and full ones come round often.
gc.collect()
gc.freeze()

NO_XLA = "torch_xla is not installed: its last release (2.9) pairs only with torch 2.9"


NO_GPU = "no CUDA device is visible to torch"
NO_JAX = "jax is not installed: pip install 'accel[jax]'"


# --- the tiers: `make test-fast` runs -m "not slow and not gpu" ------------------------------
# A test is slow when it starts a process: a Python interpreter (the command line, `python -c`,
# a notebook's kernel) or ranks. It is marked at collection when its code, a function of the
# suite it calls, or a fixture it uses names one of these; a non-slow test that starts one anyway
# (through a library, say) fails, naming itself, so a new test lands in the right tier.
STARTERS = (
    helpers.run_cli,
    helpers.train_cli,
    helpers.start_cli,
    helpers.run_script,
    helpers.run_module,
    helpers.run_command,
    helpers.Command,
    helpers.run_python,
    helpers.run_cli_without,
    helpers.nan_rank,
    helpers.train_ranks,
    helpers.script_ranks,
    helpers.fork_ranks,
    helpers.fork_module,
    helpers.train_forked,
    helpers.fork_processes,
)
STARTER_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "nbclient")


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _starter(value) -> bool:
    if any(value is s for s in STARTERS):
        return True
    module = value.__name__ if isinstance(value, types.ModuleType) else ""
    module = module or getattr(value, "__module__", None) or ""
    return module in STARTER_MODULES or module.startswith(tuple(f"{m}." for m in STARTER_MODULES))


def _ours(func) -> bool:
    """A function of the suite (test modules are imported by their file's name, not tests.*)."""
    code = getattr(func, "__code__", None)
    return code is not None and code.co_filename.startswith(str(ROOT / "tests"))


def starts_processes(func, seen: set | None = None) -> bool:
    """Whether `func`, or a function of the suite it calls by name, starts a process."""
    seen = set() if seen is None else seen
    func = getattr(func, "__func__", func)
    if not isinstance(func, types.FunctionType) or func in seen:
        return False
    seen.add(func)
    for name in _names(func.__code__):
        value = func.__globals__.get(name)
        if value is None:
            continue
        if _starter(value):
            return True
        if _ours(value) and starts_processes(value, seen):
            return True
    return False


def _fixture_functions(item):
    """The suite's functions behind the fixtures `item` uses (its own module's, conftest's and
    shared_runs.py's): pytest's public names give each fixture's name and, through
    inspect.unwrap, its function."""
    from tests import shared_runs

    wanted = set(item.fixturenames)
    for module in (item.module, sys.modules[__name__], shared_runs):
        for value in vars(module).values():
            if getattr(value, "name", None) in wanted and hasattr(value, "__wrapped__"):
                yield inspect.unwrap(value)


def _item_starts_processes(item) -> bool:
    if starts_processes(getattr(item, "function", None)):
        return True
    return any(_ours(f) and starts_processes(f) for f in _fixture_functions(item))


class _Guard:
    item = None  # the non-slow test being set up, run or torn down


def starts_ours(args) -> bool:
    """Whether a command runs the project's own code: the launcher (`-m accel...` or a console
    script), `python -c` code that imports accel, a bench script, pytest, a notebook's kernel.
    Libraries' own helper processes (torch.compile checks each kernel it builds in `python -c`)
    are not counted."""
    argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    words = [os.fsdecode(a) for a in argv]
    if not words or Path(words[0]).parent.resolve() != Path(sys.executable).parent.resolve():
        return False
    program, rest = Path(words[0]).name, words[1:]
    return (
        program in ("launch_single_task", "jupyter") or program.startswith("accel")
        or any(w.startswith("accel") or "import accel" in w or "from accel" in w for w in rest)
        or any(w.startswith("bench/") or w in ("pytest", "ipykernel_launcher") for w in rest)
    )  # fmt: skip


def _refuse_processes_of_fast_tests(event: str, args: tuple) -> None:
    """An audit hook (sys.addaudithook): a non-slow test that starts one of the project's
    programs through subprocess (directly or through a library) fails, naming itself, so a new
    test lands in the right tier. The processes that the static check above cannot see are
    these; multiprocessing's are named by the test's code (STARTER_MODULES)."""
    if event != "subprocess.Popen" or _Guard.item is None or not starts_ours(args[1]):
        return
    item, _Guard.item = _Guard.item, None  # pytest.fail's own work starts nothing
    pytest.fail(
        f"{item.nodeid} starts a process ({' '.join(map(str, list(args[1])[:4]))[:200]} ...) "
        "but is not marked slow: mark it @pytest.mark.slow (make test-fast leaves slow tests "
        "out), or run it in this process (tests/helpers.py: launch, train)",
        pytrace=False,
    )


sys.addaudithook(_refuse_processes_of_fast_tests)


def _refuse_forks_of_threaded_processes(event: str, args: tuple) -> None:
    """An audit hook: os.fork() (multiprocessing's fork start method, a library's own fork)
    raises, naming the threads, in a suite process that runs threads (every worker does: its XLA
    runtime started at collection). A forked copy of a threaded process can deadlock or abort
    in malloc (tests/forking.py); the suite forks from its fork server, and commands start as
    fresh interpreters (subprocess's fork and exec raise no os.fork event)."""
    if event == "os.fork":
        refused = own_fork_refusal()
        if refused:
            raise RuntimeError(refused)


sys.addaudithook(_refuse_forks_of_threaded_processes)


def _guarded(item):
    tier = item.get_closest_marker("slow") or item.get_closest_marker("gpu")  # not test-fast's
    _Guard.item = None if tier else item
    try:
        return (yield)
    finally:
        _Guard.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _guarded(item))


@pytest.fixture(scope="session", autouse=True)
def command_files(tmp_path_factory):
    """Where the commands the suite starts (helpers.Command) write their stdout and stderr."""
    helpers.Command.folder = tmp_path_factory.mktemp("commands")


@pytest.fixture(scope="session", autouse=True)
def compile_caches(tmp_path_factory):
    """One folder of JAX's and torch_xla's persistent caches for the run, inherited by every
    command it starts (ACCEL_COMPILE_CACHE, where each run's own output folder would hold its
    own): a test reuses what an earlier test of the run compiled, and a run starts cold, as on
    a fresh machine. Inductor's cache is one folder already (TORCHINDUCTOR_CACHE_DIR's default,
    shared by every run on the machine, and cold on a fresh one)."""
    os.environ.setdefault("ACCEL_COMPILE_CACHE", str(tmp_path_factory.mktemp("compile-cache")))


@pytest.fixture(scope="session")
def free_port():
    """free_port() is a TCP port on 127.0.0.1 nothing listens on, a new one each call: two runs
    of the suite on one machine never meet on a port."""
    return helpers.free_port


def pytest_configure(config):
    """JAX on its CPU platform for the CPU tiers; left to take the GPU in a run of the GPU tier
    alone where one is visible (helpers.jax_platform_default)."""
    import torch

    platform = helpers.jax_platform_default(config.option.markexpr, torch.cuda.is_available())
    if platform:
        os.environ.setdefault("JAX_PLATFORMS", platform)
    # The ranks the suite starts through torch.multiprocessing fork from one server that has
    # imported torch, timm and accel once (helpers.train_ranks), whoever starts it first.
    torch.multiprocessing.set_forkserver_preload(helpers.RANK_PRELOAD)


NO_JAX_GPU = (
    "JAX_PLATFORMS=cpu in this run (the CPU tiers' setting): the GPU tier's jax tests run on the "
    "GPU with `pytest -m gpu`"
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that start processes are marked slow (above), before -m selects.

    Tests marked `xla` need torch_xla. `make test` (CI) installs it and sets
    ACCEL_REQUIRE_XLA, so there a missing torch_xla fails the run instead of skipping them; on
    a newer torch (`make test-latest`) they are skipped, each with the reason. Tests marked
    `gpu` are skipped, with the reason, where no CUDA device is visible; tests of the jax
    backend, where jax is not installed (_needs_jax)."""
    import torch

    no_gpu = not torch.cuda.is_available()
    jax_on_cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if torch_xla is None and os.environ.get("ACCEL_REQUIRE_XLA"):
        raise pytest.UsageError(f"ACCEL_REQUIRE_XLA is set but {NO_XLA}")
    if not helpers.HAS_JAX and os.environ.get("ACCEL_REQUIRE_JAX"):
        raise pytest.UsageError(f"ACCEL_REQUIRE_JAX is set but {NO_JAX}")
    for item in items:
        if not item.get_closest_marker("slow") and _item_starts_processes(item):
            item.add_marker(pytest.mark.slow)
        if not helpers.HAS_JAX and _needs_jax(item):
            item.add_marker(pytest.mark.skip(reason=NO_JAX))
        if "xla" in item.keywords and torch_xla is None:
            item.add_marker(pytest.mark.skip(reason=NO_XLA))
        if "gpu" in item.keywords and no_gpu:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
        elif "gpu" in item.keywords and jax_on_cpu and _needs_jax(item):
            item.add_marker(pytest.mark.skip(reason=NO_JAX_GPU))
    items.sort(key=lambda item: (gpu_jax_last(item), start_order(item)))


# --- two workers: `make test` runs the suite on pytest-xdist's `-n 2` ----------------------------
# The fixtures of tests/shared_runs.py: runs made once for the whole run, by the worker that
# runs the files reading them.
SHARED_RUNS = ("eager_runs", "tp_runs")


@functools.cache
def reads_shared_runs(path: Path) -> bool:
    """Whether the test file at `path` names one of the shared runs' fixtures."""
    return re.search(rf"\b({'|'.join(SHARED_RUNS)})\b", path.read_text()) is not None


def worker_group(nodeid: str) -> str:
    """The tests one worker runs together, by the test's id: a file's tests (its module
    fixtures are made once), the files that read the shared runs (made once), and the unit
    tests (small, in one process whose compilers' in-memory caches serve them all)."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/unit/"):
        return "tests/unit"
    return "shared_runs" if reads_shared_runs(ROOT / path) else path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by scope (LoadScopeScheduling), with the scope of a test its
    worker_group. xdist's own groups (`--dist loadgroup`, the xdist_group mark) do not reach
    its scheduler under pytest 9, which no longer reads the test id xdist rewrites; `_split_scope`
    is the method xdist's own schedulers (loadfile, loadgroup) override to group tests, the one
    way it offers."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log)


# The groups that took 20 s or more of a worker in a full run from a fresh clone (its
# --durations, 2026-11-27), longest first: each worker starts with the longest, and the next
# group goes to whichever worker is free, so that the groups under 20 s fill in at the end and
# neither worker ends long after the other (measured from a fresh clone: 77 s apart in xdist's
# order, 34 s with the groups of a minute or more first, 37 s with those and the unit tests'
# 40 s group last). xdist's own order, by default, puts the groups with the most tests first,
# and so these last (each holds few tests): `make test` turns it off (--no-loadscope-reorder) for
# the collection's, which start_order sorts.
LONGEST_FIRST = (
    "tests/integration/test_examples.py",
    "tests/integration/test_user_models.py",
    "shared_runs",
    "tests/integration/test_amp_matrix.py",
    "tests/integration/test_scale.py",
    "tests/integration/test_convergence.py",
    "tests/integration/test_user_commands.py",
    "tests/integration/test_gpu_check.py",
    "tests/integration/test_notebooks.py",
    "tests/integration/test_api.py",
    "tests/integration/test_hybrid_parallel.py",
    "tests/integration/test_api_results.py",
    "tests/integration/test_resume.py",
    "tests/unit",
    "tests/integration/test_faults.py",
    "tests/integration/test_pipeline.py",
    "tests/integration/test_report.py",
    "tests/integration/test_finetune.py",
    "tests/integration/test_xla_backend.py",
    "tests/integration/test_jax_tensor_parallel.py",
)


def start_order(item) -> int:
    """Sort key: LONGEST_FIRST's groups in its order, then every other group (stable: in the
    collection's order)."""
    group = worker_group(item.nodeid)
    return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)


def gpu_jax_last(item) -> bool:
    """Sort key: a jax engine makes "jax" torch's accelerator for the rest of its process, and
    no CUDA backward runs after that (eager.cuda_refusal), so in each process, and each
    pytest-xdist worker (which takes tests in this order), the GPU tier's jax tests come last."""
    return "gpu" in item.keywords and _needs_jax(item)


def _needs_jax(item) -> bool:
    """A test that runs the jax backend says so: in its name, a parameter, or the `jax` mark
    (the modules that import jax itself skip at import, pytest.importorskip)."""
    params = getattr(item, "callspec", None)
    named = any(word in item.name for word in ("jax", "torchax", "optax"))
    named |= params is not None and "jax" in params.params.values()
    return named or item.get_closest_marker("jax") is not None


@pytest.fixture(scope="module")
def one_white_image(tmp_path_factory):
    """Real JPEGs, one of them all white: the NaN-on-white model's batch with it is non-finite."""
    root = prepare_mock_imagenet(
        tmp_path_factory.mktemp("white") / "imagenet",
        classes=2,
        per_class=8,  # 16 images, batch 4: every image is in exactly one step per epoch
        val_per_class=1,
        size=40,
        progress=False,
    )
    target = next((root / "train").glob("*/*.JPEG"))
    Image.new("RGB", (40, 40), (255, 255, 255)).save(target, quality=100)
    return root
