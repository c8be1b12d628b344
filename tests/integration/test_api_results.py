"""What a user's script gets back from accel.prepare, on every backend: the trained weights
(engine.state_dict, engine.sync_model), a loss function's extras beside the loss, and one line
for whatever goes wrong inside the user's own step."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from torch import nn
from torchvision.models import SwinTransformer

import accel
from tests.helpers import HAS_XLA, Net, grouped, steps_reading_nothing
from tests.helpers import api_loss_fn as loss_fn
from tests.helpers import api_metric_fn as metric_fn
from tests.helpers import colour_batches as batches

BACKENDS = ["eager", "compile", "xla", "jax"] if HAS_XLA else ["eager", "compile", "jax"]
PARITY = {"rel": 1e-4, "abs": 1e-5}  # fp32 across compilers: the backends' parity tests' bound
SLOW = pytest.mark.slow
HERE = Path(__file__).name


def tier(backend: str) -> list:
    """eager in the fast tier, every backend in the full suite."""
    return [] if backend == "eager" else [SLOW]


EVERY = [pytest.param(b, marks=tier(b)) for b in BACKENDS]


def timm_vit() -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=8, patch_size=4, depth=1, embed_dim=16, num_heads=2,
        num_classes=5,
    )  # fmt: skip


def torchvision_swin() -> nn.Module:
    return SwinTransformer(
        patch_size=[2, 2], embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=[2, 2],
        stochastic_depth_prob=0.0, num_classes=5,
    )  # fmt: skip


MODELS = {"own": Net, "timm_vit": timm_vit, "torchvision_swin": torchvision_swin}


def trained(backend: str, make: str, steps: int = 5, **options) -> tuple[accel.Engine, nn.Module]:
    torch.manual_seed(0)
    model = MODELS[make]()
    # SGD: Adam would turn the rounding noise of a gradient that is zero in exact arithmetic
    # (attention's key bias) into whole steps of its learning rate.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True, **options)
    engine.fetch([engine.step(*b) for b in engine.loader(batches(steps))])
    return engine, model


_eager: dict = {}


def eager_weights(make: str) -> dict[str, torch.Tensor]:
    if make not in _eager:
        _eager[make] = trained("eager", make)[0].state_dict()
    return _eager[make]


def plain_sums(model: nn.Module, data: list) -> dict[str, float]:
    """metric_fn's sums over `data`, in plain torch: what a user's own evaluation computes."""
    model.eval()
    with torch.no_grad():
        sums = [metric_fn(model, b) for b in data]
    return {k: float(sum(torch.as_tensor(s[k]) for s in sums)) for k in sums[0]}


# compile with the two small models: inductor's code for the Swin takes 26 s of the suite's time,
# and compile's weights are the module's own, as eager's
@pytest.mark.parametrize(
    ("backend", "make"),
    [
        pytest.param(b, m, marks=tier(b))
        for b in BACKENDS
        for m in sorted(MODELS)
        if (b, m) != ("compile", "torchvision_swin")
    ],
)
def test_the_trained_weights_come_back_alike_on_every_backend(backend, make):
    engine, _ = trained(backend, make)
    weights = engine.state_dict()
    torch.manual_seed(0)
    fresh = MODELS[make]()
    initial = fresh.state_dict()
    assert set(weights) == set(initial)
    assert all(w.device.type == "cpu" and w.dtype == initial[n].dtype for n, w in weights.items())
    assert any(not torch.equal(weights[n], initial[n]) for n in initial)  # it trained
    want = eager_weights(make)
    for name, value in weights.items():
        assert value.float() == pytest.approx(want[name].float(), **PARITY), name
    # A fresh model loaded from them evaluates as the engine does.
    fresh.load_state_dict(weights)
    data = batches(2, seed=5)
    got = engine.evaluate(data, metric_fn)
    assert got == pytest.approx(plain_sums(fresh, data), rel=1e-5)


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_sync_model_puts_the_trained_weights_in_the_users_model(backend):
    engine, model = trained(backend, "own", ema=0.5)
    assert engine.sync_model() is model
    weights = engine.state_dict()
    assert all(torch.equal(t.detach().cpu(), weights[n]) for n, t in model.state_dict().items())
    ema = engine.state_dict(ema=True)
    assert set(ema) == set(weights) and any(not torch.equal(ema[n], weights[n]) for n in ema)


@pytest.mark.jax
def test_the_users_own_model_reads_the_trained_weights_on_jax():
    """jax trains arrays of its own: the model the script gave prepare still reads as the
    trained one, through its state_dict() (what `torch.save(model.state_dict())` saves) and its
    forward, with no sync_model() call."""
    engine, model = trained("jax", "own", steps=3)
    weights = engine.state_dict()
    saved = model.state_dict()
    assert saved.keys() == weights.keys()
    assert all(torch.equal(saved[n], weights[n]) for n in weights)
    images = batches(1, seed=5)[0][0]
    model.eval()
    with torch.no_grad():
        assert model(images) == pytest.approx(engine.model(images), rel=1e-4, abs=1e-5)
    engine.fetch([engine.step(*batches(1, seed=6)[0])])  # trained further: read again
    assert all(torch.equal(model.state_dict()[n], t) for n, t in engine.state_dict().items())


def loss_with_accuracy(model: nn.Module, batch: tuple):
    images, labels = batch
    logits = model(images)
    accuracy = (logits.argmax(-1) == labels).float().mean()
    return nn.functional.cross_entropy(logits, labels), {"acc1": accuracy, "half": logits[0, 0] * 0}


def extras_of(backend: str) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = Net()
    engine = accel.prepare(
        model, grouped(model, "sgd"), loss_with_accuracy, backend=backend, accum=2, quiet=True
    )
    # the extras stay on the device with the loss
    handles = steps_reading_nothing(engine, backend, list(engine.loader(batches(4))))
    results = engine.fetch(handles)  # one transfer for the group, extras with the losses
    assert all(r.applied for r in results)
    return [r.extras for r in results]


@pytest.mark.parametrize("backend", EVERY)
def test_a_loss_returns_its_extras_beside_it_on_every_backend(backend):
    extras = extras_of(backend)
    assert [sorted(e) for e in extras] == [["acc1", "half"]] * 2
    # accuracy over the batch: a mean of the micro-batches' means, a multiple of 1/8
    assert all(0 <= e["acc1"] <= 1 and (e["acc1"] * 8) % 1 == 0 for e in extras)
    want = extras_of("eager") if backend != "eager" else extras
    assert all(e == pytest.approx(w, **PARITY) for e, w in zip(extras, want, strict=True))


# --- one line for what goes wrong inside the user's step ---------------------------------------
def mismatched_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels[:3])  # wrong: 3 labels


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_an_error_inside_the_users_loss_is_one_line_naming_it(backend):
    model = Net()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    engine = accel.prepare(model, grouped(model, "sgd"), mismatched_loss, backend=backend,
                           quiet=True)  # fmt: skip
    with pytest.raises(accel.AccelError) as err:
        engine.step(*batches(1)[0])
    line = str(err.value)
    assert "\n" not in line and f"{HERE}:" in line and "labels[:3]" in line
    after = engine.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before)  # no weight changed


class MakesATensorInside(nn.Module):
    """A forward that makes a tensor with no device (torch's default, the host)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.ones(5).cumsum(0).numpy()  # a host array inside the traced step
        return self.head(x.mean((2, 3))) + torch.from_numpy(bias)


def test_an_error_while_jax_traces_the_model_is_one_line_naming_the_users_line():
    model = MakesATensorInside()
    engine = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                           backend="jax", quiet=True)  # fmt: skip
    with pytest.raises(accel.AccelError) as err:
        engine.step(*batches(1)[0])
    assert "\n" not in str(err.value) and HERE in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_with_nothing_to_train_is_refused_at_prepare(backend):
    model = Net().requires_grad_(False)
    with pytest.raises(accel.AccelError, match="Net has no trainable parameter"):
        accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                      backend=backend, quiet=True)  # fmt: skip


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (({"image": torch.zeros(4, 3, 8, 8), "path": "a.jpg"},), r"\['path'\] is a str"),
        ((torch.zeros(4, 3, 8, 8), torch.tensor(1)), "a 0-dim tensor"),
        ((), "got no batch"),
    ],
)
def test_a_batch_that_is_not_tensors_along_a_batch_axis_is_one_line(batch, match):
    model = Net()
    engine = accel.prepare(model, grouped(model, "sgd"), loss_fn, quiet=True)
    with pytest.raises(accel.AccelError, match=match):
        engine.step(*batch)


