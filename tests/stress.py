"""`make test-stress`: every multi-process test file, run again and again on make test's two
workers, each failure reported with its output. A suite that fails one run in N drops work at
random; this is how a rare failure (a rank that dies, a collective that hangs) is found, and how
its fix is shown to hold. Not part of `make test`: ten rounds take about as long as ten suites'
multi-process halves.

    .venv/bin/python -m tests.stress --rounds 10 --out .stress
    .venv/bin/python -m tests.stress --rounds 3 tests/integration/test_hybrid_parallel.py

Each round is one pytest run over the files; its JUnit XML (with each test's captured output)
stays in OUT/round-N.xml, every failure's text in OUT/failures.txt.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a test file names when its tests start several processes that work together: ranks and
# forked runs (tests/helpers.py), a launcher's ranks, jax's processes.
MULTI_PROCESS = re.compile(
    r"\b(train_ranks|script_ranks|fork_ranks|fork_module|train_forked|nan_rank)\b"
    r"|--nproc_per_node|torchrun|JAX_NUM_PROCESSES"
)
# make test's environment and workers (Makefile).
ENV = {"PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu", "ACCEL_REQUIRE_XLA": "1"}
ENV["ACCEL_REQUIRE_JAX"] = "1"
WORKERS = ["-n", "2", "--no-loadscope-reorder"]


def multi_process_files() -> list[Path]:
    """The integration test files whose tests start processes that work together (the unit
    tests' processes are single commands)."""
    files = sorted((ROOT / "tests" / "integration").glob("test_*.py"))
    return [path for path in files if MULTI_PROCESS.search(path.read_text())]


def failures(report: Path) -> list[tuple[str, str]]:
    """(test id, what it printed and why it failed) of each failed or erroring test in a JUnit
    XML report."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            for element in case.findall(kind):
                name = f"{case.get('classname')}::{case.get('name')} ({kind})"
                parts = [element.get("message") or "", element.text or ""]
                parts += [out.text or "" for out in case.findall("system-out")]
                parts += [err.text or "" for err in case.findall("system-err")]
                found.append((name, "\n".join(p for p in parts if p.strip())))
    return found


def counts(report: Path) -> dict[str, int]:
    """Tests run, failed, errored and skipped in a JUnit XML report."""
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, report
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def run_round(number: int, files: list[Path], out: Path, timeout: int) -> list[tuple[str, str]]:
    """One pytest run over `files`; its failures (a run that produced no report, one)."""
    report = out / f"round-{number}.xml"
    log = out / f"round-{number}.log"
    command = [sys.executable, "-m", "pytest", "-q", *WORKERS, "-p", "no:cacheprovider"]
    command += ["-o", "junit_logging=all", f"--junitxml={report}", *map(str, files)]
    start = time.perf_counter()
    with log.open("w") as output:
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env={**os.environ, **ENV},
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = f"killed at {timeout} s"
    seconds = time.perf_counter() - start
    if not report.exists():
        found = [(f"round {number}", f"pytest ended ({code}) with no report: see {log}")]
        print(f"round {number}: no report (exit {code}) in {seconds:.0f} s", flush=True)
        return found
    found = failures(report)
    tally = counts(report)
    passed = tally["tests"] - tally["failures"] - tally["errors"] - tally["skipped"]
    print(
        f"round {number}: {passed} passed, {tally['failures']} failed, {tally['errors']} "
        f"errors, {tally['skipped']} skipped in {seconds:.0f} s (exit {code})",
        flush=True,
    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files (default: every multi-process one)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=".stress", help="folder of the rounds' reports")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds a round may take")
    args = parser.parse_args(argv)
    files = [Path(f).resolve() for f in args.files] or multi_process_files()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(files)} files, {args.rounds} rounds on two workers:", flush=True)
    for path in files:
        print(f"  {path.relative_to(ROOT)}", flush=True)
    every: list[tuple[int, str, str]] = []
    for number in range(1, args.rounds + 1):
        found = run_round(number, files, out, args.timeout)
        every += [(number, name, text) for name, text in found]
    with (out / "failures.txt").open("w") as report:
        for number, name, text in every:
            report.write(f"=== round {number}: {name}\n{text}\n\n")
    for number, name, text in every:
        print(f"\nround {number}: {name}\n{text[-3000:]}", flush=True)
    print(f"\n{len(every)} failures in {args.rounds} rounds (reports in {out})", flush=True)
    return 1 if every else 0


if __name__ == "__main__":
    sys.exit(main())
