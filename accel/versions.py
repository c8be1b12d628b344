"""The one place the project asks which version of a library it runs with."""

from __future__ import annotations

import importlib.metadata

import torch


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string ('2.13.0+cpu' -> (2, 13))."""
    major, minor, *_ = version.split("+")[0].split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCH = release(torch.__version__)


def installed(package: str) -> str | None:
    """A distribution's version, or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


STACK = ("torch", "torchvision", "timm", "torch_xla", "jax", "torchax", "optax")


def stack() -> dict[str, str]:
    """The versions of the libraries a run's numbers depend on, those installed."""
    return {name: v for name in STACK if (v := installed(name))}


# torch 2.13 removed named tensors and their ATen overloads (pytorch/pytorch#173895); later
# releases removed more ops that torchax 0.0.13 still names.
OPS_REMOVED = TORCH >= (2, 13)
