"""--nan_policy: a non-finite step never changes the weights or the optimizer state.

The data holds one all-white JPEG and the model's logits are NaN for any batch containing it, so
each epoch has exactly one non-finite step, inside the real compiled step of each backend.
"""

import json

import pytest
import torch

from accel.cli import checkpoints as ckpt
from accel.cli.launch import EXIT_NONFINITE, main
from accel.cli.train import Trainer
from tests import nan_model
from tests.helpers import NAN_EPOCHS, checkpoint_tensors, engine_tensors, nan_config, same_state

EPOCHS = NAN_EPOCHS


def _state(trainer_or_path) -> dict[str, torch.Tensor]:
    if isinstance(trainer_or_path, Trainer):
        return engine_tensors(trainer_or_path.engine)
    return checkpoint_tensors(trainer_or_path)


def _checkpoint(run_dir, step: int):
    return ckpt.checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def _not_json(constant: str):
    raise AssertionError(f"{constant} is not JSON")


def _before(step: int, cfg, run_dir) -> dict:
    """The state a step started from: the previous checkpoint, or a fresh model for step 1."""
    if step > 1:
        return _state(_checkpoint(run_dir, step - 1))
    return _state(Trainer(cfg))


XLA = pytest.mark.xla
SLOW = pytest.mark.slow  # a compiled step; the fast tier checks eager's


@pytest.mark.parametrize(
    "backend",
    [
        "eager",
        pytest.param("xla", marks=[XLA, SLOW]),
        pytest.param("xla+kernel_opt", marks=[XLA, SLOW]),
        pytest.param("jax", marks=SLOW),
    ],
)
def test_skip_leaves_weights_and_optimizer_state_untouched(tmp_path, one_white_image, backend):
    # xla+kernel_opt: syncfree AdamW, which skips inside its own update given found_inf
    name, _, kernel_opt = backend.partition("+")
    cfg = nan_config(
        tmp_path, name, one_white_image, nan_policy="skip", kernel_opt=bool(kernel_opt)
    )
    with pytest.warns(UserWarning, match="non-finite loss"):
        summary = Trainer(cfg).train()
    steps = summary["nonfinite_steps"]
    assert len(steps) == EPOCHS and summary["steps"] == 8  # one white batch per epoch, trained on
    losses = summary["losses"]
    assert [i + 1 for i, x in enumerate(losses) if x != x] == steps  # NaN exactly there
    run_dir = cfg.run_dir()
    on_disk = json.loads((run_dir / "summary.json").read_text(), parse_constant=_not_json)
    assert on_disk["nonfinite_steps"] == steps
    assert [on_disk["losses"][s - 1] for s in steps] == [None] * EPOCHS  # strict JSON
    for step in steps:
        assert same_state(_state(_checkpoint(run_dir, step)), _before(step, cfg, run_dir)), step
    applied = next(s for s in range(2, 9) if s not in steps)
    assert not same_state(_state(_checkpoint(run_dir, applied)), _before(applied, cfg, run_dir))


@pytest.mark.parametrize("backend", ["eager", pytest.param("jax", marks=SLOW)])
def test_stop_saves_a_clean_checkpoint_and_exits_non_zero_naming_the_step(
    tmp_path, one_white_image, backend, capsys
):
    cfg = nan_config(tmp_path, backend, one_white_image)  # the default policy is stop
    code = main(
        [
            "--backend",
            backend,
            "--model",
            nan_model.NAME,
            "--data",
            str(one_white_image),
            "--batch_size",
            "4",
            "--epochs",
            str(EPOCHS),
            "--workers",
            "0",
            "--log_every",
            "1",
            "--save_every",
            "1",
            "--keep_checkpoints",
            "0",
            "--no-eval",
            "--output",
            str(tmp_path),
            "--run_name",
            "t",
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_NONFINITE
    step = int(err.split("non-finite loss or gradients at step ")[1].split()[0])
    saved = ckpt.latest_checkpoint(cfg.run_dir())
    assert saved.name == f"step_{step:08d}.pt"  # log_every 1: it stops right after that step
    assert "launch_single_task: error: non-finite loss" in err and "--resume auto" in err
    assert same_state(_state(saved), _before(step, cfg, cfg.run_dir()))


def test_no_save_writes_no_checkpoint_but_a_stopped_run_still_does(tmp_path, one_white_image):
    """--no-save leaves the end's checkpoint out; a stop still writes its own, to resume from."""
    job = ["--model", nan_model.NAME, "--data", str(one_white_image), "--batch_size", "4",
           "--epochs", "1", "--workers", "0", "--log_every", "1", "--no-eval", "--no-save",
           "--run_name", "t"]  # fmt: skip
    codes, saved = {}, {}
    for policy in ("skip", "stop"):
        output = tmp_path / policy
        codes[policy] = main([*job, "--nan_policy", policy, "--output", str(output)])
        saved[policy] = [p.suffix for p in output.glob("*/*/t/checkpoints/step_*")]
    assert codes == {"skip": 0, "stop": EXIT_NONFINITE}
    assert saved == {"skip": [], "stop": [".pt"]}
