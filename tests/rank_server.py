"""The ranks' fork server's one preload (helpers.RANK_PRELOAD), imported by nothing else: what
every process forked from the server needs, imported once, one module at a time, each checked
to have started no thread; then the objects they made frozen.

The server forks without exec, which is safe only while it runs no thread but its own
(tests/forking.py). torch, timm, accel's command line and the suite's helpers start none as they
are imported. torch_xla and JAX start none either until their runtimes do, but each carries a
whole XLA of its own (its allocators, thread pools and static state, two copies side by side),
and a rank of eager or compile needs neither: a forked process that runs xla or jax imports
it itself (about 1.5 s and 0.4 s of CPU). An import that leaves a thread running is named in
REFUSED, and every process forked from here then refuses to run (helpers.run_forked).

gc.freeze: a rank forked from the server shares those objects' pages with it until it writes
one, and a collection writes to every object it walks: without this, each full collection in a
rank (automatic, or the one destroy_process_group makes) copies the server's pages and walks its
300,000 objects, about 0.15 s of CPU each time. Python's own advice for a process that forks
without exec (the gc module's documentation, gc.freeze)."""

import gc
import importlib
import os

from tests.forking import thread_names

# numpy's OpenBLAS starts a pool of threads as it loads, one a core beyond the first, unless
# told one thread (which the suite's workers' OMP_NUM_THREADS=1 tells it too): the server's
# numpy does no linear algebra, and a forked process's OpenBLAS is the server's.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

IMPORTS = ("torch", "timm", "accel.cli.launch", "accel.cli.train", "tests.helpers")
REFUSED = ""  # the first import that left a thread running, and the threads

for name in IMPORTS:
    importlib.import_module(name)
    running = thread_names()
    if len(running) > 1 and not REFUSED:
        REFUSED = f"importing {name} in the fork server started threads ({', '.join(running)})"

gc.freeze()
