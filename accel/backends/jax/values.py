"""torch and JAX values each way for the jax backend: tensors to arrays and back, a torch dtype as
a jnp one, and an AMP level as the dtypes the step computes and stores in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from accel.amp import AmpPolicy
from accel.config import AccelError


def jnp_dtype(dtype: torch.dtype) -> jnp.dtype:
    """The one place a torch dtype becomes a jnp one (JAX refuses torch dtypes in astype)."""
    table = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}
    if dtype not in table:
        raise AccelError(f"the jax backend has no {dtype} floating-point mode")
    return jnp.dtype(table[dtype])


@dataclass(frozen=True)
class Precision:
    """An AMP level in jnp dtypes: what the step computes in, what weights and moments are
    stored in."""

    compute: jnp.dtype
    store: jnp.dtype

    @classmethod
    def of(cls, amp: AmpPolicy) -> Precision:
        low = jnp_dtype(amp.dtype)
        return cls(
            compute=jnp.dtype(jnp.float32) if amp.level == "O0" else low,
            store=low if amp.level == "O3" else jnp.dtype(jnp.float32),
        )


def to_jax(tensor: torch.Tensor, dtype: jnp.dtype | None = None) -> jax.Array:
    value = tensor.detach().cpu()
    array = jnp.asarray(value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy())
    return array if dtype is None else cast_floating(array, dtype)


def host_value(array: jax.Array) -> np.ndarray:
    """A replicated array's value on this host (across processes, the local copy: JAX will
    not fetch arrays that span other hosts' devices)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(array.addressable_data(0))


def to_torch(array: jax.Array) -> torch.Tensor:
    host = host_value(array)
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(host.copy())


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    dtype = jnp.dtype(dtype)  # a torch dtype raises here, not deep inside a trace
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )
