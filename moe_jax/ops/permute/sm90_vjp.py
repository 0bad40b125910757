"""``permute`` / ``combine`` on the sm90 kernels, with their backward passes as ``custom_vjp``.

The kernels address rows by token through ``positions`` (the inverse of ``sort_indices``), so each op first inverts
the permutation: one scatter of T * k int32 in XLA, which XLA shares between a permute and a combine of the same
routing inside one jit. The backward of one op is the other kernel:

  permute   fwd scatter_rows(x)               bwd dx = gather_rows(dout)             (a plain sum of the k rows)
  combine   fwd gather_rows(y_sorted, w)      bwd dy_sorted, dw = scatter_rows(dy, w, dot_rows=y_sorted)
"""

import jax
import jax.numpy as jnp

from moe_jax._core.hardware import interpret_params
from moe_jax.ops.permute import reference, sm90
from moe_jax.ops.permute.config import heuristic_config


def token_positions(sort_indices: jax.Array, top_k: int) -> jax.Array:
    """[T, k] int32: the expert-sorted row of each assignment (``reference.inverse_permutation``, by token)."""
    return reference.inverse_permutation(sort_indices).reshape(-1, top_k)


@jax.custom_vjp
def _permute(x: jax.Array, positions: jax.Array) -> jax.Array:
    config = heuristic_config(x.shape[1], x.dtype)
    return sm90.scatter_rows(x, positions, config=config, interpret=interpret_params())


def _permute_fwd(x, positions):
    return _permute(x, positions), positions


def _permute_bwd(positions, d_rows):
    config = heuristic_config(d_rows.shape[1], d_rows.dtype)
    return sm90.gather_rows(d_rows, positions, config=config, interpret=interpret_params()), None


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x: jax.Array, sort_indices: jax.Array, top_k: int) -> jax.Array:
    """[T, D] -> [T * k, D]: row p is ``x[sort_indices[p] // top_k]`` (see ``moe_jax.ops.permute.api.permute``)."""
    return _permute(x, token_positions(sort_indices, top_k))


@jax.custom_vjp
def _combine(y_sorted: jax.Array, positions: jax.Array) -> jax.Array:
    config = heuristic_config(y_sorted.shape[1], y_sorted.dtype)
    return sm90.gather_rows(y_sorted, positions, config=config, interpret=interpret_params())


def _combine_fwd(y_sorted, positions):
    return _combine(y_sorted, positions), positions


def _combine_bwd(positions, dy):
    config = heuristic_config(dy.shape[1], dy.dtype)
    return sm90.scatter_rows(dy, positions, config=config, interpret=interpret_params()), None


_combine.defvjp(_combine_fwd, _combine_bwd)


@jax.custom_vjp
def _combine_weighted(y_sorted: jax.Array, positions: jax.Array, weights: jax.Array) -> jax.Array:
    config = heuristic_config(y_sorted.shape[1], y_sorted.dtype)
    return sm90.gather_rows(
        y_sorted, positions, weights.astype(jnp.float32), config=config, interpret=interpret_params()
    )


def _combine_weighted_fwd(y_sorted, positions, weights):
    return _combine_weighted(y_sorted, positions, weights), (y_sorted, positions, weights)


def _combine_weighted_bwd(residuals, dy):
    y_sorted, positions, weights = residuals
    config = heuristic_config(dy.shape[1], dy.dtype)
    d_sorted, d_weights = sm90.scatter_rows(
        dy, positions, weights.astype(jnp.float32), dot_rows=y_sorted, config=config, interpret=interpret_params()
    )
    return d_sorted, None, d_weights.astype(weights.dtype)


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


def combine(y_sorted: jax.Array, sort_indices: jax.Array, top_k: int, weights: jax.Array | None = None) -> jax.Array:
    """[T * k, D] -> [T, D]: ``y_t = sum_j w_tj * y_sorted[pos(t, j)]`` (see ``moe_jax.ops.permute.api.combine``)."""
    positions = token_positions(sort_indices, top_k)
    if weights is None:
        return _combine(y_sorted, positions)
    return _combine_weighted(y_sorted, positions, weights)
