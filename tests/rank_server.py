"""Imported last by the ranks' fork server (helpers.RANK_PRELOAD), and by nothing else: the
objects its imports made are frozen (gc.freeze), so that no rank's garbage collection walks them.

A rank forked from the server shares those objects' pages with it until it writes one, and a
collection writes to every object it walks: without this, each full collection in a rank
(automatic, or the one destroy_process_group makes) copies the server's pages and walks its
300,000 objects, about 0.15 s of CPU each time. Python's own advice for a process that forks
without exec (the gc module's documentation, gc.freeze)."""

import gc

gc.freeze()
