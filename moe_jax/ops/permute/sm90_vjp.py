"""``permute`` / ``combine`` on the sm90 kernels, with their backward passes as ``custom_vjp``.

The kernels address rows by token through ``positions`` (the inverse of ``sort_indices``): an op takes them from the
caller (``Routing.positions``) or first inverts the permutation, one scatter of T * k int32 in XLA, which XLA shares
between a permute and a combine of the same routing inside one jit. The backward of one op is the other kernel:

  permute   fwd scatter_rows(x)               bwd dx = gather_rows(dout)             (a plain sum of the k rows)
  combine   fwd gather_rows(y_sorted, w)      bwd dy_sorted, dw = scatter_rows(dy, w, dot_rows=y_sorted)

A combine over the first ``num_rows`` rows marks the other assignments absent in ``positions``: its forward does not
read their rows, its backward writes them zero gradients.
"""

import jax
import jax.numpy as jnp

from moe_jax._core.hardware import interpret_params
from moe_jax.ops.permute import reference, sm90
from moe_jax.ops.permute.config import heuristic_config


def token_positions(sort_indices: jax.Array, top_k: int, num_rows=None, positions=None) -> jax.Array:
    """[T, k] int32: the expert-sorted row of each assignment (``reference.inverse_permutation``, by token), or the
    caller's ``positions`` [T, k] (``Routing.positions``) clamped into [0, T * k) (the kernels address memory with
    them; the clamp fuses into the op that made them); with ``num_rows``, a row p at or past it is absent, ``-1 - p``
    (sm90.py)."""
    if positions is None:
        positions = reference.inverse_permutation(sort_indices).reshape(-1, top_k)
    else:
        positions = jnp.clip(positions, 0, sort_indices.shape[0] - 1)
    return positions if num_rows is None else jnp.where(positions < num_rows, positions, -1 - positions)


def _scatter(rows, positions, weights=None, dot_rows=None):
    """``sm90.scatter_rows`` at the heuristic config of ``rows``' width and dtype."""
    config = heuristic_config(rows.shape[1], rows.dtype, "scatter_rows")
    return sm90.scatter_rows(rows, positions, weights, dot_rows, config=config, interpret=interpret_params())


def _gather(rows, positions, weights=None):
    """``sm90.gather_rows`` at the heuristic config of ``rows``' width and dtype."""
    config = heuristic_config(rows.shape[1], rows.dtype, "gather_rows")
    return sm90.gather_rows(rows, positions, weights, config=config, interpret=interpret_params())


def _row_move(move, transpose):
    """``move(rows, positions)`` as a ``custom_vjp`` whose backward is the linear map's transpose, the other kernel."""

    @jax.custom_vjp
    def moved(rows, positions):
        return move(rows, positions)

    def moved_fwd(rows, positions):
        return move(rows, positions), positions

    def moved_bwd(positions, d_moved):
        return transpose(d_moved, positions), None

    moved.defvjp(moved_fwd, moved_bwd)
    return moved


_permute = _row_move(_scatter, _gather)
_combine = _row_move(_gather, _scatter)


def permute(x: jax.Array, sort_indices: jax.Array, top_k: int, positions=None) -> jax.Array:
    """[T, D] -> [T * k, D]: row p is ``x[sort_indices[p] // top_k]`` (see ``moe_jax.ops.permute.api.permute``)."""
    return _permute(x, token_positions(sort_indices, top_k, positions=positions))


@jax.custom_vjp
def _combine_weighted(y_sorted: jax.Array, positions: jax.Array, weights: jax.Array) -> jax.Array:
    return _gather(y_sorted, positions, weights.astype(jnp.float32))


def _combine_weighted_fwd(y_sorted, positions, weights):
    return _combine_weighted(y_sorted, positions, weights), (y_sorted, positions, weights)


def _combine_weighted_bwd(residuals, dy):
    y_sorted, positions, weights = residuals
    d_sorted, d_weights = _scatter(dy, positions, weights.astype(jnp.float32), dot_rows=y_sorted)
    return d_sorted, None, d_weights.astype(weights.dtype)


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


def combine(
    y_sorted: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    weights: jax.Array | None = None,
    num_rows=None,
    positions=None,
) -> jax.Array:
    """[T * k, D] -> [T, D]: ``y_t = sum_j w_tj * y_sorted[pos(t, j)]`` over the rows before ``num_rows`` (see
    ``moe_jax.ops.permute.api.combine``)."""
    positions = token_positions(sort_indices, top_k, num_rows, positions)
    if weights is None:
        return _combine(y_sorted, positions)
    return _combine_weighted(y_sorted, positions, weights)
