"""Imported by the loader's fork server as it starts (first, before torch), and by nothing else:
from then on the fork server exits when the trainer that started it dies (workers/lifetime.py)."""

import os

from accel.workers.lifetime import PARENT, exit_with_parent

exit_with_parent(parent=int(os.environ[PARENT]) if PARENT in os.environ else None)
