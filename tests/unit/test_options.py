"""An option is declared once, in its dataclass: the parser, the config, config.json, the range
check and the resume check all follow from that one declaration."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

import accel.cli.config
import accel.cli.options
from accel.cli.config import OptimConfig, RunConfig, check_ranges, option, resume_keys
from accel.config import AccelError
from tests.helpers import ROOT


@dataclasses.dataclass(frozen=True)
class OptimWithProbe(OptimConfig):
    probe_depth: int = option(3, "a new option, declared here only", min=1, resume="same")


@dataclasses.dataclass(frozen=True)
class RunWithProbe(RunConfig):
    optim: OptimWithProbe = dataclasses.field(default_factory=OptimWithProbe)


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setattr(accel.cli.options, "RunConfig", RunWithProbe)
    monkeypatch.setattr(accel.cli.config, "RunConfig", RunWithProbe)


def parse(*argv: str) -> RunConfig:
    return accel.cli.options.config_from_args(
        accel.cli.options.build_parser().parse_args(list(argv))
    )


def test_an_option_declared_once_reaches_every_place(probe, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert "--probe_depth PROBE_DEPTH" in accel.cli.options.build_parser().format_help()
    cfg = parse("--probe_depth", "5")
    assert cfg.optim.probe_depth == 5 and parse().optim.probe_depth == 3
    assert json.loads(cfg.to_json())["optim"]["probe_depth"] == 5
    assert "optim.probe_depth" in resume_keys()
    with pytest.raises(AccelError, match="--probe_depth"):
        check_ranges(parse("--probe_depth", "0"))


def test_accel_compile_cache_names_one_folder_for_every_runs_compiled_programs(
    tmp_path, monkeypatch
):
    from accel.cli.config import replace_path
    from accel.settings import cache_dir
    from tests.helpers import micro_config

    cfg = micro_config(tmp_path / "out", backend="jax")
    monkeypatch.delenv("ACCEL_COMPILE_CACHE", raising=False)
    assert cfg.compile_cache_dir() == tmp_path / "out" / ".compile_cache" / "jax"
    monkeypatch.setenv("ACCEL_COMPILE_CACHE", str(tmp_path / "shared"))
    assert cfg.compile_cache_dir() == tmp_path / "shared" / "jax"
    assert cache_dir("xla") == tmp_path / "shared" / "xla"  # prepare's, read alike
    mine = replace_path(cfg, "accel.compiler.cache_dir", str(tmp_path / "mine"))
    assert mine.compile_cache_dir() == tmp_path / "mine"  # --compile_cache wins


def test_the_help_is_as_it_always_was_byte_for_byte(monkeypatch):
    """The library's settings are the command line's flags through one table (LIBRARY_FLAGS):
    their flags, help, defaults and places in --help are the ones the seed's users know,
    whatever the library's fields are called. The file is the help before that table was."""
    monkeypatch.setenv("COLUMNS", "80")
    expected = (ROOT / "tests/data/launch_single_task_help.txt").read_text()
    assert accel.cli.options.build_parser().format_help() == expected


def test_a_library_setting_is_its_flag_in_the_command_line_and_its_field_in_the_config():
    cfg = parse(
        "--grad_accum", "2", "--nproc_per_node", "4", "--compile_cache", "/c", "--seed", "3"
    )
    assert (cfg.accel.step.accum, cfg.accel.mesh.devices, cfg.accel.step.seed) == (2, 4, 3)
    assert cfg.accel.compiler.cache_dir == "/c" and cfg.compile_cache_dir() == Path("/c")
    assert parse().accel.step.clip_grad == 1.0  # the command line's default, not prepare's 0
    assert json.loads(cfg.to_json())["accel"]["step"]["accum"] == 2
    with pytest.raises(AccelError, match=r"^--grad_accum must be >= 1, got 0$"):
        check_ranges(parse("--grad_accum", "0"))


def test_jax_nodes_meet_where_the_rendezvous_flags_say_unless_the_user_named_a_place(monkeypatch):
    """--nnodes on jax tells the library where its hosts meet (accel.distributed.meet_as_hosts),
    and a job's hosts read back (hosts_joining) are its nodes, as with --nnodes."""
    from accel.cli.launch import join_processes
    from accel.cli.resolve import jax_hosts
    from accel.distributed import HOST_MEETING, hosts_joining, process_index

    for name in HOST_MEETING:  # set first, so that the test's own settings are undone too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    node = ("--backend", "jax", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1")
    join_processes(parse(*node, "--master_port", "29400"))
    assert (hosts_joining(), process_index()) == ((2, 1), 1)
    alone = jax_hosts(parse("--backend", "jax"))
    assert (alone.hosts.nnodes, alone.hosts.node_rank) == (2, 1)
    assert jax_hosts(parse("--backend", "eager")).hosts.nnodes == 1
    monkeypatch.setenv(HOST_MEETING[0], "elsewhere:1")  # named by the user: kept
    join_processes(parse(*node, "--master_port", "29401"))
    assert os.environ[HOST_MEETING[0]] == "elsewhere:1" and hosts_joining() == (2, 1)


def test_a_config_saved_before_the_librarys_section_resumes_with_its_settings():
    """A run's config.json written before the library's settings had a section of their own
    (tests/data/config_before_accel_section.json, written by that version for `--seed 7
    --amp_level O2 --grad_accum 2 --tp 2 --nproc_per_node 2 --nnodes 2 ...`): each setting is
    read where it was, so that resuming the run checks them as it checks any other."""
    from accel.cli.checkpoints import resume_mismatches, saved_config

    text = (ROOT / "tests/data/config_before_accel_section.json").read_text()
    assert '"accel"' not in text and '"grad_accum": 2' in text
    saved = saved_config({"config": text})
    step, mesh, compiler = saved.accel.step, saved.accel.mesh, saved.accel.compiler
    assert (step.seed, step.amp, step.accum, step.kernel_opt) == (7, "O2", 2, True)
    assert (mesh.tp, mesh.devices, compiler.max_recompiles) == (2, 2, 3)
    assert (saved.hosts.nnodes, saved.hosts.master_addr, saved.optim.lr) == (2, "10.0.0.1", 0.01)
    flags = ("--model", "vit_micro", "--amp_level", "O2", "--grad_accum", "2", "--tp", "2")
    now = parse(*flags, "--seed", "8", "--nproc_per_node", "2", "--nnodes", "2")
    assert resume_mismatches(saved, now, 4, 4) == ["accel.step.seed (checkpoint 7, now 8)"]
