"""Every backend x AMP level x --kernel-opt where the flag changes the step, through the real
training loop with --model_ema: finite losses, and inside the step the dtypes the level promises
(matmul inputs and outputs, weights, optimizer; the EMA in fp32 at every level)."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from accel.backends import backend_module
from accel.cli.train import Trainer
from tests.helpers import micro_config

pytestmark = pytest.mark.slow  # 30 cases, each compiled; every backend's one run is test_finetune's

LEVELS = ("O0", "O1", "O2", "O3")
LOW = {"O0": "f32", "O1": "bf16", "O2": "bf16", "O3": "bf16"}
MODELS = {
    "eager": ("vit_micro", "swin_micro"),
    "compile": ("vit_micro",),
    "xla": ("vit_micro", "swin_micro"),
    "jax": ("vit_micro", "swin_micro"),
}
OPTS = ((False, "plain"), (True, "kernel_opt"))
# vit_micro: every level, and again with --kernel-opt where the flag changes the step: compile
# (inductor's max-autotune) at the two ends of precision, float32 (O0) and all bfloat16 (O3)
# (its templates are the same whatever the level: the other two took 17 s of the suite), xla
# (syncfree AdamW) below O3. On eager and jax it changes nothing (their Supports tables say so);
# swin_micro's case below takes the flag.
KERNEL_OPT_LEVELS = {"eager": (), "compile": ("O0", "O3"), "xla": ("O0", "O1", "O2"), "jax": ()}
# swin_micro (window attention, its relative-position bias and shift mask, patch merging) adds
# the ops ViT lacks, at O0 (the parity test's reference), O1 with --kernel-opt and O3 (the lowest
# precision).
SWIN = (("O0", OPTS[0]), ("O1", OPTS[1]), ("O3", OPTS[0]))


def _grid(backend: str, model: str) -> tuple:
    if model == "vit_micro":
        kernel_opt = tuple((level, OPTS[1]) for level in KERNEL_OPT_LEVELS[backend])
        return tuple((level, OPTS[0]) for level in LEVELS) + kernel_opt
    return SWIN


CASES = [
    pytest.param(
        backend,
        model,
        level,
        kernel_opt,
        id=f"{backend}-{model}-{level}-{opt}",
        marks=[pytest.mark.xla] if backend == "xla" else [],
    )
    for backend, models in MODELS.items()
    for model in models
    for level, (kernel_opt, opt) in _grid(backend, model)
]


def test_kernel_opt_is_left_out_only_where_it_changes_nothing():
    for backend, levels in KERNEL_OPT_LEVELS.items():
        note = backend_module(backend, check=False).SUPPORTS.kernel_opt  # installed or not
        assert (len(levels) == 0) == note.startswith("nothing more"), backend


# torch and JAX names of the dtypes, as the stablehlo text writes them
SHORT = {"torch.float32": "f32", "torch.bfloat16": "bf16", "float32": "f32", "bfloat16": "bf16"}


class LinearWatch:
    """While the run trains: the output dtype of every nn.Linear (a dict keyed by module that
    stops growing after the first step, so that dynamo's guards on it hold), and with `count`
    (eager only: a count changes every step) each one's calls with gradients on, which
    recomputation in the backward doubles. torch's global module hook, its public API."""

    def __init__(self, count: bool):
        self.dtypes: dict[int, torch.dtype] = {}
        self.calls: dict[int, int] = {}
        self.count = count

    def __enter__(self) -> LinearWatch:
        self.handle = torch.nn.modules.module.register_module_forward_hook(self.hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def hook(self, module: torch.nn.Module, _inputs: tuple, out) -> None:
        if isinstance(module, torch.nn.Linear) and isinstance(out, torch.Tensor):
            self.dtypes[id(module)] = out.dtype
            if self.count and torch.is_grad_enabled():
                self.calls[id(module)] = self.calls.get(id(module), 0) + 1


def _lowered_step(engine, batch: int) -> str:
    """The jax step as StableHLO text with its locations (the ops' jax names), for the shapes
    the case trained on."""
    images = torch.zeros((batch, 3, 32, 32), dtype=torch.uint8)
    targets = torch.full((batch, 10), 0.1)
    return engine.lowered_step(images, targets).as_text(debug_info=True)


def _dot_operand_dtypes(text: str) -> set[str]:
    """Element types of the operands of the layers' matmuls and convolutions (and of their
    gradients) in a lowered step. Attention's own batched dots are left out: XLA's attention
    takes its softmax in fp32 by design, and on GPU cuDNN runs it fused."""
    ops = [
        m.group(1)
        for line in text.splitlines()
        if "batching_dims" not in line
        and (m := re.search(r"stablehlo\.(?:dot_general|convolution).*?: \((.*?)\) ->", line))
    ]
    assert ops, "no dot or convolution found in the lowered step"
    return {m for types in ops for m in re.findall(r"x(bf16|f16|f32)>", types)}


@pytest.fixture(scope="session")
def train_case(tmp_path_factory):
    """train_case(backend, model, level, kernel_opt, remat="none"): five steps of the case; each
    one trains once per session, whichever test asks first."""

    @functools.cache
    def train(backend: str, model: str, level: str, kernel_opt: bool, remat: str = "none"):
        return _train_case(tmp_path_factory.mktemp(f"amp-{backend}"), backend, model, level,
                           kernel_opt, remat)  # fmt: skip

    return train


def _train_case(out: Path, backend: str, model: str, level: str, kernel_opt: bool, remat: str):
    cfg = micro_config(
        out,
        backend=backend,
        model=model,
        amp_level=level,
        kernel_opt=kernel_opt,
        remat=remat,
        model_ema=True,
        model_ema_decay=0.5,
    )
    trainer = Trainer(cfg)
    with LinearWatch(count=backend == "eager") as watch:
        summary = trainer.train()
    records = [json.loads(line) for line in (cfg.run_dir() / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "step"]
    common = {
        "losses": summary["losses"],
        "compiles_after_warmup": summary["compiles_after_warmup"],
        # every step record carries its timing, read at the same fetch as its loss
        "timed": len(steps) == 5
        and all(r["step_time_s"] > 0 and r["images_per_sec"] > 0 for r in steps),
    }
    engine = trainer.engine
    live = engine.live_state()  # the backend's own tensors, as it trains them
    params = [n for n in live["model"] if n in live["optim"]]  # the weights, not the buffers
    weights = {SHORT[str(live["model"][n].dtype)] for n in params}
    ema = list(live["ema"].values())
    common["ema"] = {SHORT[str(e.dtype)] for e in ema}
    common["weights"] = weights
    if backend == "jax":
        import jax

        text = _lowered_step(engine, cfg.batch_size)
        shapes = engine.stats().details["attention_shapes"].values()
        return {
            **common,
            "ema_finite": all(bool(jax.numpy.isfinite(a).all()) for a in ema),
            "step": _dot_operand_dtypes(text),
            "optimizer": weights,  # optax updates the stored weights themselves
            "attention_calls": sum(shape["calls"] for shape in shapes),
            # jax.checkpoint's name for what it runs again (an optimization barrier alone is not
            # its mark: XLA's attention holds its probabilities behind one)
            "recomputes": "rematted_computation" in text,
        }
    masters = live.get("masters", {})  # the optimizer's fp32 copies, where it keeps them (O2)
    return {
        **common,
        # On the host: a check on the XLA device would count as an op run outside the graph.
        "ema_finite": all(bool(e.cpu().isfinite().all()) for e in ema),
        "step": {SHORT[str(d)] for d in watch.dtypes.values()},
        "optimizer": {SHORT[str(masters.get(n, live["model"][n]).dtype)] for n in params},
        # each layer run again in the backward: more calls with gradients than steps
        "recomputes": any(calls > len(summary["losses"]) for calls in watch.calls.values()),
    }


@pytest.mark.parametrize(("backend", "model", "level", "kernel_opt"), CASES)
def test_each_level_trains_in_the_dtypes_it_promises(train_case, backend, model, level, kernel_opt):
    case = train_case(backend, model, level, kernel_opt)
    assert len(case["losses"]) == 5 and all(math.isfinite(x) for x in case["losses"])
    assert case["compiles_after_warmup"] == 0
    assert case["timed"]
    assert case["step"] == {LOW[level]}, "dtype of the step's matmuls"
    # The optimizer keeps fp32 weights below O3; jax computes from them directly (O1/O2 cast
    # inside the step), the torch backends hold a bf16 model at O2 and O3.
    assert case["optimizer"] == {"bf16" if level == "O3" else "f32"}
    model_low = level == "O3" or (level == "O2" and backend != "jax")
    assert case["weights"] == {"bf16" if model_low else "f32"}
    assert case["ema"] == {"f32"} and case["ema_finite"]
    if backend == "jax":  # attention always traced through jax.nn.dot_product_attention
        assert case["attention_calls"]


def test_jax_o1_tracks_eager_o1(train_case):
    jax_losses = train_case("jax", "vit_micro", "O1", False)["losses"]
    eager_losses = train_case("eager", "vit_micro", "O1", False)["losses"]
    assert jax_losses == pytest.approx(eager_losses, rel=2e-2)


@pytest.mark.parametrize("backend", ["compile", pytest.param("xla", marks=pytest.mark.xla), "jax"])
def test_o0_first_five_losses_equal_eager(train_case, backend):
    for model in MODELS[backend]:
        got = train_case(backend, model, "O0", False)["losses"]
        assert got == pytest.approx(train_case("eager", model, "O0", False)["losses"], rel=1e-3)


@pytest.mark.parametrize("remat", ["dots", "full"])
@pytest.mark.parametrize("backend", ["eager", "jax"])
def test_remat_recomputes_and_trains_alike(train_case, backend, remat):
    plain = train_case(backend, "vit_micro", "O0", False)
    recomputed = train_case(backend, "vit_micro", "O0", False, remat=remat)
    assert recomputed["recomputes"] and not plain["recomputes"]
    assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-5)