def nan_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return loss_fn(model, batch) * float("nan")


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_a_step_that_never_applies_says_so_instead_of_training_flat(backend):
    model = Net()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    engine = accel.prepare(model, grouped(model, "sgd"), nan_loss, backend=backend, quiet=True)
    with pytest.raises(accel.AccelError, match="none of the first 10 steps applied its update"):
        engine.fetch([engine.step(*b) for b in batches(10)])
    after = engine.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_a_new_batch_shape_on_jax_is_said_once_with_both_shapes(capsys):
    model = Net()
    engine = accel.prepare(model, grouped(model, "sgd"), loss_fn, backend="jax", quiet=True)
    for size in (16, 16, 8, 8, 16, 8):  # a shape seen before runs its compiled step
        engine.step(*batches(1, size=size)[0])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compiled again" in err[0]
    assert "[8, 3, 8, 8]" in err[0] and "[16, 3, 8, 8]" in err[0]


# --- what a classic script needs of the API -----------------------------------------------------
@pytest.mark.parametrize("backend", EVERY)
def test_prepare_runs_again_in_the_same_process(backend):
    first, _ = trained(backend, "own", steps=2)
    second, model = trained(backend, "own", steps=2)
    assert second.state_dict().keys() == model.state_dict().keys()
    assert all(r.applied for r in second.fetch([second.step(*batches(1)[0])]))
    assert first.steps_done == 2 and second.steps_done == 3


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_evaluate_over_a_loader_whose_last_batch_is_smaller(backend):
    engine, _ = trained(backend, "own", steps=1)
    data = torch.utils.data.TensorDataset(*(torch.cat(t) for t in zip(*batches(2), strict=True)))
    loader = torch.utils.data.DataLoader(data, batch_size=12)  # 32 images: 12, 12 and 8
    sums = engine.evaluate(loader, metric_fn)
    assert sums["count"] == 32
    assert sums == pytest.approx(engine.evaluate([data.tensors], metric_fn), rel=1e-5)


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_engine_model_is_an_eval_forward_returning_torch_tensors(backend):
    engine, _ = trained(backend, "own", steps=2)
    fresh = Net()
    fresh.load_state_dict(engine.state_dict())
    fresh.eval()
    images = batches(1)[0][0]
    for device_images in (images, next(iter(engine.loader([(images,)])))[0]):
        out = engine.model(device_images)
        assert isinstance(out, torch.Tensor) and out.device.type in (
            "cpu",
            device_images.device.type,
        )
        assert out.cpu() == pytest.approx(fresh(images).detach(), rel=1e-4, abs=1e-5)
    assert (
        engine.model.eval() is not None
        and engine.model.state_dict().keys() == fresh.state_dict().keys()
    )


