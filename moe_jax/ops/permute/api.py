"""``permute`` / ``combine``: move token rows into expert order and back."""

import jax
import jax.numpy as jnp

from moe_jax._core import backend as dispatch
from moe_jax._core import checks
from moe_jax.ops.permute import reference, sm90_vjp
from moe_jax.ops.permute.config import DTYPES, LANES
from moe_jax.ops.permute.config import supports as kernel_supports


def kernel_unsupported(rows) -> str | None:
    """Why the row-moving kernels cannot move ``rows`` [., D] (None: they can)."""
    if kernel_supports(rows.shape[1], rows.dtype):
        return None
    names = "/".join(jnp.dtype(d).name for d in DTYPES)
    return f"the Pallas kernel needs rows of {names} with D >= {LANES}, got D={rows.shape[1]} and dtype {rows.dtype}"


IMPLEMENTATIONS = (dispatch.Implementation("pallas", kernel_unsupported), dispatch.XLA)


def select(op: str, backend: str, rows) -> str:
    """The implementation ("pallas" or "xla") that ``backend`` selects for moving ``rows`` [., D]."""
    return dispatch.select(op, backend, IMPLEMENTATIONS, rows).name


def _check_sort_indices(sort_indices, num_rows: int, what: str) -> None:
    checks.check_rank("sort_indices", sort_indices, 1, "[M]")
    checks.check_int32("sort_indices", sort_indices)
    checks.check_dim("sort_indices", sort_indices.shape[0], num_rows, what)


def _check_positions(positions, num_tokens: int, top_k: int) -> None:
    if positions is None:
        return
    shape = checks.check_rank("positions", positions, 2, "[T, k]")
    checks.check_int32("positions", positions)
    if shape != (num_tokens, top_k):
        raise ValueError(f"positions must have shape [T, k] = {(num_tokens, top_k)}, got {shape}")


def permute(
    x: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    *,
    positions: jax.Array | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Gathers token rows into expert order.

    Args:
      x: [T, D] tokens.
      sort_indices: [T * k] int32 from ``Routing.sort_indices``.
      top_k: k, the experts per token.
      positions: optional [T, k] int32, the inverse of ``sort_indices`` (``Routing.positions``): the Pallas kernel
        moves rows by it and does not invert ``sort_indices`` (one scatter of T * k int32 less). It must be that
        inverse; entries outside [0, T * k) are clamped into it.
      backend: "auto", "xla" or "pallas".

    Returns:
      [T * k, D]: row p is ``x[sort_indices[p] // top_k]``.

    One-byte rows (FP8 values) with an even D move on the kernel as D / 2 16-bit words (``kernel_rows``).
    """
    num_tokens, d_model = checks.check_rank("x", x, 2, "[T, D]")
    checks.check_positive_int("top_k", top_k)
    _check_sort_indices(sort_indices, num_tokens * top_k, "length (T * top_k)")
    _check_positions(positions, num_tokens, top_k)
    rows = kernel_rows(x)
    if select("permute", backend, rows) == "pallas":
        moved = sm90_vjp.permute(rows, sort_indices, top_k, positions)
        if rows is x:
            return moved
        # (A bitcast has no gradient: only the words of FP8 values, which get none, take this way back.)
        return jax.lax.bitcast_convert_type(moved, x.dtype).reshape(num_tokens * top_k, d_model)
    return reference.permute(x, sort_indices, top_k)


def kernel_rows(x: jax.Array) -> jax.Array:
    """The rows [T, D'] the permute kernel moves for x [T, D]: 1-byte rows with an even D as D / 2 16-bit words (the
    kernel copies bits, it computes nothing), other rows as they are."""
    if jnp.dtype(x.dtype).itemsize == 1 and x.shape[1] % 2 == 0:
        return jax.lax.bitcast_convert_type(x.reshape(x.shape[0], x.shape[1] // 2, 2), jnp.float16)
    return x


def combine(
    y_sorted: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    weights: jax.Array | None = None,
    *,
    num_rows: jax.Array | int | None = None,
    positions: jax.Array | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Sums each token's k expert outputs, weighted by ``weights`` when given.

    Args:
      y_sorted: [T * k, D] expert outputs in expert-sorted order.
      sort_indices: [T * k] int32 from ``Routing.sort_indices``.
      top_k: k, the experts per token.
      weights: optional [T, k] routing weights (omit when they were folded in, e.g. by ``row_scale``).
      num_rows: optional int32 scalar (may be traced): only the first ``num_rows`` rows of y_sorted hold outputs
        (e.g. ``sum(group_sizes)`` of a grouped matmul that left the rest unwritten); an assignment at a later row
        adds zero, whatever that row holds, and its row gets a zero gradient. The Pallas kernel does not read those
        rows.
      positions: optional [T, k] int32, the inverse of ``sort_indices`` (``Routing.positions``): used instead of
        inverting ``sort_indices`` (one scatter of T * k int32 less). It must be that inverse; on the Pallas path
        entries outside [0, T * k) are clamped into it.
      backend: "auto", "xla" or "pallas".

    Returns:
      [T, D] in ``y_sorted.dtype`` (accumulated in f32).
    """
    total_rows, _ = checks.check_rank("y_sorted", y_sorted, 2, "[T * k, D]")
    checks.check_positive_int("top_k", top_k)
    if total_rows % top_k:
        raise ValueError(f"y_sorted: rows must be T * top_k (a multiple of top_k={top_k}), got {total_rows}")
    _check_sort_indices(sort_indices, total_rows, "length (rows of y_sorted)")
    if weights is not None:
        shape = checks.check_rank("weights", weights, 2, "[T, k]")
        if shape != (total_rows // top_k, top_k):
            raise ValueError(f"weights must have shape [T, k] = {(total_rows // top_k, top_k)}, got {shape}")
        checks.check_float("weights", weights)
    if num_rows is not None:
        num_rows = jnp.asarray(num_rows)
        if num_rows.shape != () or not jnp.issubdtype(num_rows.dtype, jnp.integer):
            raise ValueError(f"num_rows must be an integer scalar, got {num_rows.dtype}{list(num_rows.shape)}")
    _check_positions(positions, total_rows // top_k, top_k)
    if select("combine", backend, y_sorted) == "pallas":
        return sm90_vjp.combine(y_sorted, sort_indices, top_k, weights, num_rows, positions)
    return reference.combine(y_sorted, sort_indices, top_k, weights, num_rows, positions)
