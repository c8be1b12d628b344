"""The public API (accel.prepare) on every backend: a model of the user's own, the optimizers
and their translation to optax, the command line's losses, checkpoints across backends and
with the command line, and each refusal as one line."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import accel
from accel.backends.runner import Runner
from accel.cli.checkpoints import latest_checkpoint
from accel.cli.data.loaders import build_train_loader
from accel.cli.job import LRSchedule, param_groups, parameter_settings
from accel.cli.models.factory import create_model
from accel.cli.task import classifier_loss
from accel.cli.train import Trainer, host_tuple, seed_everything
from tests.helpers import (
    HAS_XLA,
    LR,
    Net,
    four_tensor_run,
    grouped,
    job_backend,
    micro_config,
    run_python,
    steps_reading_nothing,
)
from tests.helpers import (
    api_loss_fn as loss_fn,
)
from tests.helpers import (
    api_metric_fn as metric_fn,
)
from tests.helpers import (
    colour_batches as batches,
)

BACKENDS = ["eager", "compile", "xla", "jax"] if HAS_XLA else ["eager", "compile", "jax"]
PARITY = {"rel": 1e-4, "abs": 1e-5}  # fp32 across compilers: the backends' parity tests' bound
SLOW = pytest.mark.slow  # training on every backend: the full suite (refusals stay in the fast)


def train(backend: str, kind: str, steps: int = 5, **options) -> tuple[list[float], dict]:
    """A user's script: losses and the final weights by name."""
    torch.manual_seed(0)
    model = Net()
    optimizer = grouped(model, kind)
    schedule = lambda step: LR[kind] * 0.8**step  # noqa: E731
    engine = accel.prepare(
        model, optimizer, loss_fn, backend=backend, schedule=schedule, quiet=True, **options
    )
    handles = [engine.step(*b) for b in engine.loader(batches(steps))]
    losses = [r.loss for r in engine.fetch(handles)]
    return losses, engine.state_dict()


_reference: dict = {}


def reference(kind: str) -> tuple[list[float], dict]:
    if kind not in _reference:
        _reference[kind] = train("eager", kind, clip_grad=1.0)
    return _reference[kind]


@SLOW
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_users_own_module_trains_alike_on_every_backend(backend, kind):
    losses, _ = train(backend, kind, clip_grad=1.0)
    want, _ = reference(kind)
    assert losses == pytest.approx(want, **PARITY)
    assert losses[-1] < losses[0]


def test_an_lr_scheduler_sets_each_groups_rate():
    model = Net()
    optimizer = grouped(model, "adamw")
    decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine = accel.prepare(model, optimizer, loss_fn, schedule=decay, quiet=True)
    assert engine.rates(0) == [1e-2, 1e-2, 2e-2]
    assert engine.rates(2) == pytest.approx([2.5e-3, 2.5e-3, 5e-3])


@SLOW
@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_accumulation_and_the_ema_and_evaluation(backend):
    """accum=2 gives the whole batch's step; the EMA's weights evaluate apart."""
    torch.manual_seed(0)
    whole, _ = train(backend, "adamw")
    split, _ = train(backend, "adamw", accum=2)
    assert split == pytest.approx(whole, **PARITY)
    model = Net()
    engine = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=backend, ema=0.5)
    engine.fetch([engine.step(*b) for b in batches()])
    ema = engine.evaluate(batches(), metric_fn, ema=True)
    averaged, trained = engine.state_dict(ema=True), engine.state_dict()
    assert not torch.equal(averaged["head.weight"], trained["head.weight"])
    model = Net()  # the EMA's weights as a model's own: the same sums
    model.load_state_dict(averaged)
    other = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=backend, quiet=True)
    assert other.evaluate(batches(), metric_fn) == ema
    assert ema["count"] == 80


def test_batches_split_beforehand_take_the_same_step_as_accum():
    """step_micro_batches (the command line loop's call) on halves split by the caller is
    step(batch) with accum=2: the same losses, weights and learning rates."""
    results = []
    for presplit in (False, True):
        torch.manual_seed(0)
        model = Net()
        engine = accel.prepare(
            model, grouped(model, "sgd"), loss_fn, accum=2, schedule=lambda s: 0.1 / (s + 1),
            quiet=True,
        )  # fmt: skip
        for batch in engine.loader(batches(3)):
            halves = [tuple(t[i * 8 : (i + 1) * 8] for t in batch) for i in range(2)]
            handle = engine.step_micro_batches(halves) if presplit else engine.step(*batch)
            results.append((engine.fetch([handle])[0].loss, engine.lr))
        weights = engine.state_dict()
        results.append(weights["head.weight"])
    plain, split = results[:4], results[4:]
    assert split[:3] == plain[:3]
    assert torch.equal(split[3], plain[3])
    assert plain[2][1] == pytest.approx([0.1 / 3, 0.1 / 3, 0.2 / 3])  # each group's own ratio
    assert engine.steps_done == 3
    assert engine.any_rank(True) and not engine.any_rank(False)  # one process: the flag


