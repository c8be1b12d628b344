"""Tensor parallelism on the jax backend: 4 CPU devices as data 2 x model 2 (and with
shard="full", FSDP 2 x model 2), the weights split by XLA's partitioner, trained through the
public API to the one-device run's losses on the same global batches; the state each device
holds, the whole state_dict, evaluation, the model's forward and a checkpoint's round trip on
the 2-D mesh.

The runs on 4 devices are this module run as a script in a process of its own (JAX reads its
device count once, as it starts); the one-device runs are made in the test's process:

    python -m tests.integration.test_jax_tensor_parallel MODEL DEVICES TP SHARD OUT
    python -m tests.integration.test_jax_tensor_parallel refusals - - - OUT
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import accel
from tests.helpers import fork_module, xla_flags

pytestmark = pytest.mark.slow  # each run starts a process and compiles its own jax step

SCRIPT = "tests.integration.test_jax_tensor_parallel"
FOUR_HOST_DEVICES = "--xla_force_host_platform_device_count=4"
STEPS, BATCH = 5, 8
MLP_PLAN = {"0": "colwise", "2": "rowwise"}


# --- the script: one run of a layout, its results written to OUT ------------------------------
def build_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "vit":
        import timm

        return timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
        )
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))


def batches(kind: str, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (3, 32, 32) if kind == "vit" else (16,)
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, *shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(count)
    ]


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def metric_fn(model: nn.Module, batch: tuple) -> dict:
    inputs, labels = batch
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
    return {"loss": loss, "correct": (logits.argmax(-1) == labels).sum(), "count": len(labels)}


def prepared(kind: str, devices: int, tp: int, shard: str, seed: int = 0) -> accel.Engine:
    model = build_model(kind, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    plan = MLP_PLAN if kind == "mlp" and tp > 1 else None
    return accel.prepare(
        model, optimizer, loss_fn, backend="jax", devices=devices, tp=tp, tp_plan=plan,
        shard=shard, clip_grad=1.0, quiet=True,
    )  # fmt: skip


def layout(engine: accel.Engine) -> dict:
    """Per weight and per first moment: its whole shape, one device's part of it, and the mesh
    axis each of its axes splits over (None: whole)."""
    live = engine.live_state()  # the jax arrays, with their shardings

    def part(array) -> dict:
        local = array.addressable_shards[0].data
        spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
        return {"shape": list(array.shape), "device": list(local.shape), "spec": spec}

    trained = [n for n in live["model"] if n in live["optim"]]  # the parameters, not the buffers
    moments = {n: part(live["optim"][n]["exp_avg"]) for n in trained}
    return {"params": {n: part(live["model"][n]) for n in trained}, "mu": moments}


def run_layout(kind: str, devices: int, tp: int, shard: str, out: Path) -> None:
    engine = prepared(kind, devices, tp, shard)
    data = engine.loader(batches(kind, STEPS, seed=1))
    losses = [r.loss for r in engine.fetch([engine.step(*b) for b in data])]
    held_out = batches(kind, 2, seed=9)
    evaluated = engine.evaluate(held_out, metric_fn)
    state = engine.state_dict()
    torch.save(state, out / "state.pt")
    engine.save(out / "checkpoint")
    # A fresh engine of the same layout (other initial weights) takes the checkpoint back.
    back = prepared(kind, devices, tp, shard, seed=5)
    back.load(out / "checkpoint")
    loaded = back.state_dict()
    stats = engine.stats()
    record = {
        "losses": losses,
        "state_bytes": stats.state_bytes,
        "devices": stats.devices,
        "shard": stats.shard,
        "evaluated": evaluated,
        "forward": engine.model(held_out[0][0]).tolist(),  # logits, on the host
        "loaded_evaluated": back.evaluate(held_out, metric_fn),
        "loaded_equal": all(torch.equal(loaded[n], t) for n, t in state.items()),
        "layout": layout(engine),
        "loaded_layout": layout(back),
    }
    (out / "result.json").write_text(json.dumps(record))


def refusals(out: Path) -> None:
    """The one-line refusals of sizes that do not fit: 4 devices are no multiple of tp 3, and
    a layer's 63 output features do not split in 2."""
    odd = nn.Sequential(nn.Linear(16, 63), nn.GELU(), nn.Linear(63, 10))
    cases = {"devices": (build_model("vit"), 3, None), "features": (odd, 2, MLP_PLAN)}
    found = {}
    for case, (model, tp, plan) in cases.items():
        try:
            accel.prepare(
                model, torch.optim.AdamW(model.parameters()), loss_fn, backend="jax",
                devices=4, tp=tp, tp_plan=plan, quiet=True,
            )  # fmt: skip
            found[case] = ""
        except accel.AccelError as err:
            found[case] = str(err)
    (out / "result.json").write_text(json.dumps(found))


