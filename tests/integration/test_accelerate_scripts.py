"""What an Accelerate script does, through accel on every backend, against the plain loop it
came from: accumulation groups cut short at an epoch's end weigh as the plain loop weighs them."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import accel
from tests.helpers import INSTALLED, script_ranks

ACCUM = 5


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def micro_batches(count: int) -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(count)]  # fmt: skip


def groups(batches: list) -> list[list]:
    """An epoch's micro-batches in groups of ACCUM, the last one short (7 -> 5 and 2)."""
    return [batches[i : i + ACCUM] for i in range(0, len(batches), ACCUM)]


def plain_loop(batches: list[tuple]) -> tuple[dict, list[float]]:
    """The plain loop's accumulation (Accelerate's too): each micro-batch's loss divided by
    ACCUM, the optimizer stepped after a whole group and at the epoch's end."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for group in groups(batches):
        parts = [loss_fn(model, b) for b in group]
        for part in parts:
            (part / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(torch.stack(parts).detach().mean()))
    return model.state_dict(), losses


@pytest.mark.parametrize("backend", INSTALLED)
def test_a_short_accumulation_group_weighs_as_in_the_plain_loop(backend):
    """7 micro-batches with accum=5: the group of 2 weighs 2/5 of a whole group, as the plain
    loop's (the mean over the 2 would put the weights 8.5e-2 apart); each step's loss is still
    the mean over its micro-batches."""
    batches = micro_batches(7)
    want, want_losses = plain_loop(batches)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine = accel.prepare(model, optimizer, loss_fn, backend=backend, accum=ACCUM, quiet=True)
    device_batches = list(engine.loader(batches))
    handles = [engine.step_micro_batches(group) for group in groups(device_batches)]
    losses = [r.loss for r in engine.fetch(handles)]
    assert losses == pytest.approx(want_losses, rel=1e-5)
    got = engine.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def transformers_model(kind: str) -> nn.Module:
    """A small transformers ViT, or Swin at 56 px with 7-token windows: its last stage's 7x7
    grid equals the window, so its shifted block sets shift_size to 0 on its first forward,
    as Swin-T's last stage does at 224. No dropout or drop path: the backends' draws differ."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "vit":
        config = transformers.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, num_labels=3,
        )  # fmt: skip
        return transformers.ViTForImageClassification(config)
    config = transformers.SwinConfig(
        image_size=56, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
        window_size=7, num_labels=3, drop_path_rate=0.0,
    )  # fmt: skip
    return transformers.SwinForImageClassification(config)


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss


def hf_batches(kind: str, sizes: tuple[int, ...]) -> list[dict]:
    side = 32 if kind == "vit" else 56
    g = torch.Generator().manual_seed(5)
    return [{"pixel_values": torch.randn(n, 3, side, side, generator=g),
             "labels": torch.randint(0, 3, (n,), generator=g)} for n in sizes]  # fmt: skip


