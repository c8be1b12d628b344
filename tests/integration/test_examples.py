"""The examples run as the README and docs/api.md show them, verbatim, and compare: minimal.py
gives the same losses on every backend; classic_loop_accel.py gives classic_loop.py's."""

import difflib
import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    HAS_XLA,
    INSTALLED,
    ROOT,
    TWO_HOST_DEVICES,
    Launched,
    as_a_command,
    run_module,
    run_script,
    xla_flags,
)

pytestmark = pytest.mark.slow
DOCS = ("README.md", "docs/api.md")


def documented(prefix: str) -> list[str]:
    """Every command line in the docs that starts with `prefix` (an env assignment may lead)."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text() if (ROOT / doc).is_file() else ""
        found += re.findall(rf"^((?:[A-Z_]+=\S+ )*{re.escape(prefix)}.*)$", text, re.M)
    return sorted(set(found))


def run_here(script: str, *args: str, env: dict) -> Launched:
    """`python SCRIPT ARGS` with `env`, run in this process by runpy: its exit code, stdout and
    stderr."""
    code = 0
    with as_a_command(env, [str(ROOT / script), *args]) as (out, err):
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return Launched(code, out.getvalue(), err.getvalue())


def run(
    command: str,
    tmp_path,
    port: int | None = None,
    stderr: list | None = None,
    in_process: bool = False,
) -> dict:
    """Run a documented command verbatim (its output folder under tmp_path); its losses.json
    (and its stderr appended to `stderr`). `in_process`: a command on one device runs here
    (run_here), where only what it trains is checked.
    torchrun's rendezvous takes `port` through its environment (PET_MASTER_PORT), so the
    command stays as documented and two suites on one machine do not share torchrun's 29500."""
    words = shlex.split(command, comments=True)
    # On a CPU: XLA's and JAX's host platforms, with two devices for the commands that ask.
    env = {"PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = xla_flags(TWO_HOST_DEVICES)
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    out = tmp_path / words[words.index("--out") + 1]
    in_process &= "ACCEL_DEVICES" not in env
    words[words.index("--out") + 1] = str(out)
    # A command on one device runs its script in this process, as `python SCRIPT` would run it
    # (its arguments, environment, __main__); a command on several devices needs a process of
    # its own, as XLA and JAX read the device count once, as they start; torchrun runs as
    # `python -m torch.distributed.run ...` (what its console script runs).
    if words[0] == "python" and not in_process:
        done = run_script(words[1], *words[2:], env=env)
    elif words[0] == "python":  # XLA_FLAGS as this process's XLA and JAX started with them
        env.pop("XLA_FLAGS")
        done = run_here(words[1], *words[2:], env=env)
    else:
        assert words[0] == "torchrun", command
        env.update({"PET_MASTER_PORT": str(port)} if port else {})
        done = run_module("torch.distributed.run", *words[1:], env=env, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    if stderr is not None:
        stderr.append(done.stderr)
    return json.loads((out / "losses.json").read_text())


def test_minimal_gives_the_same_losses_on_every_backend(tmp_path):
    commands = documented("python examples/minimal.py")
    assert len(commands) >= 2, "the docs show minimal.py on two backends or more"
    if not HAS_XLA:  # the commands that name xla (USE_ACCEL=1 is xla on a CPU) need torch_xla
        commands = [c for c in commands if "ACCEL_BACKEND=xla" not in c and "USE_ACCEL" not in c]
    runs = [run(c, tmp_path / str(i), in_process=True) for i, c in enumerate(commands)]
    backends = {r["backend"] for r in runs}
    for backend in (
        {"eager", "compile", "xla", "jax"} - backends - ({"xla"} if not HAS_XLA else set())
    ):
        env = f"ACCEL_BACKEND={backend} python examples/minimal.py --steps 20 --out runs/{backend}"
        runs.append(run(env, tmp_path / backend, in_process=True))
    first = runs[0]["losses"]
    assert first[-1] < 0.6 * first[0]  # it learns
    for r in runs[1:]:
        assert r["losses"] == pytest.approx(first[: len(r["losses"])], rel=1e-4, abs=1e-5), r


# 4 steps an epoch, each epoch at a tenth of the last one's rate
CLASSIC = "--lr_step 1 --batch_size 48"


@pytest.fixture(scope="module")
def classic(tmp_path_factory) -> tuple[list[float], dict, Path]:
    """The plain script's two epochs (once: every backend compares with them), the second
    resumed from the first's checkpoint, as an unbroken run would train it (each epoch's data
    order is seeded by the epoch): its losses, its last checkpoint (the model's, the
    optimizer's and the scheduler's state), and the first epoch's checkpoint."""
    folder = tmp_path_factory.mktemp("classic")
    script = f"python examples/classic_loop.py {CLASSIC}"
    first = run(f"{script} --epochs 1 --out runs/first", folder)
    after = folder / "runs" / "first" / "checkpoint.pt"
    rest = run(f"{script} --epochs 2 --resume {after} --out runs/classic", folder)
    saved = torch.load(folder / "runs" / "classic" / "checkpoint.pt", weights_only=True)
    return first["losses"] + rest["losses"], saved, after


# On jax, whose moments live in arrays of its own. eager runs the script under torchrun below;
# test_user_models.py resumes such checkpoints on every backend, test_api_results.py evaluates
# through engine.model on each: another backend here would show nothing more for its suite time.
def test_the_classic_loop_moved_onto_accel_resumes_and_trains_as_it_did(tmp_path, classic):
    """Its train() given the model, its validation loop and training accuracy, its DataLoader
    workers (started without a fork in a threaded process), and its own checkpoint code,
    unchanged: the second epoch, resumed from the plain script's checkpoint of the first, gives
    the plain script's losses, weights, optimizer moments and scheduler."""
    before, plain, after_one = classic
    script = f"ACCEL_BACKEND=jax python examples/classic_loop_accel.py {CLASSIC}"
    expected = before[len(before) // 2 :]
    stderr: list[str] = []
    resume = f"--resume {after_one} --epochs 2 --out runs/last"
    result = run(f"{script} {resume}", tmp_path, stderr=stderr)
    assert result["backend"] == "jax"
    assert result["losses"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert "fork()" not in stderr[0], stderr[0][-2000:]
    saved = torch.load(tmp_path / "runs" / "last" / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == plain["epoch"] == 2 and saved["scheduler"] == plain["scheduler"]
    assert set(saved["state_dict"]) == set(plain["state_dict"])
    for name, value in saved["state_dict"].items():
        assert value.device.type == "cpu"
        assert value == pytest.approx(plain["state_dict"][name], rel=1e-3, abs=1e-4), name
    moments, wanted = saved["optimizer"]["state"], plain["optimizer"]["state"]
    assert set(moments) == set(wanted) and float(moments[0]["step"]) == 8
    for index, state in moments.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key] == pytest.approx(wanted[index][key], rel=1e-3, abs=1e-6)


def test_a_vit_split_by_tensors_trains_the_one_process_losses(tmp_path, free_port):
    """docs/api.md's tensor-parallel commands, verbatim: 4 processes at tp 2 (data 2), with FSDP
    over the data axis, and jax's 2 devices at tp 2, each the one process's losses."""
    commands = documented("python examples/tensor_parallel.py")  # an env assignment may lead
    commands += documented("torchrun --nproc_per_node 4 examples/tensor_parallel.py")
    assert len(commands) == 4, commands
    # The one-process command in this process; the others need processes of their own.
    runs = [
        run(c, tmp_path / str(i), port=free_port(), in_process=True) for i, c in enumerate(commands)
    ]
    one = next(r for r, c in zip(runs, commands, strict=True) if "--tp" not in c)
    assert one["losses"][-1] < one["losses"][0]  # it learns
    for r in runs:
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-6), r
        assert r["shapes"] == one["shapes"]  # state_dict: the unsplit model's tensors


@pytest.mark.parametrize("model", ["vit_b_16", "swin_t"])
def test_torchvision_models_with_sgd_train_alike_on_every_backend(tmp_path, model):
    backends = [b for b in INSTALLED if b != "compile"]
    runs = [
        run(
            f"ACCEL_BACKEND={b} python examples/torchvision_sgd.py --model {model} --steps 6 "
            f"--out runs/{b}",
            tmp_path,
            in_process=True,
        )
        for b in backends
    ]
    for r in runs[1:]:
        assert r["losses"] == pytest.approx(runs[0]["losses"], rel=1e-4, abs=1e-5)
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]


def test_a_script_beside_its_own_models_and_data_imports_its_own(tmp_path):
    for package in ("models", "data"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"OWNER = 'the user ({package})'\n")
    (tmp_path / "train.py").write_text(
        "import torch, accel, models, data\n"
        "net = torch.nn.Linear(4, 2)\n"
        "loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])\n"
        "engine = accel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), loss)\n"
        "engine.fetch([engine.step(torch.randn(8, 4), torch.randint(0, 2, (8,)))])\n"
        "print(models.OWNER, data.OWNER, engine.backend)\n"
    )
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["the", "user", "(models)", "the", "user", "(data)", "eager"]


def test_the_classic_loop_runs_under_torchrun_as_documented(tmp_path, free_port):
    (command,) = documented("torchrun --nproc_per_node 2 examples/classic_loop_accel.py")
    result = run(command, tmp_path, port=free_port())
    assert result["backend"] == "eager"
    assert result["losses"][-1] < result["losses"][0]


def test_the_readme_counts_the_classic_loops_edit_right():
    before = (ROOT / "examples/classic_loop.py").read_text().splitlines()
    after = (ROOT / "examples/classic_loop_accel.py").read_text().splitlines()
    diff = list(difflib.unified_diff(before, after, lineterm="", n=0))[2:]
    removed = sum(line.startswith("-") for line in diff)
    added = sum(line.startswith("+") for line in diff)
    assert removed + added <= 25
    sentence = f"{removed} lines removed and {added} added in a {len(before)}-line script"
    assert sentence in (ROOT / "README.md").read_text().replace("\n", " ")


def test_a_hugging_face_model_trains_alike_and_saves_pretrained_on_every_backend(tmp_path):
    """docs/api.md's commands: the model's own loss, the same losses on each backend, and
    save_pretrained writing the trained weights (read back by from_pretrained)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    commands = documented("python examples/hugging_face.py")
    if not HAS_XLA:
        commands = [c for c in commands if "ACCEL_BACKEND=xla" not in c]
    assert len(commands) >= 2, "the docs show hugging_face.py on two backends or more"
    runs = [(c, run(c, tmp_path / str(i), in_process=True)) for i, c in enumerate(commands)]
    (_, first), *others = runs
    assert first["losses"][-1] < 0.75 * first["losses"][0]  # it learns
    saved = {}
    for command, found in runs:
        out = tmp_path / str(commands.index(command)) / shlex.split(command)[-1] / "model"
        model = transformers.ViTForImageClassification.from_pretrained(out)
        saved[found["backend"]] = model.state_dict()
    torch.manual_seed(0)
    untrained = transformers.ViTForImageClassification(model.config).state_dict()
    reference = saved[first["backend"]]
    assert not torch.equal(reference["classifier.weight"], untrained["classifier.weight"])
    for _, found in others:
        assert found["losses"] == pytest.approx(first["losses"], rel=1e-4, abs=1e-5), found
        for name, value in saved[found["backend"]].items():
            assert value == pytest.approx(reference[name], rel=1e-3, abs=1e-4), name


# One group of 3 micro-batches an epoch, its last ragged (8, 8, 4), and one evaluation batch;
# three epochs, as the warm-up's first step has a rate of 0.
ACCELERATE_JOB = "--train_samples 20 --eval_samples 8 --epochs 3"


def test_an_accelerate_script_moved_onto_accel_trains_and_resumes_as_it_did(tmp_path):
    """docs/api.md's commands: the Accelerate fine-tune (dict batches, two groups, warm-up,
    accumulation with a ragged last micro-batch, gathered accuracy) and its accel version,
    whose losses and accuracy are the original's on eager and jax; on jax, a resume from the
    first epoch's checkpoint ends bit for bit as the unbroken run; README's line count."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    (original,) = documented("USE_TORCH_XLA=0 python examples/accelerate_finetune.py")
    want = run(f"{original} {ACCELERATE_JOB}", tmp_path / "accelerate")
    assert want["losses"][-1] < want["losses"][0]  # it learns
    moved = f"python examples/accelerate_finetune_accel.py {ACCELERATE_JOB}"
    runs = {}
    # eager and jax here; xla and compile train transformers models from dict micro-batches,
    # ragged groups and keyword calls in test_accelerate_scripts.py, where their compiles cost
    # a fraction of this script's (xla at the suite's optimisation level 0 also turns this
    # script's step into NaNs, which XLA's default level does not: an XLA CPU matter).
    for backend in ("eager", "jax"):
        command = f"ACCEL_BACKEND={backend} {moved} --out runs/{backend}"
        runs[backend] = run(command, tmp_path, in_process=True)
        assert runs[backend]["losses"] == pytest.approx(want["losses"], rel=1e-5), backend
        assert runs[backend]["accuracy"] == want["accuracy"], backend
    run(f"ACCEL_BACKEND=jax {moved} --epochs 1 --out runs/first", tmp_path, in_process=True)
    after = tmp_path / "runs" / "first" / "epoch_0"
    again = f"ACCEL_BACKEND=jax {moved} --resume {after} --out runs/resumed"
    assert run(again, tmp_path, in_process=True) == runs["jax"]
    models = [tmp_path / "runs" / name / "model" for name in ("jax", "resumed")]
    unbroken, resumed = (
        transformers.ViTForImageClassification.from_pretrained(m).state_dict() for m in models
    )
    assert all(torch.equal(unbroken[n], resumed[n]) for n in unbroken)


def test_the_docs_count_the_accelerate_scripts_edit_right():
    before = (ROOT / "examples/accelerate_finetune.py").read_text().splitlines()
    after = (ROOT / "examples/accelerate_finetune_accel.py").read_text().splitlines()
    diff = list(difflib.unified_diff(before, after, lineterm="", n=0))[2:]
    removed = sum(line.startswith("-") for line in diff)
    added = sum(line.startswith("+") for line in diff)
    assert removed + added <= 40
    sentence = f"{removed} lines removed and {added} added in a {len(before)}-line script"
    assert sentence in (ROOT / "README.md").read_text().replace("\n", " ")
