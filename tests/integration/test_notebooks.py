"""The walkthrough notebooks, executed top to bottom with nbclient, and their outputs checked."""

import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ROOT


def execute(name: str, workdir) -> str:
    """Run notebooks/<name>.ipynb in `workdir`; return the text of all its outputs."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


@pytest.mark.xla  # USE_ACCEL=1 on a CPU is torch_xla
def test_quickstart_trains_both_paths_and_plots(tmp_path):
    text = execute("01_quickstart", tmp_path)
    assert "accel: backend xla (USE_ACCEL=1" in text
    assert "| vit_micro | eager |" in text and "| vit_micro | xla |" in text
    assert (tmp_path / "runs/quickstart/report/throughput.png").stat().st_size > 0


@pytest.mark.xla
def test_swin_walkthrough_reads_the_speedup(tmp_path):
    text = execute("02_swin_accel_vs_eager", tmp_path)
    assert "| swin_micro | eager |" in text and "| swin_micro | xla |" in text
    assert re.search(r"speed-up of xla over eager: \d+\.\d\dx", text)
    for png in ("throughput.png", "losses.png"):
        assert (tmp_path / "runs/swin/report" / png).stat().st_size > 0


@pytest.mark.xla
def test_recompile_walkthrough_shows_the_problem_and_the_fix(tmp_path):
    text = execute("03_xla_recompiles", tmp_path)
    ragged = int(re.search(r"ragged: compiles_after_warmup = (\d+)", text).group(1))
    assert ragged >= 1
    assert "fixed: compiles_after_warmup = 0" in text
    assert "batch shape changed" in text
