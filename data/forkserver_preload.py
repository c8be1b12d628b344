"""Imported by the loader's fork server as it starts, and by nothing else: from then on the fork
server exits when the trainer that started it dies (see data/lifetime.py)."""

from data.lifetime import exit_with_parent

exit_with_parent()
