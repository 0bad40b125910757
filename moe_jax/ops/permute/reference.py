"""Pure-JAX token permutation into expert order and the combine back to token order.

M = T * k routed rows. ``sort_indices[p]`` is the flat assignment ``t * k + j`` at expert-sorted position ``p``.
"""

import jax
import jax.numpy as jnp

from moe_jax._core.checks import accumulation_dtype


def permute(x: jax.Array, sort_indices: jax.Array, top_k: int) -> jax.Array:
    """[T, D] tokens -> [M, D] rows in expert order (row p is token ``sort_indices[p] // top_k``)."""
    return x[sort_indices // top_k]


def inverse_permutation(sort_indices: jax.Array) -> jax.Array:
    """[M] int32: the expert-sorted position of each flat assignment (the inverse of ``sort_indices``).

    Indices outside [0, M) are dropped, so every position is in range whatever ``sort_indices`` holds: the kernels
    index memory with these positions and never leave their buffers.
    """
    positions = jnp.arange(sort_indices.shape[0], dtype=jnp.int32)
    return jnp.zeros_like(positions).at[sort_indices].set(positions, unique_indices=True, mode="drop")


def combine(
    y_sorted: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    weights: jax.Array | None = None,
    num_rows=None,
    positions=None,
) -> jax.Array:
    """[M, D] expert-sorted outputs -> [T, D] with ``y_t = sum_j w_tj * y_sorted[pos(t, j)]``.

    Without ``weights`` ([T, k]) the k rows of a token are summed as they are (weights already folded in). With
    ``num_rows``, assignments at rows ``pos >= num_rows`` add zero (selected away, whatever those rows hold).
    ``positions`` [T, k], when given, is ``pos`` (the inverse of ``sort_indices``). Accumulates in f32 and returns
    ``y_sorted.dtype``.
    """
    total_rows, d_model = y_sorted.shape
    acc_dtype = accumulation_dtype(y_sorted.dtype)
    positions = inverse_permutation(sort_indices) if positions is None else positions.reshape(-1)
    per_assignment = y_sorted[positions].astype(acc_dtype)
    if num_rows is not None:
        per_assignment = jnp.where((positions < num_rows)[:, None], per_assignment, 0)
    per_assignment = per_assignment.reshape(total_rows // top_k, top_k, d_model)
    if weights is not None:
        per_assignment = per_assignment * weights.astype(acc_dtype)[..., None]
    return per_assignment.sum(1).astype(y_sorted.dtype)
