"""A program for the suite's tests of its own command server (tests/cli_server.py): prints one
JSON line of what it sees of its own start, and exits 3.

    python -m tests.probe [--child] [--threads-first] ARGS

--child: first starts `python -m tests.probe from-child` through subprocess.run, with
ACCEL_TEST_VALUE=child, and includes what that printed and its exit code.
--threads-first: before that, runs a matmul on torch's intra-op threads (OpenMP's pool).
"""

import json
import os
import subprocess
import sys

TORCH_BEFORE = "torch" in sys.modules  # imported before this program started: a forked process


def main(argv: list[str]) -> int:
    report = {"pid": os.getpid(), "cwd": os.getcwd(), "args": argv, "torch_before": TORCH_BEFORE}
    report["value"] = os.environ.get("ACCEL_TEST_VALUE")
    if "--threads-first" in argv:
        import torch

        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        report["threads_ran"] = float((x @ x).sum()) != 0.0
    if "--child" in argv:
        child = [sys.executable, "-m", "tests.probe", "from-child"]
        env = {**os.environ, "ACCEL_TEST_VALUE": "child"}
        done = subprocess.run(child, capture_output=True, text=True, env=env, timeout=120)
        report["child"] = json.loads(done.stdout) if done.stdout else done.stderr[-2000:]
        report["child_code"] = done.returncode
    print(json.dumps(report))
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