# transformers' ViT: the same through examples/accelerate_finetune_accel.py (test_examples.py).
# Not on compile: torch.compile's own handling of the model (a minute of a cold suite's time),
# not accel's, which the compile cases of the tests above and below cover.
@pytest.mark.parametrize("kind", ["swin"])
@pytest.mark.parametrize("backend", [b for b in INSTALLED if b != "compile"])
def test_transformers_models_train_as_the_plain_loop_with_a_ragged_short_last_group(backend, kind):
    """transformers' Swin, called by keyword on dict batches, with accum=2 over an epoch of 8,
    8 and a ragged 5: the last group is one micro-batch of a new shape. Every backend trains
    as the plain loop (jax traced such models once, and refused Swin's shift_size settling on
    its first forward)."""
    batches = hf_batches(kind, (8, 8, 5))
    model = transformers_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want_losses = []
    for group in (batches[:2], batches[2:]):
        parts = [hf_loss(model, b) for b in group]
        for part in parts:
            (part / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        want_losses.append(float(torch.stack(parts).detach().mean()))
    want = model.state_dict()

    model = transformers_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = accel.prepare(model, optimizer, hf_loss, backend=backend, accum=2, quiet=True)
    on_device = list(engine.loader(batches))
    handles = [engine.step_micro_batches(g) for g in (on_device[:2], on_device[2:])]
    assert [r.loss for r in engine.fetch(handles)] == pytest.approx(want_losses, rel=1e-5)
    got = engine.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


def nested_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, extra = batch  # (tensor, {"scale": ..., "labels": ...}): a dict inside a tuple
    return nn.functional.cross_entropy(model(inputs * extra["scale"][:, None]), extra["labels"])


@pytest.mark.parametrize("backend", INSTALLED)
def test_nested_micro_batches_reach_the_loss_as_the_loader_gave_them(backend):
    """step_micro_batches hands the loss each micro-batch in its own structure, a dict inside
    a tuple here (xla aborted the process on it, jax and eager failed), and takes the step
    `step` takes on the whole batch with accum=2."""
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 3, (8,), generator=g)
    extra = {"scale": torch.rand(8, generator=g), "labels": labels}
    batch = (torch.randn(8, 6, generator=g), extra)
    halves = [(batch[0][i : i + 4], {k: v[i : i + 4] for k, v in batch[1].items()}) for i in (0, 4)]
    results = []
    for split in (False, True):
        model = mlp()
        engine = accel.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.5), nested_loss, backend=backend,
            accum=2, quiet=True,
        )  # fmt: skip
        if split:
            handle = engine.step_micro_batches(list(engine.loader(halves)))
        else:
            handle = engine.step(*next(iter(engine.loader([batch]))))
        results.append((engine.fetch([handle])[0].loss, engine.state_dict()))
    (loss, weights), (split_loss, split_weights) = results
    assert split_loss == pytest.approx(loss, rel=1e-6)
    for name, value in weights.items():
        torch.testing.assert_close(split_weights[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("backend", INSTALLED)
def test_engine_model_is_called_as_the_model_and_returns_its_output_class(backend):
    """`engine.model(pixel_values=x, output_hidden_states=True)`, as a transformers script
    evaluates: keywords and flags reach the model, and its ModelOutput comes back with
    `.logits` and `.hidden_states`, eager's values on every backend."""
    model = transformers_model("vit")
    images = hf_batches("vit", (4,))[0]["pixel_values"]
    with torch.no_grad():
        want = model.eval()(pixel_values=images, output_hidden_states=True)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = accel.prepare(model, optimizer, hf_loss, backend=backend, quiet=True)
    out = engine.model(pixel_values=images, output_hidden_states=True)
    assert type(out) is type(want) and out.logits.device == images.device
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    assert len(out.hidden_states) == len(want.hidden_states) == 3
    torch.testing.assert_close(out.hidden_states[-1], want.hidden_states[-1], rtol=1e-4, atol=1e-5)
    assert type(engine.model(images)) is type(want)  # by position too


def test_the_process_helpers_on_two_processes(tmp_path):
    """Two processes (gloo), as torchrun starts them: the main one known before prepare, its
    block run first, and each sample's index gathered once, in the dataset's order, though
    the DistributedSampler padded the last batch (11 samples over 2 replicas)."""
    script_ranks(2, "tests.api_processes", str(tmp_path), logs=tmp_path / "logs")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["main_before_prepare"] is True
    assert result["order"] == ["0", "1"]
    assert result["indices"] == list(range(11))


@pytest.mark.parametrize("backend", INSTALLED)
def test_the_process_helpers_in_one_process(backend, monkeypatch):
    model = mlp()
    engine = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                           backend=backend, quiet=True)  # fmt: skip
    ran = []
    with engine.main_process_first():
        ran.append(engine.is_main)
    engine.wait_for_everyone()
    values = torch.arange(6.0)
    assert ran == [True] and torch.equal(engine.gather_for_metrics(values), values)
    monkeypatch.setenv("RANK", "1")
    assert not accel.is_main_process()


def test_skip_first_batches_loads_none_of_them_and_keeps_the_epochs_order():
    """A resumed epoch's loader: the batches after the first 3, in the order the seeded
    epoch deals them, none of the skipped ones loaded."""
    loaded = []

    class Recorded(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> torch.Tensor:
            loaded.append(i)
            return torch.tensor(i)

    sampler = torch.utils.data.DistributedSampler(Recorded(), num_replicas=1, rank=0, seed=4)
    sampler.set_epoch(2)
    loader = torch.utils.data.DataLoader(Recorded(), batch_size=4, sampler=sampler)
    whole = [b.tolist() for b in loader]
    loaded.clear()
    rest = [b.tolist() for b in accel.skip_first_batches(loader, 3)]
    assert rest == whole[3:]
    assert sorted(loaded) == sorted(i for b in whole[3:] for i in b)