@SLOW
def test_the_api_gives_the_command_line_losses(tmp_path):
    """The Trainer's own job rebuilt from the same parts through accel.prepare."""
    cfg = micro_config(tmp_path, steps=4)
    cli = Trainer(cfg).train()["losses"]

    seed_everything(cfg.seed)
    model = create_model(cfg.model, seed=cfg.seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = param_groups(named, parameter_settings(model, cfg.optim))
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas)
    seed_everything(cfg.seed)
    loader = build_train_loader(cfg.data, 32, cfg.batch_size, (0, 1), cfg.seed, 10)
    schedule = LRSchedule(cfg.optim, 4, len(loader.batch_sampler))
    engine = accel.prepare(
        model, optimizer, classifier_loss, schedule=schedule, clip_grad=cfg.accel.step.clip_grad
    )
    handles = [engine.step(*host_tuple(b)) for _, b in zip(range(4), loader, strict=False)]
    assert [r.loss for r in engine.fetch(handles)] == pytest.approx(cli, rel=1e-6)


@SLOW
@pytest.mark.parametrize(("saver", "loader"), [("jax", "eager"), ("eager", "xla")])
def test_a_checkpoint_saved_on_one_backend_loads_on_another(tmp_path, saver, loader):
    if "xla" in (saver, loader) and not HAS_XLA:
        pytest.skip("torch_xla is not installed")
    torch.manual_seed(0)
    model = Net()
    first = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=saver, ema=0.9)
    first.fetch([first.step(*b) for b in batches(3)])
    path = first.save(tmp_path / "api.pt")
    saved = first.evaluate(batches(2, seed=1), metric_fn)
    model = Net()
    second = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=loader, ema=0.9)
    second.load(path)
    assert second.steps_done == 3
    assert second.evaluate(batches(2, seed=1), metric_fn) == saved
    # The optimizer state came along: two more steps go the same way on both.
    after = [e.fetch([e.step(*b) for b in batches(2, seed=2)]) for e in (first, second)]
    assert [r.loss for r in after[1]] == pytest.approx([r.loss for r in after[0]], **PARITY)


@SLOW
def test_the_command_line_and_the_api_load_each_others_checkpoints(tmp_path):
    cfg = micro_config(tmp_path, steps=2)
    Trainer(cfg).train()
    cli_checkpoint = latest_checkpoint(cfg.run_dir())

    model = create_model(cfg.model, seed=cfg.seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(named, parameter_settings(model, cfg.optim)))
    engine = accel.prepare(model, optimizer, classifier_loss, backend="jax", quiet=True)
    engine.load(cli_checkpoint)
    assert engine.steps_done == 2
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    engine.fetch([engine.step(images, torch.softmax(torch.randn(8, 10), -1))])
    api_checkpoint = engine.save(tmp_path / "api" / "step_3.pt")

    resumed = micro_config(tmp_path, steps=5, resume=str(api_checkpoint), run_name="r")
    result = Trainer(resumed).train()  # steps 4 and 5 of 5
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])


# --- refusals: one line each, before any weight changes --------------------------------------
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "AdamW with amsgrad=True"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "SGD dampening"),
        (lambda p: torch.optim.ASGD(p), r"no optax translation of torch\.optim\.ASGD .*use the "
         "eager, compile or xla backend"),
        (lambda p: torch.optim.Rprop(p), r"no optax translation of torch\.optim\.Rprop"),
    ],
)  # fmt: skip
def test_an_optimizer_jax_cannot_translate_is_refused_in_one_line(make, match):
    model = Net()
    with pytest.raises(accel.AccelError, match=match) as err:
        accel.prepare(model, make(model.parameters()), loss_fn, backend="jax", quiet=True)
    assert "\n" not in str(err.value)


