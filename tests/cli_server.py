"""A process that has imported torch, timm, torch_xla, JAX and accel once, and forks a fresh
child for each command of the suite that runs the command line or a script (tests/helpers.py:
run_cli, start_cli, run_script).

Each child is a process of its own, as `python -m accel.launch_single_task ...` would be: its own
environment, working folder, stdout and stderr files, signals and exit code. What it skips is
the interpreter's start and the imports, several seconds of each of the suite's hundred-odd
launches. Nothing here has started a thread or a runtime when it forks: torch_xla's runtime and
JAX's platforms start on first use, in the child, which reads its own environment then.

The ranks such a command starts through torchrun (`--nproc_per_node`, `--nnodes`) are forked from
it the same way, instead of torchrun starting `python -m accel.launch_single_task` afresh for
each (ForkedRank): the launcher has started no runtime either, only torchrun's rendezvous store,
which a rank never touches. A command whose environment sets FRESH_RANKS gets torchrun's own
fresh interpreters, as users do: the tests that look at the ranks from outside (their command
lines and environments, their process tree) set it. A forked rank's resident memory includes the
launcher's pages: the tests of memory (test_scale.py) read what a run adds over its start.

The protocol, one JSON object a line: on stdin a request {"argv", "env", "cwd", "stdout",
"stderr", "status", "script", "new_session"}; on stdout the child's {"pid"}. When a child ends,
its wait status is written to the request's "status" file (atomically), which is how the suite
polls it: the child is this server's, not the suite's, so only this server can wait for it.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback

# What every launch imports. Not torchax (accel.backends.jax): it registers its "jax" device as
# torch's PrivateUse1 backend, after which torch.distributed's barrier fails ("Please register
# PrivateUse1HooksInterface"), so it would break the eager ranks forked from here; a jax
# command imports it itself (half a second).
PRELOAD = ("torch", "torchvision", "timm", "jax", "torch_xla", "accel.launch_single_task")
PRELOAD += ("accel.train", "accel.compare", "accel.engine")
PRELOAD += ("accel.backends.eager", "accel.backends.compile", "accel.backends.xla")
# huggingface_hub reads these as it is imported: a command that sets one starts afresh.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_")
# Set in a command's environment: its ranks start as fresh interpreters (helpers.FRESH_RANKS).
FRESH_RANKS = "ACCEL_SUITE_FRESH_RANKS"
RANK_COMMAND = ("-u", "-m", "accel.launch_single_task")  # how torchrun starts a rank


START_ENV = dict(os.environ)


def preload() -> dict[str, str]:
    """Import PRELOAD; what the imports put in the environment, which a child's environment
    gets too unless it says otherwise (as a fresh process's imports would do)."""
    before = dict(os.environ)
    from accel.backends.quiet import quiet_imports

    with quiet_imports():
        for name in PRELOAD:
            importlib.import_module(name)
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _child(request: dict, imported_env: dict[str, str]) -> int:
    """Become the requested command; its exit code."""
    os.chdir(request["cwd"])
    if request.get("new_session"):  # as subprocess.Popen(start_new_session=True)
        os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in imported_env.items():
        os.environ.setdefault(key, value)
    torch_xla = sys.modules["torch_xla"]
    torch_xla._setup_default_env()  # what its import does to this environment (XLA_FLAGS)
    torch_xla._setup_xla_flags()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    _redirect(1, request["stdout"])
    _redirect(2, request["stderr"])
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    script = request.get("script")
    if any(k.startswith(READ_AT_IMPORT) and v != START_ENV.get(k) for k, v in os.environ.items()):
        command = [script] if script else ["-m", "accel.launch_single_task"]
        os.execv(sys.executable, [sys.executable, *command, *request["argv"]])
    if os.environ.get(FRESH_RANKS) is None:
        fork_ranks()
    return _main(request["argv"], script)


def _main(argv: list[str], script: str | None) -> int:
    """Run the launcher (or `script`) with `argv` in this process, as the interpreter would: its
    exit code."""
    launcher = sys.modules["accel.launch_single_task"]
    sys.argv = [script or launcher.__file__, *argv]
    launcher.START = time.perf_counter()  # its time to the first step counts from here
    try:
        if script:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
            return 0
        return launcher.main(argv)
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # as the interpreter does: the traceback, exit 1
        traceback.print_exc()
        return 1


def _run_child(request: dict, imported_env: dict[str, str], replies) -> None:
    code = 1
    try:
        os.close(replies.fileno())  # the server's, not the command's
        code = _child(request, imported_env)
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter would run on its way out
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def wait_polling(process, timeout: float | None) -> int:
    """subprocess.Popen.wait for an object with `poll()` and `args` (ForkedRank here, the
    suite's helpers.Command): its exit code, or TimeoutExpired past `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while process.poll() is None:
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(process.args, timeout)
        time.sleep(0.05)
    return process.returncode


class ForkedRank:
    """A rank of the launcher in this process, forked from it, with what torchrun uses of the
    subprocess.Popen it would have started: pid, poll, wait (torchrun's handler signals the
    rank's process group, so the rank starts a session of its own, as there)."""

    def __init__(self, argv: list[str], env: dict[str, str], stdout, stderr):
        self.args = [sys.executable, *RANK_COMMAND, *argv]
        self.returncode: int | None = None
        sys.stdout.flush()  # what the launcher has written is not the rank's to write again
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _rank(argv, env, stdout, stderr)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return wait_polling(self, timeout)


def _rank(argv: list[str], env: dict[str, str], stdout, stderr) -> None:
    """Become the rank: what a fresh `python -u -m accel.launch_single_task` would be, without
    what the launcher had set up for itself (its signal handlers, its exit functions)."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # torchrun's 1 a rank, which torch reads only as it starts
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
        for fd, target in ((1, stdout), (2, stderr)):
            if target is not None:  # torchrun's --redirects; else the launcher's own streams
                os.dup2(target.fileno(), fd)
        sys.stdout = _unbuffered(1)  # `python -u`, as torchrun starts it
        sys.stderr = _unbuffered(2)
        code = _main(argv, None)
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), write_through=True)


def fork_ranks() -> None:
    """Have torchrun fork the launcher's ranks from this process (ForkedRank) instead of
    starting fresh interpreters."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    fresh = SubprocessHandler._popen

    def popen(handler, args: tuple, env: dict[str, str]):
        if tuple(args[1:4]) != RANK_COMMAND:  # another program: as torchrun would
            return fresh(handler, args, env)
        return ForkedRank(list(args[4:]), env, handler._stdout, handler._stderr)

    SubprocessHandler._popen = popen


def _reap(statuses: dict[int, str]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = statuses.pop(pid, None)
        if path is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with open(f"{path}.part", "w") as f:
                f.write(str(code))
            os.replace(f"{path}.part", path)


def serve() -> None:
    # Replies go out on a copy of stdout; stdout itself joins stderr, so that nothing a library
    # prints is read as a reply.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    imported_env = preload()
    statuses: dict[int, str] = {}
    requests = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        _reap(statuses)
        if not ready:
            continue
        line = requests.readline()
        if not line:  # the suite has gone
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request, imported_env, replies)
        statuses[pid] = request["status"]
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
