"""Imported by a loader's fork server after torch (workers/fork_server.py's preload), and by nothing
else: the script that started the server, imported here once as each worker would import it
(as `__mp_main__`, with the script's sys.path and argv), so that the workers forked from here
find it imported and do not run it again."""

import contextlib
import json
import os
import runpy
import sys
import types
from multiprocessing import spawn

from accel.workers import fork_server


def import_main(script: dict) -> None:
    sys.path[:] = script["sys_path"]
    argv, sys.argv = sys.argv, script["sys_argv"]
    fork_server.importing_main = True
    try:
        name = script.get("init_main_from_name")
        if name is None:
            spawn.import_main_path(script["init_main_from_path"])
        else:  # what multiprocessing.spawn does in a worker for a script run by `python -m`
            module = types.ModuleType("__mp_main__")
            module.__dict__.update(runpy.run_module(name, run_name="__mp_main__", alter_sys=True))
            sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    finally:
        fork_server.importing_main = False
        sys.argv = argv


# Taken out of the environment first: a process the script starts as it is imported here does
# not import it again.
script = os.environ.pop(fork_server.MAIN, None)
if script is not None:
    # Where it fails, each worker imports the script itself, as without this, and says why.
    with contextlib.suppress(Exception, SystemExit):
        import_main(json.loads(script))
