"""Tensor parallelism on the xla backend: one process over a 2-D SPMD mesh of 4 PJRT CPU devices,
data 2 x model 2, through the public API. A timm ViT (its blocks found by module type) and a
user's own MLP (its tp_plan) each train the one-device run's losses on the same global batches;
the split weights and their moments are held in halves along `model`, engine.state_dict() is
the whole model under its torch names, and a checkpoint resumes the split run exactly.

The mesh runs are this file run as a module (`python -m tests.integration.test_xla_tensor_parallel
KIND DEVICES TP OUT`), each in a process of its own: the mesh's CPU devices (CPU_NUM_DEVICES) are
set before torch_xla's runtime starts there, where this process's runtime started with one (the
one-device runs are made here).
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import accel
from tests.helpers import fork_module, launch

pytestmark = [pytest.mark.slow, pytest.mark.xla]

MODULE = "tests.integration.test_xla_tensor_parallel"
MLP_PLAN = {"0": "colwise", "2": "rowwise"}
# Which parameters split, and along which axis, by name pattern; every other one stays whole.
SPLITS = {
    "mlp": {"0.weight": 0, "0.bias": 0, "2.weight": 1},
    "vit": {
        "blocks.*.attn.qkv.weight": 0,
        "blocks.*.attn.qkv.bias": 0,
        "blocks.*.attn.proj.weight": 1,
        "blocks.*.mlp.fc1.weight": 0,
        "blocks.*.mlp.fc1.bias": 0,
        "blocks.*.mlp.fc2.weight": 1,
    },
}
STEPS, SAVED_AT, BATCH = 5, 3, 8  # global batches of 8; a checkpoint after the third step


# --- the runs (in a process of their own) -------------------------------------------------------
def build(kind: str) -> nn.Module:
    if kind == "vit":
        import timm

        return timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
        )
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))


def batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, 3, 32, 32) if kind == "vit" else (BATCH, 16)
    return [
        (torch.randn(shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def loss_fn(model, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def prepared(kind: str, devices: int, tp: int, seed: int) -> tuple[nn.Module, accel.Engine]:
    torch.manual_seed(seed)
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = MLP_PLAN if kind == "mlp" and tp > 1 else None
    engine = accel.prepare(
        model, optimizer, loss_fn, backend="xla", devices=devices, tp=tp, tp_plan=plan, quiet=True
    )
    return model, engine


def layout(tensor: torch.Tensor) -> dict:
    """How the devices hold `tensor`, through torch_xla's public sharded-tensor view: its
    sharding spec, and the shape of each device's shard."""
    import torch_xla.distributed.spmd as xs

    sharded = xs.wrap_if_sharded(tensor)
    if not isinstance(sharded, xs.XLAShardedTensor):
        return {"spec": None, "shards": []}
    shards = [list(shard.data.shape) for shard in sharded.local_shards]
    return {"spec": sharded.sharding_spec, "shards": shards}


