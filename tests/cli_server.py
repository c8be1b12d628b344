"""A process that has imported torch, timm, torch_xla, JAX and accel once, and forks a fresh
child for each Python command of the suite (tests/helpers.py: Command, run_cli, start_cli,
run_script, run_module).

Each child is a process of its own, as `python -m accel.launch_single_task ...` would be: its own
environment, working folder, stdout and stderr files, signals and exit code. What it skips is
the interpreter's start and the imports, several seconds of each of the suite's hundreds of
launches. Nothing here has started a thread or a runtime when it forks: torch_xla's runtime and
JAX's platforms start on first use, in the child, which reads its own environment then.

The Python programs such a command starts in turn through subprocess are forked from it the same
way (fork_python_children): the ranks torchrun starts (`--nproc_per_node`, `--nnodes`),
`--compare`'s launches, bench/gpu_check.py's stages and the launches of the bench scripts they
run. Only the project's own programs, pytest and torchrun are forked, and only while the command
is still fit to fork (fit_to_fork); anything else starts as it would. A command whose
environment sets FRESH_RANKS gets fresh interpreters for all of them, as users do: the tests that
look at ranks from outside (their command lines and environments, their process tree) set it.
A forked rank's resident memory includes the launcher's pages: the tests of memory
(test_scale.py) read what a run adds over its start.

The protocol, one JSON object a line: on stdin a request {"python" (the command line after the
interpreter), "env", "cwd", "stdout", "stderr", "status", "new_session"}; on stdout the child's
{"pid"}. When a child ends, its wait status is written to the request's "status" file
(atomically), which is how the suite polls it: the child is this server's, not the suite's, so
only this server can wait for it.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import importlib
import importlib.util
import inspect
import io
import json
import os
import runpy
import select
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = "accel.launch_single_task"
# What every launch imports. Not torchax (accel.backends.jax): it registers its "jax" device as
# torch's PrivateUse1 backend, after which torch.distributed's barrier fails ("Please register
# PrivateUse1HooksInterface"), so it would break the eager ranks forked from here; a jax
# command imports it itself (half a second).
PRELOAD = ("torch", "torchvision", "timm", "jax", "torch_xla", LAUNCHER)
PRELOAD += ("accel.cli.train", "accel.cli.compare", "accel.engine")
PRELOAD += ("accel.backends.eager", "accel.backends.compile", "accel.backends.xla")
OPTIONAL = ("jax", "torch_xla")  # preloaded where installed
# The programs forked rather than started afresh: the project's own, pytest and torchrun. Others
# (torch.compile's pool of compile workers, a user's script outside the project) start afresh.
FORKED_MODULES = ("accel", "bench", "tests", "pytest", "torch.distributed.run")
# huggingface_hub reads these as it is imported: a command that sets one starts afresh.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_")
# Set in a command's environment: the Python programs it starts (its ranks) are fresh
# interpreters (helpers.FRESH_RANKS).
FRESH_RANKS = "ACCEL_SUITE_FRESH_RANKS"

START_ENV = dict(os.environ)
IMPORTED_ENV: dict[str, str] = {}  # what PRELOAD's imports put in the environment (preload)
THREADS = 1  # torch's intra-op threads in a fresh interpreter here (preload)


@dataclasses.dataclass(frozen=True)
class Program:
    """What `python [-u] (-m MODULE | SCRIPT) ARGS...` runs."""

    args: tuple[str, ...]
    module: str | None = None
    script: str | None = None
    unbuffered: bool = False

    @classmethod
    def parse(cls, words: list[str]) -> Program | None:
        """The program of a command line's words after the interpreter; None for any other form
        (`-c`, interpreter options besides -u)."""
        unbuffered = False
        while words[:1] == ["-u"]:
            unbuffered, words = True, words[1:]
        if len(words) >= 2 and words[0] == "-m":
            return cls(tuple(words[2:]), module=words[1], unbuffered=unbuffered)
        if words and not words[0].startswith("-"):
            return cls(tuple(words[1:]), script=words[0], unbuffered=unbuffered)
        return None

    def words(self) -> list[str]:
        """The command line after the interpreter."""
        head = ["-m", self.module] if self.module else [self.script]
        return ["-u"] * self.unbuffered + head + list(self.args)

    def forked_from(self, cwd: str) -> bool:
        """Whether this server forks it (FORKED_MODULES, or a script inside the project)."""
        if self.module:
            return any(self.module == m or self.module.startswith(f"{m}.") for m in FORKED_MODULES)
        path = os.path.realpath(os.path.join(cwd, self.script))
        return path.startswith(ROOT + os.sep) and path.endswith(".py")

    def run(self) -> int:
        """Run it in this process as the interpreter would; its exit code."""
        try:
            if self.module == LAUNCHER:
                launcher = sys.modules[LAUNCHER]
                sys.argv = [launcher.__file__, *self.args]
                launcher.START = time.perf_counter()  # its time to the first step counts from here
                return launcher.main(list(self.args))
            if self.module:
                sys.argv = ["-m", *self.args]  # runpy puts the module's file first
                sys.path.insert(0, os.getcwd())
                runpy.run_module(self.module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [self.script, *self.args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(self.script)))
                runpy.run_path(self.script, run_name="__main__")
            return 0
        except SystemExit as exit_:
            code = exit_.code
            if code is None or isinstance(code, int):
                return code or 0
            print(code, file=sys.stderr)
            return 1
        except BaseException:  # as the interpreter does: the traceback, exit 1
            traceback.print_exc()
            return 1


def preload() -> None:
    """Import PRELOAD, and note what a fresh interpreter here starts with that a child must get
    too: the variables the imports set (unless its environment says otherwise), torch's threads."""
    global THREADS
    before = dict(os.environ)
    from accel.backends.quiet import quiet_imports

    with quiet_imports():
        for name in PRELOAD:
            if name in OPTIONAL and importlib.util.find_spec(name) is None:
                continue  # an optional backend this stack lacks (torch_xla on a newer torch)
            importlib.import_module(name)
    IMPORTED_ENV.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    THREADS = sys.modules["torch"].get_num_threads()
    # The imports' half a million objects, out of every child's garbage collections (which a
    # run's end forces: accel.distributed.destroy_process_group): 0.3 s a rank's end otherwise.
    gc.collect()
    gc.freeze()


