"""The launcher's exit code for a multi-process job: the code of the first rank that failed on
its own, never one the launcher caused by stopping the others (torch >= 2.15's elastic agent
reports the stopped peers too, with the signal as a negative code). The ranks it starts take
its resolved config."""

import dataclasses
from types import SimpleNamespace

import pytest

from accel.cli.launch import RESOLVED, job_exit_code, settled
from tests.helpers import micro_config


def _failures(*ranks: tuple[int, int]) -> dict:
    """{rank: failure} from (exit code, time of failure) pairs."""
    return {r: SimpleNamespace(exitcode=c, timestamp=t) for r, (c, t) in enumerate(ranks)}


@pytest.mark.parametrize(
    ("ranks", "code", "first"),
    [
        (((2, 5), (-15, 6)), 2, 0),  # a rank stops on bad input; the launcher stops its peer
        (((-15, 6), (2, 5)), 2, 1),
        (((1, 4), (2, 5)), 2, 1),  # a peer's broken collective (1) failed earlier
        (((4, 3), (2, 5)), 4, 0),  # two of ours: the first to fail
        (((-9, 3), (-15, 4)), 1, 0),  # killed from outside: no code of ours
        (((-15, 3), (-9, 4)), 1, 1),  # the survivor's SIGTERM recorded before the kill
        (((-15, 3), (1, 4)), 1, 1),  # a rank raised; its peer was stopped
        (((1, 3), (1, 3)), 1, 0),
    ],
)
def test_the_first_rank_to_fail_on_its_own_decides(ranks, code, first):
    got, order = job_exit_code(_failures(*ranks))
    assert got == code and order[0] == first


def test_the_ranks_take_the_config_the_launcher_resolved(monkeypatch, tmp_path):
    given = micro_config(tmp_path, run_name=None, steps=None)  # left open: resolve settles it
    resolved = dataclasses.replace(micro_config(tmp_path), run_name="launcher", epochs=7)
    monkeypatch.setenv(RESOLVED, resolved.to_json())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # a rank torchrun started
    cfg, supports, notes = settled(given)
    assert cfg == resolved and supports.replicas == "processes" and notes == []
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # the launcher itself resolves, whatever is set
    cfg, _, notes = settled(given)
    assert cfg.run_name not in (None, "launcher") and cfg.epochs == 1 and notes
