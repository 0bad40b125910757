"""Pure-JAX ragged grouped matmul over ``jax.lax.ragged_dot``, with the gated-activation epilogue and row scale.

Glossary: M routed rows, K contraction, N output columns, G groups; with a gated activation N = 2F holds the
``[gate | up]`` halves and the result has F columns.
"""

import jax
import jax.numpy as jnp

from moe_jax._core.checks import accumulation_dtype
from moe_jax.ops.grouped_matmul.glu import glu
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, split_gate_up


def row_mask(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[M] bool: rows below ``sum(group_sizes)``, the ones that belong to a group."""
    return jnp.arange(num_rows) < jnp.sum(group_sizes)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | PackedGateUp,
    group_sizes: jax.Array,
    *,
    activation: str | None = None,
    row_scale: jax.Array | None = None,
    preferred_element_type=None,
    transpose_rhs: bool = False,
) -> jax.Array:
    """Reference for ``moe_jax.grouped_matmul``: lhs [M, K], rhs [G, K, N] (or [G, N, K]) -> [M, N] or [M, N/2].

    A ``PackedGateUp`` rhs is multiplied as it is stored; its GEMM output is split back into gate and up (a view of
    the activations), so the weights are never unpacked.
    """
    group_sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)  # negative sizes count as 0, as in the kernels
    block = None
    if isinstance(rhs, PackedGateUp):
        block, rhs = rhs.block, rhs.array
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=accumulation_dtype(lhs.dtype))
    # ragged_dot leaves rows past the last group unspecified on some backends; the contract says zero.
    out = jnp.where(row_mask(group_sizes, lhs.shape[0])[:, None], out, 0.0)
    return epilogue(out, block, activation, row_scale, preferred_element_type or lhs.dtype)


def epilogue(out: jax.Array, block: int | None, activation: str | None, row_scale, out_dtype) -> jax.Array:
    """The GEMM output [M, N] (f32, or f64) -> the op's result: the GLU over ``[gate | up]`` (packed in blocks of
    ``block`` columns; None: plain halves), the row scale, then the cast to ``out_dtype``."""
    if activation is not None:
        gate, up = split_gate_up(out, block or out.shape[-1] // 2)
        out = glu(gate, up, activation)
    if row_scale is not None:
        out = out * row_scale.astype(out.dtype)[:, None]
    return out.astype(out_dtype)
