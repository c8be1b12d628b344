"""One configuration: prepare's keywords build accel.config's BackendConfig (`config=` the base,
each keyword given sets its field), and accel.settle checks and settles it for prepare and the
command line alike."""

from __future__ import annotations

import pytest
import torch

import accel
from accel.config import BackendConfig, MeshConfig, StepConfig
from accel.settings import DEFAULT_EMA_DECAY, settle, with_keywords


def _engine(**options) -> accel.Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    return accel.prepare(model, optimizer, loss_fn, quiet=True, **options)


def _trained_ema(engine: accel.Engine) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        images = torch.randn(8, 4, generator=generator)
        engine.fetch([engine.step(images, torch.randint(0, 3, (8,), generator=generator))])
    return engine.state_dict(ema=True)


def test_config_with_ema_keeps_the_ema_the_keyword_asks_for():
    """`config=` with `ema=` trains the EMA the keyword names, as the keywords alone do (it
    used to train none, silently)."""
    by_keywords = _trained_ema(_engine(backend="eager", amp="O0", ema=0.5))
    by_config = _trained_ema(_engine(config=BackendConfig("eager", StepConfig(amp="O0")), ema=0.5))
    in_config = _trained_ema(_engine(config=BackendConfig("eager", StepConfig(ema=0.5))))
    assert by_keywords.keys() == by_config.keys() == in_config.keys()
    for name, value in by_keywords.items():
        assert torch.equal(value, by_config[name]) and torch.equal(value, in_config[name]), name
    plain = _engine(backend="eager")
    with pytest.raises(accel.AccelError, match="no EMA weights kept"):
        plain.state_dict(ema=True)


def test_a_keyword_given_sets_its_field_over_the_config_and_one_left_unset_keeps_it():
    base = BackendConfig("eager", StepConfig(amp="O1", clip_grad=1.0), MeshConfig(tp=2))
    merged = with_keywords(base, amp="O2", ema=0.9, devices=None, tp=None)
    assert (merged.step.amp, merged.step.ema, merged.step.clip_grad) == ("O2", 0.9, 1.0)
    assert merged.mesh.tp == 2 and merged.backend == "eager"
    assert with_keywords(None, backend="jax", seed=3) == BackendConfig("jax", StepConfig(seed=3))
    with pytest.raises(TypeError, match="not a setting of the config: dpi"):
        with_keywords(base, dpi=2)


def test_accel_devices_settles_the_devices_of_a_config_as_of_the_keywords():
    env = {"ACCEL_DEVICES": "3"}
    by_config = settle(BackendConfig("eager"), env)
    by_keywords = settle(with_keywords(None, backend="eager"), env)
    assert by_config.config == by_keywords.config
    assert by_config.config.mesh.devices == 3
    # a number given, in the config or as a keyword, is kept over the variable
    assert settle(BackendConfig("eager", mesh=MeshConfig(devices=2)), env).config.mesh.devices == 2
    assert settle(with_keywords(None, devices=2), env).config.mesh.devices == 2
    assert settle(BackendConfig("eager"), {}).config.mesh.devices == 1
    with pytest.raises(
        accel.AccelError, match="ACCEL_DEVICES must be a whole number of at least 1"
    ):
        settle(BackendConfig("eager"), {"ACCEL_DEVICES": "two"})


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (BackendConfig("eager", StepConfig(amp="O4")), "amp must be one of O0, O1, O2, O3"),  # type: ignore[arg-type]
        (BackendConfig("eager", StepConfig(ema=True)), f"{DEFAULT_EMA_DECAY} is timm's default"),
        (BackendConfig("eager", StepConfig(ema=1.0)), "ema is the EMA's decay in [0, 1)"),
        (BackendConfig("eager", StepConfig(accum=0)), "must be at least 1"),
        (BackendConfig("eager", mesh=MeshConfig(pp_schedule="zigzag")), "pp_schedule must be"),  # type: ignore[arg-type]
        (
            BackendConfig("eager", mesh=MeshConfig(pp=2, tp_head=2)),
            "pp= and tp_head= cannot be combined on the eager backend",
        ),
        (BackendConfig("tpu"), "unknown backend 'tpu'"),  # type: ignore[arg-type]
    ],
)
def test_each_bad_setting_is_refused_in_one_line_by_settle(config, needle):
    with pytest.raises(accel.AccelError) as caught:
        settle(config, {})
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_the_settled_config_says_why_its_backend_and_what_it_runs():
    assert BackendConfig().backend is None  # not settled yet: typed, not an empty name
    settled = accel.settle(BackendConfig(), {"ACCEL_BACKEND": "compile"})
    assert settled.backend == "compile"
    assert settled.config.backend == "compile" and settled.why == "ACCEL_BACKEND"
    assert settled.supports.replicas == "processes"
    assert settled.config.compiler.cache_dir  # the compile cache is settled too


