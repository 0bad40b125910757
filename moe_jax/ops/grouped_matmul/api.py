"""``moe_jax.grouped_matmul``: a drop-in for ``jax.lax.ragged_dot`` with a gated-activation epilogue."""

import jax
import jax.numpy as jnp

from moe_jax._core import checks
from moe_jax._core.backend import resolve_backend
from moe_jax.ops.grouped_matmul import reference
from moe_jax.ops.grouped_matmul.reference import ACTIVATIONS

OUTPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_grouped_matmul_args(
    lhs, rhs, group_sizes, *, activation, row_scale, preferred_element_type, transpose_rhs
) -> tuple[int, int, int, int]:
    """Validates the arguments of ``grouped_matmul``; returns (M, K, N, G)."""
    num_rows, contraction = checks.check_rank("lhs", lhs, 2, "[M, K]")
    rhs_layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    num_groups, *rhs_dims = checks.check_rank("rhs", rhs, 3, rhs_layout)
    rhs_contraction, num_cols = reversed(rhs_dims) if transpose_rhs else rhs_dims
    if rhs_contraction != contraction:
        raise ValueError(
            f"rhs must have shape {rhs_layout} with K={contraction} (from lhs [M, K]), got shape {rhs.shape}"
        )
    checks.check_rank("group_sizes", group_sizes, 1, "[G]")
    checks.check_int32("group_sizes", group_sizes)
    checks.check_dim("group_sizes", group_sizes.shape[0], num_groups, "length (G, rhs.shape[0])")
    checks.check_float("lhs", lhs)
    checks.check_float("rhs", rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if activation is not None:
        checks.check_choice("activation", activation, (None, *ACTIVATIONS))
        if num_cols % 2:
            raise ValueError(
                f"rhs: with activation={activation!r} N holds [gate | up] and must be even, got {num_cols}"
            )
    if row_scale is not None:
        checks.check_rank("row_scale", row_scale, 1, "[M]")
        checks.check_dim("row_scale", row_scale.shape[0], num_rows, "length (M, lhs.shape[0])")
        checks.check_float("row_scale", row_scale)
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) not in map(jnp.dtype, OUTPUT_DTYPES):
        raise TypeError(
            f"preferred_element_type must be one of float32, bfloat16, float16 or None, got {preferred_element_type}"
        )
    return num_rows, contraction, num_cols, num_groups


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str | None = None,
    row_scale: jax.Array | None = None,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """Ragged grouped matmul: rows ``[offset_g, offset_g + group_sizes[g])`` of ``lhs`` multiply ``rhs[g]``.

    Args:
      lhs: [M, K] rows sorted by group.
      rhs: [G, K, N] weights, or [G, N, K] (K-major) with ``transpose_rhs=True``; same dtype as lhs.
      group_sizes: [G] int32 rows per group; rows at or past ``sum(group_sizes)`` give zeros.
      activation: None, or "swiglu" / "geglu" / "gpt_oss": N holds ``[gate | up]`` (F = N/2 each) and the result is
        ``act(gate) * up`` of shape [M, F] (see DESIGN §3 for gpt_oss's clamp).
      row_scale: optional [M] float multiplying each output row (routing weights folded into the down projection).
      preferred_element_type: output dtype (default: lhs.dtype); accumulation is always f32.
      transpose_rhs: rhs is laid out [G, N, K].
      backend: "auto", "xla" or "pallas".

    Returns:
      [M, N], or [M, N/2] with an activation.
    """
    check_grouped_matmul_args(
        lhs,
        rhs,
        group_sizes,
        activation=activation,
        row_scale=row_scale,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
    )
    resolve_backend(backend, op="grouped_matmul", has_kernel=False)
    return reference.grouped_matmul(
        lhs,
        rhs,
        group_sizes.astype(jnp.int32),
        activation=activation,
        row_scale=row_scale,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
    )
