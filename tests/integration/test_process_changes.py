"""What prepare changes in the whole process is undone by engine.close() or listed in
docs/api.md: engines made and closed one after the other in a fresh process leave the start
method, the warnings filters and the environment as they were, but for what the docs list; the
user's model and optimizer keep what was trained and no hook of accel's; and checking a
configuration (accel.settle) writes no environment variable at all."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPT = r"""
import json, multiprocessing, os, sys, warnings
import torch
import accel
# sympy adds a warnings filter of its own as it is imported (torch imports it on first use, in
# prepare): imported first, so that the filters compared are those prepare itself would add.
import sympy
# So does torch_xla's import (accel imports it with its backend): the same, where xla runs.
if "xla" in sys.argv:
    import torch_xla

def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

def changed(before, after):
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))

def hooks(model, optimizer):
    # torch keeps a module's and an optimizer's hooks in these dicts; no public API lists them
    held = (model._forward_pre_hooks, model._state_dict_pre_hooks, model._state_dict_hooks,
            optimizer._optimizer_state_dict_post_hooks,
            optimizer._optimizer_load_state_dict_post_hooks)
    return sum(len(h) for h in held)

before = {
    "method": multiprocessing.get_start_method(allow_none=True),
    "filters": len(warnings.filters),
    "environ": dict(os.environ),
}
methods, warned, settled_changed, hooks_open, hooks_closed, kept = [], [], [], [], [], []
for backend in sys.argv[1:]:
    # What importing a backend's libraries sets is theirs (docs/api.md); settle sets nothing.
    from accel.backends import backend_module
    backend_module(backend, check=False)
    if backend == "jax":
        from accel.backends.jax import load_torchax
        load_torchax()
    environ = dict(os.environ)
    accel.settle(accel.with_keywords(None, backend=backend, devices=1))
    settled_changed += changed(environ, dict(os.environ))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with accel.prepare(model, optimizer, loss_fn, backend=backend, quiet=True) as engine:
        methods.append(multiprocessing.get_start_method(allow_none=True))
        engine.fetch([engine.step(torch.randn(8, 4), torch.randint(0, 3, (8,)))])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()  # the user's scheduler, stepped after accel's step
        warned += [str(w.message) for w in caught]
        hooks_open.append(hooks(model, optimizer))
        trained = {k: v.cpu().clone() for k, v in engine.state_dict().items()}
        moments = [s["momentum_buffer"].clone() for s in optimizer.state_dict()["state"].values()]
    hooks_closed.append(hooks(model, optimizer))
    weights = {k: v.cpu() for k, v in model.state_dict().items()}
    buffers = [s["momentum_buffer"].cpu() for s in optimizer.state_dict()["state"].values()]
    kept.append(all(torch.equal(trained[k], weights[k]) for k in trained)
                and len(buffers) == 2 and all(torch.equal(a, b) for a, b in zip(moments, buffers)))
after = dict(os.environ)
print(json.dumps({
    "methods_while_open": methods,
    "method": [before["method"], multiprocessing.get_start_method(allow_none=True)],
    "filters": [before["filters"], len(warnings.filters)],
    "changed": changed(before["environ"], after),
    "settled_changed": settled_changed,
    "hooks": [hooks_open, hooks_closed],
    "kept": kept,
    "warned": warned,
}))
"""


def _documented_variables() -> set[str]:
    """The environment variables docs/api.md lists as what prepare leaves set (its section's
    "These stay" part; the variables above it are those `close` puts back)."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## What prepare changes in the process", 1)[1].split("\n## ", 1)[0]
    stays = section.split("These stay", 1)[1]
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", stays))


@pytest.mark.slow  # two fresh interpreters, each starting JAX: the full suite
@pytest.mark.parametrize("backends", [("jax", "jax"), ("xla", "eager", "jax")])
def test_two_engines_closed_in_turn_leave_the_process_as_it_was(backends):
    env = {k: v for k, v in os.environ.items() if k not in _documented_variables()}
    env.pop("ACCEL_FORKSERVER_MAIN", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *backends],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # jax's runtime runs threads: its engine starts DataLoader workers from a fork server while
    # it is open, and puts Python's default back when closed
    assert report["methods_while_open"][-1] == "forkserver"
    assert report["method"] == [None, None]
    assert report["filters"][0] == report["filters"][1]
    assert not report["warned"]  # the scheduler stepped after accel's step, as it did
    documented = _documented_variables()
    assert documented and set(report["changed"]) <= documented, report["changed"]
    assert report["settled_changed"] == []  # checking a config leaves the environment alone
    opened, closed = report["hooks"]
    assert min(opened) >= 2 and closed == [0] * len(backends), report["hooks"]
    assert report["kept"] == [True] * len(backends)  # the trained weights and moments stay