def host_reading_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    loss = loss_fn(model, batch)
    print(f"loss {loss.item()}")  # the line the refusal names
    return loss


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("xla", "jax")])
def test_a_loss_that_reads_a_value_on_the_host_is_refused_with_its_line(backend):
    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = accel.prepare(model, grouped(model, "sgd"), host_reading_loss, backend=backend)
    with pytest.raises(accel.AccelError) as err:
        engine.step(*batches(1)[0])
    line = str(err.value)
    assert "\n" not in line and f"{Path(__file__).name}:" in line
    assert 'print(f"loss {loss.item()}")' in line
    state = engine.state_dict()
    assert all(torch.equal(state[n].cpu(), before[n]) for n in before)  # no weight changed


def test_an_op_torchax_cannot_lower_is_named(monkeypatch):
    import torchax

    # An op accel does not lower itself (its GELU it does), and a model of its own: a step kept
    # by an earlier test's engine would load without tracing (accel/backends/jax/saved.py).
    monkeypatch.delitem(torchax.default_env()._ops, torch.ops.aten.mean)
    model = Net(classes=3)
    engine = accel.prepare(model, grouped(model, "sgd"), loss_fn, backend="jax", quiet=True)
    with pytest.raises(accel.AccelError, match=r"Net: .*aten::mean"):
        engine.step(*batches(1)[0])


@pytest.mark.jax
def test_a_backend_named_in_the_environment_is_used(monkeypatch):
    monkeypatch.setenv("ACCEL_BACKEND", "jax")
    model = Net()
    assert accel.prepare(model, grouped(model, "sgd"), loss_fn, quiet=True).backend == "jax"
    monkeypatch.setenv("ACCEL_BACKEND", "tpu")
    with pytest.raises(accel.AccelError, match="ACCEL_BACKEND must be one of"):
        accel.prepare(model, grouped(model, "sgd"), loss_fn, quiet=True)


def test_an_optimizer_over_other_parameters_is_refused():
    optimizer = torch.optim.AdamW(Net().parameters())
    with pytest.raises(accel.AccelError, match="not the model's"):
        accel.prepare(Net(), optimizer, loss_fn, quiet=True)


@SLOW
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_apis_step_reads_nothing_back_to_the_host(backend):
    """After the warm-up, steps queue their work and return: no value crosses to the host until
    fetch (jax: a device-to-host transfer raises)."""
    torch.manual_seed(0)
    model = Net()
    engine = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=backend, quiet=True)
    handles = steps_reading_nothing(engine, backend, list(engine.loader(batches(4))))
    assert all(r.applied for r in engine.fetch(handles))


@pytest.mark.jax
def test_what_a_backend_does_not_support_is_refused_before_it_starts():
    model = Net()
    with pytest.raises(accel.AccelError, match=r"amp_dtype=.float16. is not supported by the jax"):
        accel.prepare(model, grouped(model, "sgd"), loss_fn, backend="jax", amp="O1",
                      amp_dtype="float16", quiet=True)  # fmt: skip


def test_a_shard_mode_the_backend_lacks_is_refused_in_one_line():
    model = Net()
    with pytest.raises(
        accel.AccelError, match="shard must be one of none, full, grad_op, got 'half'"
    ):
        accel.prepare(model, grouped(model, "sgd"), loss_fn, shard="half", quiet=True)
    if HAS_XLA:  # FSDPv2 splits the weights too: xla has no grad_op
        with pytest.raises(accel.AccelError, match=r"shard=.grad_op. is not supported by the xla"):
            accel.prepare(model, grouped(model, "sgd"), loss_fn, backend="xla", shard="grad_op",
                          quiet=True)  # fmt: skip


