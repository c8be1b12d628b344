"""The README and docs/ show the command line and the support table as the code has them: both
are generated, so an option or a refusal added in one place must reach the docs too. The README
stays a page a new user reads from the top."""

from __future__ import annotations

import re

from accel.backends import support_matrix
from accel.cli.messages import as_flags
from accel.cli.options import build_parser
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
CLI_PAGE = ROOT / "docs" / "cli.md"


def help_text(monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps at the terminal's width
    return build_parser().format_help()


def test_the_readme_shows_the_support_table_the_code_prints():
    assert support_matrix(as_flags).strip() in README


def test_the_cli_page_shows_the_help_the_parser_prints(monkeypatch):
    text = help_text(monkeypatch)
    assert f"```text\n{text.strip()}\n```" in CLI_PAGE.read_text(), (
        "docs/cli.md's --help block is stale: paste `COLUMNS=100 launch_single_task --help`"
    )
    assert "--model_ema" in text and "--nnodes" in text  # options from every dataclass


def test_the_readme_is_short_and_every_section_is_linked_from_its_top():
    lines = README.splitlines()
    assert len(lines) <= 260  # the quick start's console lines included
    top = "\n".join(lines[:20])
    for heading in re.findall(r"^#{2,3} (.+)$", README, flags=re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        assert f"(#{anchor})" in top, f"{heading!r} not linked from the top"


def test_the_docs_speak_of_the_project_and_its_users():
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for word in (r"\blent\b", r"\$OUT\b", r"\bcarry\b", r"\bcarried\b"):
            assert not re.search(word, text), f"{page.name}: {word}"