def test_a_scheduler_the_script_steps_per_epoch_sets_the_rate_of_the_next_steps():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine = accel.prepare(model, optimizer, loss_fn, quiet=True)
    rates = []
    for _epoch in range(3):
        for images, labels in batches(2):
            engine.step(images, labels)
            rates.append(engine.lr[0])
        scheduler.step()
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_save_and_load_keep_the_scripts_own_state(backend, tmp_path):
    engine, _ = trained(backend, "own", steps=2)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scheduler.step()
    extra = {"epoch": 3, "best_acc1": 0.75, "scheduler": scheduler.state_dict()}
    engine.save(tmp_path / "ckpt.pt", extra=extra)
    again, _ = trained(backend, "own", steps=1)
    assert again.load(tmp_path / "ckpt.pt") == extra
    assert again.steps_done == 2
    saved = engine.state_dict()
    assert all(torch.equal(t, saved[n]) for n, t in again.state_dict().items())


@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_float_class_ids_are_one_line_naming_the_users_loss(backend):
    model = Net()
    engine = accel.prepare(model, grouped(model, "sgd"), loss_fn, backend=backend, quiet=True)
    images, labels = batches(1)[0]
    with pytest.raises(accel.AccelError) as err:
        engine.step(images, labels.float())
    assert "\n" not in str(err.value) and "helpers.py" in str(err.value)
