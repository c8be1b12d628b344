"""Every mistake is one line on stderr and exit code 2, before any work starts: no traceback and
no run folder. Most cases call the launcher's main() in this process (the checks run before any
model is built, so they take milliseconds); a few go through a real `python -m` process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accel.backends import resolve_backend
from accel.cli.data.prepare import prepare_mock_imagenet
from accel.cli.launch import main
from tests.helpers import run_cli

BASE = ("--steps", "1", "--batch_size", "8", "--workers", "0")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    one_class = prepare_mock_imagenet(root / "one", classes=1, per_class=8, progress=False)
    three = prepare_mock_imagenet(root / "three", classes=3, per_class=4, progress=False)
    (root / "empty" / "train").mkdir(parents=True)
    (root / "a_file").write_text("not a folder")
    (root / "truncated.pt").write_bytes(b"PK\x03\x04 truncated")
    (root / "notes.pt").write_text("just text")
    return {"one": one_class, "three": three, "root": root}


# (arguments, environment, words the one error line holds)
CASES = [
    (["--model", "vit_mcro"], {}, ["unknown model 'vit_mcro'", "vit_micro"]),
    (["--mixup", "0.8", "--batch_size", "7"], {}, ["even --batch_size", "7"]),
    (["--amp_level", "O7"], {}, ["--amp_level", "O7"]),
    # argparse takes an unambiguous prefix by default: `--batch 8` would run as --batch_size 8
    (["--batch", "4"], {}, ["--batch is not a flag", "did you mean --batch_size?"]),
    (["--step=3"], {}, ["--step is not a flag", "--steps"]),
    (["--bacth_size", "4"], {}, ["unrecognized arguments: --bacth_size", "--batch_size"]),
    (["--backend", "tpu"], {}, ["--backend", "tpu"]),
    (["--pool", "max"], {}, ["--pool", "max"]),
    (["--steps", "0"], {}, ["--steps must be >= 1"]),
    (["--epochs", "2"], {}, ["--steps or --epochs, not both"]),
    (["--lr", "-1"], {}, ["--lr must be > 0"]),
    (["--lr", "nan"], {}, ["--lr must be a finite number"]),
    (["--workers", "-1"], {}, ["--workers must be >= 0"]),
    (["--drop_path", "2"], {}, ["--drop_path must be < 1"]),
    (["--label_smoothing", "1.5"], {}, ["--label_smoothing must be < 1"]),
    (["--mixup", "-0.5"], {}, ["--mixup must be >= 0"]),
    (["--batch_size", "0"], {}, ["--batch_size must be >= 1"]),
    (["--log_every", "0"], {}, ["--log_every must be >= 1"]),
    (["--clip_grad", "-1"], {}, ["--clip_grad must be >= 0"]),
    (["--betas", "0.9", "1.5"], {}, ["--betas must be < 1"]),
    (["--grad_accum", "0"], {}, ["--grad_accum must be >= 1"]),
    (["--num_classes", "1"], {}, ["--num_classes must be >= 2"]),
    (["--img_size", "30"], {}, ["--img_size 30", "vit_micro", "multiple of 4"]),
    (["--model", "swin_micro", "--img_size", "30"], {}, ["swin_micro", "multiple of 4"]),
    (["--model", "swin_micro", "--img_size", "34"], {}, ["swin_micro", "1 merges"]),
    (["--synthetic_length", "4"], {}, ["holds 4 images", "global batch (8)"]),
    (["--resume", "/nonexistent/step_1.pt"], {}, ["checkpoint not found"]),
    ([], {"USE_ACCEL": "banana"}, ["USE_ACCEL must be 0, 1, true or false", "banana"]),
    (["--data", "/nonexistent/imagenet"], {}, ["dataset folder not found"]),
    (["--data_device", "gpu"], {}, ["--data_device gpu"]),
    (["--nproc_per_node", "3", "--tp_head", "2"], {}, ["--nproc_per_node 3", "--tp_head 2"]),
    # accel.settle's rule, in the command line's words
    (
        ["--nproc_per_node", "4", "--tp", "2", "--tp_head", "4"],
        {},
        ["--tp 2 and --tp_head 4", "give the same size"],
    ),
    (
        ["--nproc_per_node", "2", "--tp_head", "2", "--shard", "full"],
        {},
        ["--tp_head and --shard cannot be combined on the eager backend"],
    ),
    (
        ["--nproc_per_node", "4", "--tp_head", "2", "--pp", "2"],
        {},
        ["--pp and --tp_head cannot be combined on the eager backend"],
    ),
    (
        ["--nproc_per_node", "4", "--tp", "2", "--pp", "2", "--shard", "full"],
        {},
        ["--pp and --shard cannot be combined on the eager backend"],
    ),
    (["--nproc_per_node", "3", "--tp", "2"], {}, ["--nproc_per_node 3", "divisible by --tp 2"]),
    (
        ["--nproc_per_node", "4", "--tp", "2", "--pp", "4"],
        {},
        ["--nproc_per_node 4", "divisible by --tp 2 x --pp 4"],
    ),
    (["--nproc_per_node", "4", "--tp", "2", "--tp_head", "4"], {}, ["--tp 2", "same size"]),
    (
        ["--nproc_per_node", "3", "--tp", "3"],
        {},
        ["blocks.0.attn.proj' has 64 input features, not divisible by 3"],
    ),
    (["--nproc_per_node", "2", "--model", "swin_micro", "--pp", "2"], {}, ["--pp cuts"]),
    (["--nproc_per_node", "4", "--pp", "4"], {}, ["4 stages", "vit_micro has 2 blocks"]),
    (
        ["--nproc_per_node", "2", "--pp", "2", "--pp_microbatches", "3"],
        {},
        ["--batch_size 8", "--pp_microbatches 3"],
    ),
    (["--backend", "compile", "--nproc_per_node", "2", "--pp", "2"], {}, ["--pp", "compile"]),
    (["--backend", "xla", "--shard", "grad_op"], {}, ["--shard grad_op", "xla backend"]),
    (["--backend", "xla", "--remat", "full"], {}, ["--remat", "xla backend"]),
    (["--backend", "xla", "--data_device", "gpu"], {}, ["--data_device gpu", "xla"]),
    (["--backend", "jax", "--nproc_per_node", "2", "--tp_head", "2"], {}, ["--tp_head", "jax"]),
    (
        ["--backend", "jax", "--amp_level", "O1", "--amp_dtype", "float16"],
        {},
        ["--amp_dtype float16", "jax"],
    ),
    (["--backend", "jax", "--steps", "0"], {}, ["--steps must be >= 1"]),
    (
        ["--model", "vit_huge_patch14_224", "--nproc_per_node", "4"],
        {},
        ["not enough memory", "4 process(es)", "--shard full"],
    ),
    (["--backend", "xla", "--lr", "inf"], {}, ["--lr must be a finite number"]),
    (["--aa", "rand-m9-banana"], {}, ["--aa 'rand-m9-banana'"]),
    (["--aa", "autoaug"], {}, ["--aa 'autoaug'", "rand-m9-mstd0.5-inc1"]),
    (["--reprob", "1.5"], {}, ["--reprob must be <= 1"]),
    (["--reprob", "-0.1"], {}, ["--reprob must be >= 0"]),
    (["--remode", "noise"], {}, ["--remode", "noise"]),
    (["--scale", "0.9", "0.2"], {}, ["--scale 0.9 0.2", "lower bound"]),
    (["--ratio", "0", "1"], {}, ["--ratio must be > 0"]),
    (["--train_interpolation", "lanczos"], {}, ["--train_interpolation", "lanczos"]),
    (["--nproc_per_node", "2", "--pp", "2", "--reprob", "0.25"], {}, ["--reprob with --pp"]),
    (["--model_ema_decay", "1"], {}, ["--model_ema_decay must be < 1"]),
    (["--layer_decay", "1.5"], {}, ["--layer_decay must be <= 1"]),
    (["--eval_only"], {}, ["--eval_only", "--resume"]),
    (["--no-save", "--save_every", "2"], {}, ["--no-save", "--save_every 2"]),
    (["--pretrained", "--pretrained_path", "w.pt"], {}, ["not both"]),
    (["--pretrained_path", "/nonexistent/w.safetensors"], {}, ["no file", "w.safetensors"]),
    (["--recipe", "resnet_a1"], {}, ["--recipe", "resnet_a1"]),
    (
        ["--aug_repeats", "3", "--nproc_per_node", "4", "--synthetic_length", "3"],
        {},
        ["--aug_repeats", "3 training images", "4 data-parallel ranks"],
    ),
]


def _one_line(code: int, err: str, needles, output: Path) -> None:
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert not any(output.glob("*/*/*")), "a run folder was created"


def _main(args, env, output: Path, capsys, monkeypatch) -> tuple[int, str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main([*BASE, "--output", str(output), *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        pytest.param(*c, id=" ".join(c[0]), marks=[pytest.mark.xla] if "xla" in c[0] else [])
        for c in CASES
    ],
)
def test_each_mistake_is_one_line_exit_2(args, env, needles, tmp_path, capsys, monkeypatch):
    code, err = _main(args, env, tmp_path, capsys, monkeypatch)
    _one_line(code, err, needles, tmp_path)


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        (lambda f: ["--data", str(f["one"])], ["1 class folder", "2 or more"]),
        (lambda f: ["--data", str(f["three"]), "--num_classes", "5"], ["--num_classes 5", "3"]),
        (lambda f: ["--data", str(f["root"] / "empty")], ["empty"]),
        (lambda f: ["--output", str(f["root"] / "a_file" / "runs")], ["a_file", "is a file"]),
        (lambda f: ["--resume", str(f["root"] / "truncated.pt")], ["not a readable checkpoint"]),
        (lambda f: ["--resume", str(f["root"] / "notes.pt")], ["notes.pt"]),
        (lambda f: ["--data", str(f["three"]), "--batch_size", "16"], ["holds 12 images"]),
    ],
    ids=["one-class", "num-classes", "empty", "output-file", "truncated", "not-ckpt", "small"],
)
def test_data_and_file_mistakes(case, needles, folders, tmp_path, capsys, monkeypatch):
    code, err = _main(case(folders), {}, tmp_path, capsys, monkeypatch)
    _one_line(code, err, needles, tmp_path)


@pytest.mark.parametrize(
    "args",
    [["--model", "vit_mcro"], ["--backend", "jax", "--shard", "full", "--pp", "2"]],
    ids=["eager", "jax"],
)
def test_the_real_command_line_says_it_in_one_line(args, tmp_path):
    result = run_cli(*BASE, *args, "--output", str(tmp_path), timeout=120)
    _one_line(result.returncode, result.stderr, [], tmp_path)


def test_use_accel_selects_the_xla_path():
    assert resolve_backend(None, {})[0] == "eager"
    assert resolve_backend(None, {"USE_ACCEL": "0"})[0] == "eager"
    assert resolve_backend(None, {"USE_ACCEL": "false"})[0] == "eager"
    assert resolve_backend("compile", {"USE_ACCEL": "1"})[0] == "compile"
    expected = "jax" if torch.cuda.is_available() else "xla"
    name, why = resolve_backend(None, {"USE_ACCEL": "true"})
    assert name == expected and "USE_ACCEL=1" in why


@pytest.mark.parametrize(
    "backend, keywords, variable",
    [
        ("jax", {"tp": 2, "devices": 2}, "JAX_NUM_PROCESSES"),
        ("jax", {"shard": "full", "devices": 2}, "JAX_NUM_PROCESSES"),
        pytest.param("xla", {"tp": 2, "devices": 2}, "WORLD_SIZE", marks=pytest.mark.xla),
    ],
)
def test_a_split_over_one_process_is_refused_from_the_support_table_where_processes_join(
    backend, keywords, variable, monkeypatch
):
    """What splits over one process's devices is refused before any process joins, by the
    backend's support table, in one line naming the keyword and the processes."""
    import accel
    from accel.backends import backend_module

    (keyword,) = [k for k in keywords if k != "devices"]
    assert keyword in backend_module(backend).SUPPORTS.one_process
    monkeypatch.setenv(variable, "2")
    model = torch.nn.Linear(4, 2)
    with pytest.raises(accel.AccelError) as err:
        accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(),
                      backend=backend, quiet=True, **keywords)  # fmt: skip
    message = str(err.value)
    assert "\n" not in message
    assert f"{keyword}= on the {backend} backend splits over one process's devices" in message
    assert "not across the 2 processes of this job" in message
