"""The worker processes a script's DataLoaders start: a fork server that imports torch and the
script once (fork_server.py), and workers that exit when their parent dies (lifetime.py)."""
