"""The examples in the library's docstrings run and show what they say (doctest), in every module
of accel/ that has one."""

from __future__ import annotations

import doctest
import importlib

import pytest

from tests.helpers import ROOT

EXAMPLES = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "accel").rglob("*.py") if ">>>" in p.read_text()
)


def test_the_library_shows_examples():
    assert "accel/engine.py" in EXAMPLES and "accel/logits.py" in EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES)
def test_each_docstring_example_runs_as_shown(path):
    name = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