# --- the recompile limit: one policy, in the Engine, for every backend that compiles ---------
RECOMPILE_LINE = (
    "1 graphs compiled after warm-up (limit 0): the batch shapes changed between steps "
    "([4, 3, 8, 8] [4], [8, 3, 8, 8] [8]); keep them fixed (a DataLoader's drop_last=True, "
    "padded and masked evaluation batches)"
)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("compile", "xla", "jax")])
def test_the_recompile_limit_stops_every_compiling_backend_alike_in_one_line(backend, capsys):
    """The Engine counts each backend's step compiles from warm-up on: none before it (the
    warm-up's own compiles are not recompiles), the same line past the limit."""
    from accel.backends.base import RecompileError
    from accel.config import BackendConfig, CompilerConfig

    torch.manual_seed(0)
    model = Net()
    config = BackendConfig(backend, compiler=CompilerConfig(max_recompiles=0))
    engine = accel.prepare(model, grouped(model, "sgd"), loss_fn, config=config, quiet=True)
    data = batches(5, size=8)
    for batch in data[:3]:  # xla: the first step's graph, its fetch's, the second step's
        engine.fetch([engine.step(*batch)])
    engine.mark_warmup_done()
    engine.fetch([engine.step(*data[3])])  # warm: no compile
    with pytest.raises(RecompileError) as err:
        for size in (4, 2, 1):  # three new shapes: the first stops the run
            engine.step(*(t[:size] for t in data[4]))
    if backend == "compile":  # dynamo compiles a new shape as one frame or more, and may take
        # a size or two on a graph it made dynamic (in a process where the same code compiled
        # before): the line, from the shapes it names on
        line = str(err.value)
        assert " graphs compiled after warm-up (limit 0): the batch shapes changed " in line
        assert line.endswith("[8, 3, 8, 8] [8]); " + RECOMPILE_LINE.split("[8]); ")[1])
        return
    assert str(err.value) == RECOMPILE_LINE
    assert "compiled again" not in capsys.readouterr().err  # the error, not a notice


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_method_takes_the_contracts_parameters_and_defaults(backend, tmp_path):
    """Every method of the contract (backends/runner.py's Runner), whichever part of a backend
    does it, takes what the contract promises, defaults included."""
    built = job_backend(micro_config(tmp_path, backend=backend))
    for name, contract in vars(Runner).items():
        if name.startswith("_") or not inspect.isfunction(contract):
            continue
        promised = list(inspect.signature(contract).parameters.values())[1:]  # after self
        given = list(inspect.signature(getattr(built, name)).parameters.values())
        assert [p.default for p in given] == [p.default for p in promised], name


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("compile", "xla", "jax")])
def test_a_second_engine_in_the_process_counts_its_own_compiles(backend):
    """The compilers count per process; an Engine's stats count what compiled since it
    started, so the second of two runs in one process (a notebook's) is not charged the
    first's graphs."""
    counts = []
    for _ in range(2):
        torch.compiler.reset()  # dynamo's code cache is the process's: each run compiles
        torch.manual_seed(0)
        model = Net()
        engine = accel.prepare(model, grouped(model, "sgd"), loss_fn, backend=backend, quiet=True)
        engine.fetch([engine.step(*b) for b in batches(2, size=8)])
        counts.append(engine.stats().graphs_compiled)
    assert counts[1] <= counts[0]  # its own graphs, not the first's added to them


# --- a batch is any tuple of tensors, of any rank, on every backend -----------------------------
FOUR_TENSORS = [
    [([8, 3, 8, 8], "torch.float32"), ([8, 5], "torch.float32"), ([8], "torch.float32"),
     ([8, 8, 8], "torch.float32")]
] * 3  # fmt: skip


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("eager", "xla", "jax")])
def test_the_loader_keeps_every_tensor_of_a_batch_whatever_its_rank(backend):
    kept, losses, _ = four_tensor_run(backend)
    assert kept == FOUR_TENSORS
    if backend == "eager":
        assert losses[-1] < losses[0]
    else:
        assert losses == pytest.approx(four_tensor_run("eager")[1], **PARITY)