def fork(new_session: bool) -> int:
    """os.fork(), with the child in a session of its own (as subprocess.Popen's
    start_new_session) before the parent goes on: what signals the child's process group as soon
    as it has the pid (jupyter_client, torchrun, a test's killpg) must not reach the parent's."""
    if not new_session:
        return os.fork()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.close(read)
        os.write(write, b"1")
        os.close(write)
        return 0
    os.close(write)
    os.read(read, 1)
    os.close(read)
    return pid


def become(program: Program, env: dict[str, str], cwd: str | None) -> NoReturn:
    """Turn this just-forked process into `program` started with `env` in `cwd`, as a fresh
    `python ...` would be, run it and exit with its code. Its standard streams are in place."""
    code = 1
    try:
        if cwd:
            os.chdir(cwd)
        _default_signals()
        atexit._clear()  # the forking process's, not the program's
        _adopt_environment(env)
        if any(k.startswith(READ_AT_IMPORT) and v != START_ENV.get(k) for k, v in env.items()):
            os.execv(sys.executable, [sys.executable, *program.words()])
        unbuffered = program.unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
        sys.stdout, sys.stderr = _stream(1, unbuffered), _stream(2, unbuffered)
        fork_python_children(os.environ.get(FRESH_RANKS) is None)
        code = program.run()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter would run on its way out
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _default_signals() -> None:
    """The handlers an interpreter starts with: Python's handlers reset (ignored signals stay
    ignored, as across exec)."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except ValueError:
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _adopt_environment(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    for key, value in IMPORTED_ENV.items():
        os.environ.setdefault(key, value)
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is not None:
        torch_xla._setup_default_env()  # what its import does to this environment (XLA_FLAGS)
        torch_xla._setup_xla_flags()
    # torchrun's 1 a rank, which torch reads only as it starts. Set only where it changes: setting
    # starts a thread of OpenMP's, after which this process is no longer fit to fork.
    torch, threads = sys.modules["torch"], int(env.get("OMP_NUM_THREADS", THREADS))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def _stream(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    if unbuffered:  # `python -u`, as torchrun starts a rank
        return io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), write_through=True)
    return open(fd, "w", closefd=False)


# --- the Python programs a command starts -----------------------------------------------------
_EXECUTE_CHILD = subprocess.Popen._execute_child
_SIGNATURE = inspect.signature(_EXECUTE_CHILD)


def fork_python_children(fork: bool = True) -> None:
    """From now on, subprocess.Popen in this process forks the Python programs this server
    forks (Program.forked_from) instead of starting fresh interpreters; other commands, and any
    while this process is unfit to fork, start as usual. With `fork` false, all start afresh."""
    subprocess.Popen._execute_child = _execute_child if fork else _EXECUTE_CHILD


def fit_to_fork() -> bool:
    """Whether a child forked now can run as a fresh interpreter would. Not once torch's OpenMP
    pool has run here: its threads are not copied, and the child's first parallel region waits
    for them forever. Its threads are native and take the name of the thread that started them;
    Python's own threads and those that name themselves (torch's TCP store: 'pt_tcpstore_uv')
    do not hold a child up."""
    own = threading.get_native_id()
    python = {t.native_id for t in threading.enumerate()}
    name = _thread_name(own)
    return not any(
        int(tid) != own and int(tid) not in python and _thread_name(int(tid)) == name
        for tid in os.listdir("/proc/self/task")
    )


def _thread_name(tid: int) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # ended meanwhile
        return None


def _execute_child(popen: subprocess.Popen, *args, **kwargs) -> None:
    """subprocess.Popen's start of its child, forking a Python program this server forks."""
    call = _SIGNATURE.bind(popen, *args, **kwargs).arguments
    found = _forked_program(call)
    if found is None:
        return _EXECUTE_CHILD(popen, *args, **kwargs)
    program, cwd = found
    env = dict(os.environ if call["env"] is None else call["env"])
    ends = [call[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")]
    sys.stdout.flush()  # what this process has written is not the child's to write again
    sys.stderr.flush()
    pid = fork(call["start_new_session"])
    if pid == 0:
        try:
            _take_streams(call["p2cread"], call["c2pwrite"], call["errwrite"])
            become(program, env, cwd)
        finally:
            os._exit(1)
    popen.pid = pid
    popen._child_created = True
    popen._close_pipe_fds(*ends)


def _forked_program(call: dict) -> tuple[Program, str] | None:
    """(the program, its folder) where the call starts one this server forks, else None."""
    args = call["args"]
    if call["shell"] or isinstance(args, str | bytes | os.PathLike):
        return None
    words = [os.fsdecode(w) for w in args]
    if not words or os.path.abspath(words[0]) != sys.executable:
        return None
    if call["executable"] is not None and os.fsdecode(call["executable"]) != words[0]:
        return None
    plain = call["preexec_fn"] is None and not call["pass_fds"] and call["umask"] < 0
    plain &= call["uid"] is None and call["gid"] is None and call["gids"] is None
    plain &= call["process_group"] in (None, -1)
    cwd = os.fsdecode(call["cwd"]) if call["cwd"] is not None else os.getcwd()
    program = Program.parse(words[1:])
    if not plain or program is None or not program.forked_from(cwd) or not fit_to_fork():
        return None
    return program, cwd


def _take_streams(stdin: int, stdout: int, stderr: int) -> None:
    """The child's standard streams from subprocess's ends (-1: this process's own), and no other
    pipe or socket of this process (as Popen's close_fds): a pipe's write end held here would
    keep its reader from ever seeing its end."""
    wanted = {0: stdin, 1: stdout, 2: stderr}
    copies = {target: os.dup(fd) for target, fd in wanted.items() if fd != -1}
    for target, copy in copies.items():
        os.dup2(copy, target)
        os.close(copy)
    devnull = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == devnull:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:  # the listing's own descriptor, closed
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.dup2(devnull, fd)  # the number stays taken: an object here may still close it
    os.close(devnull)


# --- the server -------------------------------------------------------------------------------
def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _run_child(request: dict, replies) -> NoReturn:
    try:
        os.close(replies.fileno())  # the server's, not the command's
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        _redirect(1, request["stdout"])
        _redirect(2, request["stderr"])
        program = Program.parse(request["python"])
        become(program, request["env"], request["cwd"])
    finally:
        os._exit(1)


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
    preload()
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
        pid = fork(request.get("new_session", False))
        if pid == 0:
            _run_child(request, replies)
        statuses[pid] = request["status"]
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
