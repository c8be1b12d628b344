"""add, mul and div for the jax backend with torch's result dtypes: torchax makes the result of an
op with a Python number float32 whatever the tensor's dtype (a bf16 activation times a scale
became float32, and every matmul after it ran in float32); here torch's rule: a number or a
0-dim tensor keeps the tensor's dtype within its kind (bool < integer < floating). add's
alpha=1 multiplies nothing. ops.py puts them in torchax's table.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def kind(dtype: Any) -> int:
    """torch's categories of dtypes: bool 0, integer 1, floating 2, complex 3."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return 0
    if jnp.issubdtype(dtype, jnp.integer):
        return 1
    return 3 if jnp.issubdtype(dtype, jnp.complexfloating) else 2


def combine(higher: Any, lower: Any) -> Any:
    """torch's combine_categories: the higher-priority group's dtype, unless the lower's is of
    a higher kind (then the two promoted)."""
    if higher is None or lower is None:
        return lower if higher is None else higher
    if kind(higher) >= 2 and kind(higher) >= kind(lower):
        return higher
    if kind(lower) > kind(higher) or kind(higher) == 0:
        return jnp.promote_types(higher, lower)
    return higher


def torch_result_dtype(*operands: Any) -> Any:
    """The dtype torch gives a binary op's result: tensors of rank above 0 first, then 0-dim
    tensors, then Python numbers (a float as the default float32)."""
    groups: list[Any] = [None, None, None]
    for value in operands:
        if isinstance(value, bool | int | float | complex):
            default = {bool: jnp.bool_, int: jnp.int32, float: jnp.float32}
            dtype, group = jnp.dtype(default.get(type(value), jnp.complex64)), 2
        else:
            dtype, group = jnp.dtype(value.dtype), 0 if value.ndim else 1
        groups[group] = dtype if groups[group] is None else jnp.promote_types(groups[group], dtype)
    return jax.dtypes.canonicalize_dtype(combine(groups[0], combine(groups[1], groups[2])))


def as_dtype(value: Any, dtype: Any) -> Any:
    return value if isinstance(value, bool | int | float | complex) else value.astype(dtype)


def mul(x: Any, y: Any) -> jax.Array:
    dtype = torch_result_dtype(x, y)
    return jnp.multiply(as_dtype(x, dtype), as_dtype(y, dtype)).astype(dtype)


def add(x: Any, y: Any, *, alpha: Any = 1) -> jax.Array:
    dtype = torch_result_dtype(x, y)
    y = y if alpha == 1 else y * alpha
    return jnp.add(as_dtype(x, dtype), as_dtype(y, dtype)).astype(dtype)


def div(x: Any, y: Any, rounding_mode: str | None = None) -> jax.Array:
    dtype = torch_result_dtype(x, y)
    x, y = as_dtype(x, dtype), as_dtype(y, dtype)
    if rounding_mode == "floor":
        return jnp.floor_divide(x, y)
    if rounding_mode == "trunc":
        truncated = jnp.trunc(jnp.true_divide(x, y))
        return truncated.astype(dtype) if kind(dtype) < 2 else truncated
    quotient = jnp.true_divide(x, y)  # true division of integers: the default float
    return quotient if kind(dtype) < 2 else quotient.astype(dtype)
