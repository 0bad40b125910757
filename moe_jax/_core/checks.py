"""Trace-time argument checks shared by the public ops.

Every check raises ``ValueError`` (wrong value or shape) or ``TypeError`` (wrong kind or dtype) with a message that
names the argument and says what was expected, so that a bad call fails before any kernel is traced.
"""

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shape_of(name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def check_rank(name: str, x, rank: int, layout: str) -> tuple[int, ...]:
    """Returns ``x.shape`` after checking it has ``rank`` axes; ``layout`` names them, e.g. "[T, E]"."""
    shape = shape_of(name, x)
    if len(shape) != rank:
        raise ValueError(f"{name} must have shape {layout} (rank {rank}), got shape {shape}")
    return shape


def check_dim(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: {what} must be {expected}, got {actual}")


def check_float(name: str, x, allowed: Iterable = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)) -> None:
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {jnp.dtype(x.dtype).name}")


def accumulation_dtype(dtype) -> jnp.dtype:
    """f32 for 16- and 32-bit floats; f64 stays f64 (gradient checks run the reference in float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def check_int32(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {jnp.dtype(x.dtype).name}")


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_positive_int(name: str, value, *, upper: int | None = None, upper_name: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if value < 1 or (upper is not None and value > upper):
        suffix = f" (= {upper})" if upper is not None and upper_name else ""
        bound = f"be in [1, {upper_name or upper}]{suffix}" if upper is not None else "be >= 1"
        raise ValueError(f"{name} must {bound}, got {value}")
    return int(value)


def check_static_bool(name: str, value) -> bool:
    """A Python (or NumPy) bool: options that change what is traced cannot be traced values."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a Python bool, got {type(value).__name__}")
    return bool(value)


def check_static_float(name: str, value) -> float:
    if isinstance(value, jax.Array | np.ndarray) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    return float(value)
