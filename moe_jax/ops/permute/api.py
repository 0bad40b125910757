"""``permute`` / ``combine``: move token rows into expert order and back."""

import jax

from moe_jax._core import checks
from moe_jax._core.backend import resolve_backend
from moe_jax.ops.permute import reference


def _check_sort_indices(sort_indices, num_rows: int, what: str) -> None:
    checks.check_rank("sort_indices", sort_indices, 1, "[M]")
    checks.check_int32("sort_indices", sort_indices)
    checks.check_dim("sort_indices", sort_indices.shape[0], num_rows, what)


def permute(x: jax.Array, sort_indices: jax.Array, top_k: int, *, backend: str = "auto") -> jax.Array:
    """Gathers token rows into expert order.

    Args:
      x: [T, D] tokens.
      sort_indices: [T * k] int32 from ``Routing.sort_indices``.
      top_k: k, the experts per token.
      backend: "auto", "xla" or "pallas".

    Returns:
      [T * k, D]: row p is ``x[sort_indices[p] // top_k]``.
    """
    num_tokens, _ = checks.check_rank("x", x, 2, "[T, D]")
    checks.check_positive_int("top_k", top_k)
    _check_sort_indices(sort_indices, num_tokens * top_k, "length (T * top_k)")
    resolve_backend(backend, op="permute", has_kernel=False)
    return reference.permute(x, sort_indices, top_k)


def combine(
    y_sorted: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    weights: jax.Array | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """Sums each token's k expert outputs, weighted by ``weights`` when given.

    Args:
      y_sorted: [T * k, D] expert outputs in expert-sorted order.
      sort_indices: [T * k] int32 from ``Routing.sort_indices``.
      top_k: k, the experts per token.
      weights: optional [T, k] routing weights (omit when they were folded in, e.g. by ``row_scale``).
      backend: "auto", "xla" or "pallas".

    Returns:
      [T, D] in ``y_sorted.dtype`` (accumulated in f32).
    """
    num_rows, _ = checks.check_rank("y_sorted", y_sorted, 2, "[T * k, D]")
    checks.check_positive_int("top_k", top_k)
    if num_rows % top_k:
        raise ValueError(f"y_sorted: rows must be T * top_k (a multiple of top_k={top_k}), got {num_rows}")
    _check_sort_indices(sort_indices, num_rows, "length (rows of y_sorted)")
    if weights is not None:
        shape = checks.check_rank("weights", weights, 2, "[T, k]")
        if shape != (num_rows // top_k, top_k):
            raise ValueError(f"weights must have shape [T, k] = {(num_rows // top_k, top_k)}, got {shape}")
    resolve_backend(backend, op="combine", has_kernel=False)
    return reference.combine(y_sorted, sort_indices, top_k, weights)