def layouts(engine: accel.Engine) -> dict:
    """The layout of each weight and of its AdamW moments, by the weight's name."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # shards are read once the device holds them
    state = engine.checkpoints.parts().tensors.state_dict()  # the live tensors
    out = {}
    for name, weight in state["model"].items():
        moments = state["optim"].get(name, {})
        out[name] = {
            "weight": layout(weight),
            "moments": [layout(moments[k]) for k in ("exp_avg", "exp_avg_sq") if k in moments],
        }
    return out


def steps(engine: accel.Engine, data: list) -> list[float]:
    return [float(r.loss) for r in engine.fetch([engine.step(*b) for b in data])]


def run(kind: str, devices: int, tp: int, out: Path) -> None:
    """Five steps, a checkpoint after the third; then a second engine, started from other
    weights, loads it and takes the last two steps again."""
    model, engine = prepared(kind, devices, tp, seed=0)
    data = batches(kind)
    losses = steps(engine, data[:SAVED_AT])
    engine.save(out / "checkpoint")
    losses += steps(engine, data[SAVED_AT:])
    state = engine.state_dict()
    split = layouts(engine)
    _, again = prepared(kind, devices, tp, seed=1)
    again.load(out / "checkpoint")
    loaded = layouts(again)
    resumed = steps(again, data[SAVED_AT:])
    record = {
        "losses": losses,
        "resumed": resumed,
        "names": list(state),
        "model_names": list(model.state_dict()),
        "shapes": {n: list(t.shape) for n, t in state.items()},
        "devices": sorted({t.device.type for t in state.values()}),
        "weights": {n: t.float().flatten()[:16].tolist() for n, t in state.items()},
        "layouts": split,
        "loaded_layouts": loaded,
        "replicas": engine.replicas,
        "mesh_devices": engine.stats().devices,
    }
    (out / "result.json").write_text(json.dumps(record))


# --- the tests ----------------------------------------------------------------------------------
def start(kind: str, devices: int, tp: int, out: Path) -> dict:
    """The run on one device in this process (whose runtime started with one); on a mesh in a
    process of its own."""
    out.mkdir(parents=True, exist_ok=True)
    if devices == 1:
        run(kind, devices, tp, out)
    else:
        env = {"CPU_NUM_DEVICES": str(devices), "PJRT_DEVICE": "CPU"}
        done = fork_module(MODULE, kind, str(devices), str(tp), str(out), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module", params=["vit", "mlp"])
def runs(request, tmp_path_factory) -> tuple[str, dict, dict]:
    """(kind, one device, data 2 x model 2)."""
    kind = request.param
    one = start(kind, 1, 1, tmp_path_factory.mktemp(f"{kind}-one"))
    split = start(kind, 4, 2, tmp_path_factory.mktemp(f"{kind}-dp2xtp2"))
    return kind, one, split


def split_axis(kind: str, name: str) -> int | None:
    for pattern, axis in SPLITS[kind].items():
        if fnmatch.fnmatchcase(name, pattern):
            return axis
    return None


def test_data2_by_model2_trains_the_one_device_losses(runs):
    _, one, split = runs
    np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
    assert split["replicas"] == 2 and split["mesh_devices"] == 4  # the batch splits over `data`
    for name, values in one["weights"].items():
        np.testing.assert_allclose(split["weights"][name], values, rtol=1e-4, atol=1e-6)


def test_split_weights_and_moments_are_held_in_halves_along_the_model_axis(runs):
    kind, _, split = runs
    named = {n: split_axis(kind, n) for n in split["layouts"]}
    assert any(axis is not None for axis in named.values()), "nothing split"
    for which in ("layouts", "loaded_layouts"):  # after training, and after a checkpoint loads
        for name, axis in named.items():
            held = split[which][name]
            whole = split["shapes"][name]
            half = [s // 2 if i == axis else s for i, s in enumerate(whole)]
            for tensor in [held["weight"], *held["moments"]]:
                if axis is None:  # whole on every device (a fresh copy carries no annotation)
                    assert tensor["spec"] in (None, "{replicated}"), (which, name, tensor)
                    assert all(shard == whole for shard in tensor["shards"]), (which, name)
                    continue
                # 2 halves along `model`, each held by the 2 devices of `data`
                assert tensor["spec"].startswith("{devices=["), (which, name, tensor)
                assert tensor["shards"] == [half] * 4, (which, name, tensor)
            assert len(held["moments"]) == 2, (which, name)


def test_state_dict_is_the_whole_model_under_its_torch_names(runs):
    kind, one, split = runs
    assert split["names"] == split["model_names"] == one["names"]
    assert split["shapes"] == one["shapes"]
    assert split["devices"] == ["cpu"]
    model = build(kind)
    assert split["shapes"] == {n: list(t.shape) for n, t in model.state_dict().items()}


def test_a_checkpoint_of_the_split_run_resumes_it_exactly(runs):
    _, one, split = runs
    np.testing.assert_allclose(split["resumed"], split["losses"][SAVED_AT:], rtol=1e-6)
    np.testing.assert_allclose(one["resumed"], one["losses"][SAVED_AT:], rtol=1e-6)


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build("mlp")
    return model, torch.optim.AdamW(model.parameters())


def test_tp_with_shard_full_is_refused_in_one_line():
    model, optimizer = _mlp()
    with pytest.raises(accel.AccelError) as err:
        accel.prepare(
            model, optimizer, loss_fn, backend="xla", devices=4, tp=2, tp_plan=MLP_PLAN,
            shard="full", quiet=True,
        )  # fmt: skip
    message = str(err.value)
    assert "\n" not in message and "tp=" in message and "shard=" in message, message
    code, _, stderr = launch(
        "--backend", "xla", "--nproc_per_node", "4", "--tp", "2", "--shard", "full",
        "--steps", "1", "--synthetic_length", "16", "--workers", "0",
    )  # fmt: skip
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, stderr[-2000:]
    assert "--tp and --shard cannot be combined on the xla backend" in lines[0]


def _tp2_refusal(devices: int) -> str:
    """prepare's one-line refusal of tp=2 on an xla mesh of `devices` devices."""
    model, optimizer = _mlp()
    with pytest.raises(accel.AccelError) as err:
        accel.prepare(
            model, optimizer, loss_fn, backend="xla", devices=devices, tp=2, tp_plan=MLP_PLAN,
            quiet=True,
        )  # fmt: skip
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_tp_without_a_device_mesh_is_refused_in_one_line():
    message = _tp2_refusal(devices=1)
    assert "tp=2" in message and "devices=N" in message, message
    assert "devices=1" in message


def test_a_mesh_that_tp_does_not_divide_is_refused_in_one_line():
    message = _tp2_refusal(devices=3)
    assert "not divisible by tp=2" in message, message


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
