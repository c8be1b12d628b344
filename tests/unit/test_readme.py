"""The README shows the command line and the support table as the code has them: both are
generated, so an option or a refusal added in one place must reach the README too."""

from __future__ import annotations

from accel.backends import support_matrix
from accel.cli import build_parser
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def help_text(monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps at the terminal's width
    return build_parser().format_help()


def test_the_readme_shows_the_support_table_the_code_prints():
    assert support_matrix().strip() in README


def test_the_readme_shows_the_help_the_parser_prints(monkeypatch):
    text = help_text(monkeypatch)
    assert f"```text\n{text.strip()}\n```" in README, "README's --help block is stale"
    assert "--model_ema" in text and "--nnodes" in text  # options from every dataclass