# --- the tests ----------------------------------------------------------------------------------
def run(tmp_path: Path, *args: str) -> dict:
    env = {"XLA_FLAGS": xla_flags(FOUR_HOST_DEVICES), "JAX_PLATFORMS": "cpu"}
    done = fork_module(SCRIPT, *args, str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict:
    """The one-device runs of each model, the reference: in this process, whose JAX has one
    CPU device."""
    found = {}
    for kind in ("vit", "mlp"):
        out = tmp_path_factory.mktemp(f"one_{kind}")
        run_layout(kind, 1, 1, "none", out)
        found[kind] = (json.loads((out / "result.json").read_text()), out)
    return found


def same_training(split: tuple[dict, Path], whole: tuple[dict, Path]) -> None:
    """The losses of the one-device run, and its trained weights, whole, under the torch names."""
    (result, out), (reference, reference_out) = split, whole
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-5)
    state = torch.load(out / "state.pt", weights_only=True)
    expected = torch.load(reference_out / "state.pt", weights_only=True)
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert state[name].shape == tensor.shape and state[name].dtype == tensor.dtype, name
        # A tenth of one step's update (lr 1e-3): Adam's step on a near-zero gradient turns the
        # sums' other order into differences far above float rounding.
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-4)
    for key, value in reference["evaluated"].items():
        assert result["evaluated"][key] == pytest.approx(value, rel=1e-5), key
    np.testing.assert_allclose(result["forward"], reference["forward"], rtol=1e-4, atol=1e-4)
    # The checkpoint loads back into the same layout: the same weights, laid out as before.
    assert result["loaded_equal"]
    assert result["loaded_evaluated"] == result["evaluated"]
    assert result["loaded_layout"] == result["layout"]


@pytest.mark.parametrize("shard", ["none", "full"])
def test_vit_over_data_and_model_axes_trains_the_one_device_losses(one_device, tmp_path, shard):
    result = run(tmp_path, "vit", "4", "2", shard)
    same_training((result, tmp_path), one_device["vit"])
    assert result["devices"] == 4 and result["shard"] == shard
    params, moments = result["layout"]["params"], result["layout"]["mu"]
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight"):  # colwise: rows split
        whole, part = params[name]["shape"], params[name]["device"]
        expected = [whole[0] // 2, whole[1] // 2 if shard == "full" else whole[1]]
        assert part == expected, name
        assert moments[name] == params[name], name  # the moments split as their weights
    proj = params["blocks.0.attn.proj.weight"]  # rowwise: columns split
    assert proj["spec"] == ["fsdp" if shard == "full" else None, "tp"]
    reference = one_device["vit"][0]["state_bytes"]
    share = (result["state_bytes"]["params"] + result["state_bytes"]["optimizer"]) / (
        reference["params"] + reference["optimizer"]
    )
    if shard == "full":  # every weight split 4 ways, but for the few that nothing divides
        assert share <= 0.30
    else:  # the blocks' linear layers split 2 ways, the rest whole on each device
        assert 0.5 <= share < 0.6


@pytest.mark.parametrize("shard", ["none", "grad_op"])
def test_a_models_own_plan_trains_the_one_device_losses(one_device, tmp_path, shard):
    result = run(tmp_path, "mlp", "4", "2", shard)
    same_training((result, tmp_path), one_device["mlp"])
    params, moments = result["layout"]["params"], result["layout"]["mu"]
    assert params["0.weight"]["device"] == [32, 16] and params["2.weight"]["device"] == [10, 32]
    assert params["0.bias"]["device"] == [32] and params["2.bias"]["device"] == [10]
    if shard == "grad_op":  # the moments split over the data axis as well, the weights not
        assert moments["0.weight"]["device"] == [32, 8]
        assert moments["2.weight"]["device"] == [5, 32]


def test_sizes_that_do_not_fit_are_refused_in_one_line(tmp_path):
    found = run(tmp_path, "refusals", "-", "-", "-")
    assert "not divisible by tp=3" in found["devices"]
    assert "63 output features, not divisible by 2" in found["features"]
    assert all(message and "\n" not in message for message in found.values())


if __name__ == "__main__":
    target = Path(sys.argv[5])
    target.mkdir(parents=True, exist_ok=True)
    if sys.argv[1] == "refusals":
        refusals(target)
    else:
        run_layout(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], target)
