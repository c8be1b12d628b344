"""The jax backend: the same torch model lowered to JAX by torchax and compiled by XLA."""

from typing import Any

from accel.backends.jax import backend
from accel.backends.jax.backend import SUPPORTS, JaxBackend, build, context, require

__all__ = ["SUPPORTS", "JaxBackend", "build", "context", "require"]


def __getattr__(name: str) -> Any:
    return getattr(backend, name)