def test_an_ema_function_is_compared_between_ranks_by_name():
    from accel.checks import described

    def decay(step: int) -> float:
        return 0.9

    assert described(decay).endswith(
        "test_an_ema_function_is_compared_between_ranks_by_name.<locals>.decay"
    )
    assert described(0.5) == 0.5


BAD_VARIABLES = [
    (
        {"ACCEL_BACKEND": "jaxx"},
        "ACCEL_BACKEND must be one of eager, compile, xla, jax, got 'jaxx'",
    ),
    ({"USE_ACCEL": "banana"}, "USE_ACCEL must be 0, 1, true or false, got 'banana'"),
    ({"ACCEL_DEVICES": "0"}, "ACCEL_DEVICES must be a whole number of at least 1, got '0'"),
]


@pytest.mark.parametrize(
    ("env", "line"), BAD_VARIABLES, ids=["ACCEL_BACKEND", "USE_ACCEL", "ACCEL_DEVICES"]
)
def test_a_bad_variable_is_one_line_raised_from_prepare_alone(env, line, monkeypatch):
    """The traceback a script sees holds its own call and prepare: none of accel's frames
    below it (settle, the backend registry) that say nothing to the user."""
    import traceback

    for name in ("ACCEL_BACKEND", "USE_ACCEL", "ACCEL_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(accel.AccelError) as raised:
        _engine()
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert [f.name for f in frames][1:] == ["_engine", "prepare"], frames
    assert str(raised.value) == line


SCRIPT = """\
import os, sys, traceback
import torch, accel
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for name, value in {cases}:
    os.environ[name] = value
    try:
        engine = accel.prepare(model, optimizer, lambda m, b: m(b[0]).pow(2).mean())
    except accel.AccelError:
        print(traceback.format_exc(), file=sys.stderr, end="--\\n")
    del os.environ[name]
os.environ["ACCEL_BACKEND"] = "jaxx"
engine = accel.prepare(model, optimizer, lambda m, b: m(b[0]).pow(2).mean())
"""


@pytest.mark.slow  # a script's process
def test_a_script_shows_its_own_line_and_prepare_only_for_each_bad_variable(tmp_path):
    """Each bad variable as a script's traceback shows it (caught and printed, then the last
    one uncaught, as Python prints it): the script's line, prepare's, the one line."""
    from tests.helpers import run_script

    cases = [next(iter(env.items())) for env, _ in BAD_VARIABLES]
    (tmp_path / "train.py").write_text(SCRIPT.format(cases=cases))
    result = run_script("train.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    shown = result.stderr.split("--\n")
    assert len(shown) == len(BAD_VARIABLES) + 1, result.stderr
    lines = [*(line for _, line in BAD_VARIABLES), BAD_VARIABLES[0][1]]
    for text, line in zip(shown, lines, strict=True):
        frames = [row.strip() for row in text.splitlines() if row.startswith("  File ")]
        assert len(frames) == 2, text
        assert "train.py" in frames[0] and "in prepare" in frames[1], text
        assert text.strip().splitlines()[-1] == f"accel.config.AccelError: {line}"


def test_closing_runs_every_step_and_an_error_in_the_with_block_is_the_one_raised():
    """engine.close() runs each of its steps once, in reverse, even past a failing one (whose
    error it raises after); a `with` block's own error is not hidden by closing after it."""
    from accel.api import Undo

    done: list[str] = []

    def fails() -> None:
        done.append("fails")
        raise RuntimeError("copy failed")

    undo = Undo()
    for step in (lambda: done.append("first"), fails, lambda: done.append("last")):
        undo.add(step)
    with pytest.raises(RuntimeError, match="copy failed"):
        undo()
    assert done == ["last", "fails", "first"]
    undo()  # once: nothing left to run
    assert done == ["last", "fails", "first"]

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, b: m(b[0]).pow(2).mean()  # noqa: E731
    engine = accel.prepare(model, optimizer, loss_fn, backend="eager", quiet=True)
    engine.on_close.add(fails)  # closing fails too, first of its steps: the block's error wins
    with pytest.raises(ValueError, match="the block's own"), engine:
        raise ValueError("the block's own")
    # the steps after the failing one still ran: torch keeps an optimizer's hooks in these
    # dicts (no public API lists them)
    assert not optimizer._optimizer_state_dict_post_hooks
    assert not optimizer._optimizer_load_state_dict_post_hooks
