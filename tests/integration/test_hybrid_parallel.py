"""Parallelisms composed over one mesh (4 gloo processes): data x tensor, tensor x pipeline, FSDP
x tensor, the tensor-parallel blocks with the split classifier, and torch.compile over data x
tensor all train the one-process losses; a tensor x pipeline checkpoint loads at data 4 and in
one process; a user's torchvision Swin-T and own model split by tensors through accel.prepare
train the one-process losses and their checkpoints load whole on one process; each combination
a backend cannot run is refused in one line."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import accel
from accel.config import AccelError
from tests import api_tensor_parallel
from tests.api_tensor_parallel import MlpNet, build
from tests.helpers import (
    api_loss_fn,
    as_a_command,
    fork_module,
    script_ranks,
    train,
    train_ranks,
    xla_flags,
)

pytestmark = pytest.mark.slow

# 4 blocks (2 pipeline stages of 2), clipping on (its norm spans the tensor shards, the
# classifier's rows and the stages) and an EMA of every split weight; a global batch of 8. 64
# synthetic images: 6 steps' worth, and 16 to evaluate (the default's 256 would make each rank's
# evaluation of the model and its EMA, a step of DTensor's dispatch per layer, half its run).
JOB = ("--model", "vit_micro_d4", "--steps", "6", "--batch_size", "8", "--workers", "0")
JOB += ("--synthetic_length", "64")
JOB += ("--log_every", "1", "--save_every", "2", "--pp_microbatches", "2", "--clip_grad", "0.5")
JOB += ("--model_ema", "--model_ema_decay", "0.9", "--num_classes", "11")
FOUR = ("--nproc_per_node", "4")
LAYOUTS = {
    "tp2xdp2": (*FOUR, "--tp", "2", "--batch_size", "4"),
    "tp2xpp2": (*FOUR, "--tp", "2", "--pp", "2"),
    "fsdp2xtp2": (*FOUR, "--tp", "2", "--shard", "full", "--batch_size", "4"),
    "tp2+head": ("--nproc_per_node", "2", "--tp", "2", "--tp_head", "2"),
    "compile tp2xdp2": (*FOUR, "--tp", "2", "--batch_size", "4", "--backend", "compile"),
}
# torch.compile's layout on the 2-block vit_micro: each of its 4 ranks compiles the whole model,
# here half the blocks of vit_micro_d4; against the same job in one process.
TWO_BLOCKS = ("--model", "vit_micro")
LAYOUTS["compile tp2xdp2"] += TWO_BLOCKS
REFERENCE = {name: "single" for name in LAYOUTS} | {"compile tp2xdp2": "single, 2 blocks"}
MESHES = {
    "tp2xdp2": "dp 2 x tp 2 (4 processes)",
    "tp2xpp2": "dp 1 x tp 2 x pp 2 (4 processes)",
    "fsdp2xtp2": "fsdp 2 x tp 2 (4 processes)",
    "tp2+head": "dp 1 x tp 2 (2 processes)",
    "compile tp2xdp2": "dp 2 x tp 2 (4 processes)",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict, str]]:
    out = {}
    single = tmp_path_factory.mktemp("single")
    out["single"] = (single, *train(single, *JOB))
    two = tmp_path_factory.mktemp("single-2-blocks")
    out["single, 2 blocks"] = (two, *train(two, *JOB, *TWO_BLOCKS))
    for name, extra in LAYOUTS.items():
        output = tmp_path_factory.mktemp(name.replace(" ", "-").replace("+", "-"))
        out[name] = (output, *train_ranks(output, *JOB, *extra))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_composition_trains_the_one_process_losses(runs, name):
    _, single, _ = runs[REFERENCE[name]]
    _, split, stdout = runs[name]
    assert f"accel: mesh {MESHES[name]}" in stdout
    assert split["global_batch_size"] == single["global_batch_size"] == 8
    np.testing.assert_allclose(split["losses"][:5], single["losses"][:5], rtol=1e-5)
    np.testing.assert_allclose(split["eval_loss"], single["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(split["eval_loss_ema"], single["eval_loss_ema"], rtol=1e-5)
    assert split["eval_acc"] == single["eval_acc"]


def test_tensor_split_holds_part_of_the_blocks(runs):
    """Each rank of a tensor-parallel pair holds about half of the blocks' weights and AdamW
    state; with FSDP over the data axis too, about a quarter."""
    _, single, _ = runs["single"]
    for name, most in (("tp2xdp2", 0.62), ("fsdp2xtp2", 0.3)):
        held = runs[name][1]["state_bytes"]
        for part in ("params", "optimizer"):
            assert held[part] <= most * single["state_bytes"][part], (name, part)


def _checkpoint(output: Path, step: int) -> Path:
    return output / "vit_micro_d4" / "eager" / "r" / "checkpoints" / f"step_{step:08d}.dcp"


def test_tensor_by_pipeline_checkpoint_loads_at_data_4_and_in_one_process(runs, tmp_path):
    output, split, _ = runs["tp2xpp2"]
    resume = ("--resume", str(_checkpoint(output, 6)))
    data4, _ = train_ranks(tmp_path / "dp4", *JOB, *FOUR, "--batch_size", "2", *resume)
    one, _ = train(tmp_path / "one", *JOB, *resume)
    for run in (data4, one):
        np.testing.assert_allclose(run["eval_loss"], split["eval_loss"], rtol=1e-5)
        np.testing.assert_allclose(run["eval_loss_ema"], split["eval_loss_ema"], rtol=1e-5)
        assert run["losses"] == split["losses"]  # the saved run's, carried


# --- a user's own script -------------------------------------------------------------------------
SCRIPT = "tests.api_tensor_parallel"


def _script(model: str, out: Path, ranks: int = 1, backend="eager", devices="1", tp="1") -> dict:
    """The script as `python -m` runs it, in this process; on several ranks, as `torchrun
    --standalone --nproc_per_node RANKS -m` starts it (helpers.script_ranks: its subject is what
    the split trains; test_examples.py runs the documented torchrun commands themselves)."""
    args = (model, backend, devices, tp, "none", str(out))
    if ranks == 1:
        with as_a_command(None, [SCRIPT, *args]):
            api_tensor_parallel.main()
    else:
        script_ranks(ranks, SCRIPT, *args, logs=out / "logs")
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("model", ["swin", "own"])
def test_a_users_model_split_by_tensors_trains_the_one_process_losses(model, tmp_path):
    one = _script(model, tmp_path / "one")
    split = _script(model, tmp_path / "split", ranks=4, tp="2")
    np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
    assert split["shapes"] == one["shapes"]  # engine.state_dict: the unsplit model's tensors
    for name, values in one["weights"].items():  # Adam's steps of 1e-2 agree to 1e-4
        np.testing.assert_allclose(split["weights"][name], values, rtol=1e-3, atol=1e-4)
    # Its checkpoint, written in parts, loads whole into one process of the user's model.
    fresh, _ = build(model)
    engine = accel.prepare(fresh, torch.optim.AdamW(fresh.parameters()), api_loss_fn,
                           backend="eager", quiet=True)  # fmt: skip
    engine.load(tmp_path / "split" / "checkpoint")
    loaded = engine.state_dict()
    for name, values in split["weights"].items():
        np.testing.assert_allclose(loaded[name].flatten().numpy(), values, rtol=1e-6, atol=1e-7)


# --- refusals ------------------------------------------------------------------------------------
def _refused(**kwargs) -> str:
    model = MlpNet()
    with pytest.raises(AccelError) as err:
        accel.prepare(model, torch.optim.AdamW(model.parameters()), api_loss_fn, quiet=True,
                      **kwargs)  # fmt: skip
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_plan_that_cannot_split_is_refused_in_one_line():
    assert "'fc9' names no module of MlpNet" in _refused(tp=2, tp_plan={"fc9": "colwise"})
    assert "'sideways' is not one of" in _refused(tp=2, tp_plan={"fc1": "sideways"})
    assert "'stem' is a Conv2d" in _refused(tp=2, tp_plan={"stem": "colwise"})
    assert "'fc1' has 32 output features, not divisible by 3" in _refused(
        tp=3, tp_plan={"fc1": "colwise", "fc2": "rowwise"}
    )
    assert "MlpNet has no block accel knows how to split" in _refused(tp=2)
    assert "tp, tp_head and pp must be at least 1" in _refused(tp=0)


def test_a_checkpoint_of_jax_data_2_by_model_2_loads_on_eager(tmp_path):
    pytest.importorskip("jax", reason="jax is not installed")
    env = {"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")}
    done = fork_module(SCRIPT, "own", "jax", "4", "2", "none", str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = json.loads((tmp_path / "result.json").read_text())
    fresh, _ = build("own")
    engine = accel.prepare(fresh, torch.optim.AdamW(fresh.parameters()), api_loss_fn,
                           backend="eager", quiet=True)  # fmt: skip
    engine.load(tmp_path / "checkpoint")
    loaded = engine.state_dict()
    assert sorted(loaded) == sorted(trained["weights"])
    for name, values in trained["weights"].items():
        np.testing.assert_allclose(loaded[name].flatten().numpy(), values, rtol=1e-6, atol=1e-7)