@pytest.mark.xla
def test_an_xla_mesh_splits_every_tensor_of_a_batch_along_its_first_axis():
    """Two devices (a count XLA reads as it starts: a process of its own)."""
    if not HAS_XLA:
        pytest.skip("torch_xla is not installed")
    code = (
        "import json; from tests.helpers import four_tensor_run; "
        "print(json.dumps(four_tensor_run('xla', devices=2)))"
    )
    done = run_python(code, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    kept, losses, split = json.loads(done.stdout.strip().splitlines()[-1])
    assert [[tuple(s) for s in batch] for batch in kept] == FOUR_TENSORS
    assert split == ["{devices=[2,1,1,1]0,1}", "{devices=[2,1]0,1}", "{devices=[2]0,1}",
                     "{devices=[2,1,1]0,1}"]  # fmt: skip
    assert losses == pytest.approx(four_tensor_run("eager")[1], **PARITY)


# --- load puts the saved learning rates back into the user's optimizer ------------------------
def decayed_run(backend: str, steps: range, path: Path, accel_steps_it: bool) -> list[float]:
    """SGD at 0.05 with a StepLR (x0.1 every 2 steps), stepped by the script once a step (or by
    accel: schedule=scheduler); resumed from `path` where `steps` does not start at 0, saved
    to it after the steps otherwise. The steps' losses."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    schedule = scheduler if accel_steps_it else None
    engine = accel.prepare(
        model, optimizer, loss_fn, backend=backend, schedule=schedule, quiet=True
    )
    if steps.start:
        extra = engine.load(path)
        scheduler.load_state_dict(extra["scheduler"])
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-3])
    data = batches(steps.stop)
    losses = []
    for step in steps:
        losses.append(engine.fetch([engine.step(*data[step])])[0].loss)
        if not accel_steps_it:
            scheduler.step()
    if not steps.start:
        engine.save(path, extra={"scheduler": scheduler.state_dict()})
    return losses


@pytest.mark.parametrize(
    ("backend", "accel_steps_it"),
    [(b, False) for b in BACKENDS if b in ("eager", "xla", "jax")] + [("eager", True)],
)
def test_a_resumed_run_takes_the_saved_learning_rates(tmp_path, backend, accel_steps_it):
    """Saved at 0.005 after a decay, loaded into a fresh optimizer and scheduler: the rates are
    the saved ones, and the steps' losses an uninterrupted run's."""
    whole = decayed_run(backend, range(6), tmp_path / "whole.pt", accel_steps_it)
    decayed_run(backend, range(3), tmp_path / "half.pt", accel_steps_it)
    resumed = decayed_run(backend, range(3, 6), tmp_path / "half.pt", accel_steps_it)
    assert resumed == pytest.approx(whole[3:], **PARITY)


@pytest.mark.parametrize("backend", BACKENDS)
def test_live_state_is_the_trained_state_in_the_backends_own_tensors(backend):
    model = Net()
    engine = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=backend, quiet=True)
    engine.fetch([engine.step(*b) for b in batches(2)])
    live, host = engine.live_state(), engine.state_dict()
    assert set(host) <= set(live["model"]) and set(live["optim"]) <= set(live["model"])
    weight = live["model"]["head.weight"]
    assert tuple(weight.shape) == tuple(host["head.weight"].shape)
    assert {"exp_avg", "exp_avg_sq"} <= set(live["optim"]["head.weight"])
    if backend == "jax":  # the array the step updates, with its sharding
        import jax

        assert isinstance(weight, jax.Array) and weight.sharding is not None
    else:
        assert isinstance(weight, torch.Tensor)
        assert weight.device.type == ("xla" if backend == "xla" else "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_step_lowers_on_jax_and_is_refused_in_one_line_elsewhere(backend):
    model = Net()
    engine = accel.prepare(model, grouped(model, "adamw"), loss_fn, backend=backend, quiet=True)
    batch = batches(1)[0]
    if backend != "jax":
        refusal = f"the {backend} backend .*: no program to lower"
        with pytest.raises(accel.AccelError, match=refusal):
            engine.lowered_step(*batch)
        return
    before = engine.state_dict()
    text = engine.lowered_step(*batch).as_text()
    assert "stablehlo.dot_general" in text  # the layers' matmuls, forward and backward
    assert engine.steps_done == 0  # lowered, not run
    assert all(torch.equal(before[n], v) for n, v in engine.state_dict().items())


def remat_losses(backend: str, remat: str) -> list[float]:
    """Three steps of a 2-block timm ViT with stochastic depth (its draws too must repeat)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
        drop_path_rate=0.1,
    )  # fmt: skip
    engine = accel.prepare(
        model, torch.optim.AdamW(model.parameters(), 1e-3), loss_fn, backend=backend,
        remat=remat, quiet=True,
    )  # fmt: skip
    data = [(torch.randn(8, 3, 32, 32), torch.randint(0, 5, (8,))) for _ in range(3)]
    return [r.loss for r in engine.fetch([engine.step(*b) for b in data])]


@SLOW
@pytest.mark.parametrize("remat", ["dots", "full"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"])
def test_remat_trains_the_losses_of_keeping_every_activation(backend, remat):
    assert remat_losses(backend, remat) == pytest.approx(remat_losses(backend, "none"), **PARITY)


@pytest.mark.xla
def test_remat_is_refused_in_one_line_where_the_backend_lacks_it():
    model = Net()
    with pytest.raises(accel.AccelError, match="remat='full' is not supported by the xla"):
        accel.prepare(model, grouped(model, "sgd"), loss_fn, backend="xla", remat="full",
                      quiet=True)  # fmt: skip
    with pytest.raises(accel.AccelError, match="remat must be one of none, dots, full"):
        accel.prepare(model, grouped(model, "sgd"), loss_fn, remat=True, quiet=True)  # type: ignore[arg-type]
    with pytest.raises(accel.AccelError, match="Net repeats no block"):
        accel.prepare(model, grouped(model, "sgd"), loss_fn, backend="eager", remat="dots",
                      quiet=True)  # fmt: skip
