"""The walkthrough notebooks, executed top to bottom with nbclient as committed, and their outputs
checked: the numbers they print, the files they write, and no third-party notice in any cell.
Every speed-up they print rests on three runs of each path and says so, with its spread."""

import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # a kernel process each, and real training

NOTICES = ("IProgress", "TqdmWarning", "absl", "PJRT_DEVICE", "Tensorflow", "Traceback")


def execute(name: str, workdir) -> str:
    """Run notebooks/<name>.ipynb in `workdir`; return the text of all its outputs, having
    checked that none of them is a notice from a library."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            text = out.get("text", "") + data.get("text/markdown", "") + data.get("text/plain", "")
            assert not any(n in text for n in NOTICES), text
            texts.append(text)
    return "\n".join(texts)


# A speed-up's run count and spread, as the notebooks print them: "(medians of 3 runs each; run by
# run 0.25-0.27 over 3 runs)".
SPREAD = r"\(medians of 3 runs each; run by run \d+\.\d\d-\d+\.\d\d over 3 runs\)"


def _pictures(folder) -> None:
    for name in ("throughput", "timeline", "agreement", "memory"):
        assert (folder / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    assert "From a single run" not in (folder / "report.md").read_text()


@pytest.mark.xla  # USE_ACCEL=1 on a CPU is torch_xla
def test_quickstart_trains_both_paths_and_reports(tmp_path):
    text = execute("01_quickstart", tmp_path)
    assert "accel: backend eager (default" in text and "accel: backend xla (USE_ACCEL=1" in text
    assert "| vit_micro | eager | 3 |" in text and "| vit_micro | xla | 3 |" in text
    assert re.search(rf"xla runs at \d+\.\d\dx eager's images/s here {SPREAD}", text)
    compiles = r"xla's compile before its first step, run by run: [\d.]+ s, [\d.]+ s, [\d.]+ s"
    assert re.search(compiles, text)  # each run a process of its own: each compiles
    _pictures(tmp_path / "work" / "quickstart" / "report")


@pytest.mark.xla
def test_swin_walkthrough_reads_the_median_speedup(tmp_path):
    text = execute("02_swin_accel_vs_eager", tmp_path)
    assert "80 training JPEGs, 20 validation JPEGs" in text
    assert "| swin_micro | eager | 3 |" in text and "| swin_micro | xla | 3 |" in text
    assert re.search(rf"speed-up of xla over eager: \d+\.\d\dx {SPREAD}", text)
    _pictures(tmp_path / "work" / "swin" / "report")


@pytest.mark.xla
def test_recompile_walkthrough_shows_the_cost_the_stop_and_the_fix(tmp_path):
    text = execute("03_xla_recompiles", tmp_path)
    assert int(re.search(r"ragged: compiles_after_warmup = (\d+)", text).group(1)) >= 1
    assert re.search(r"step 7 took [\d.]+ s, a steady step [\d.]+ s", text)  # speeds: bench/
    assert "stopped: 1 graphs compiled after warm-up (limit 0)" in text
    assert "fixed: compiles_after_warmup = 0" in text
    assert "real images per batch: [8, 8, 5] = 21" in text
    assert "second evaluation: 21 images, 0 new graph(s) compiled" in text
