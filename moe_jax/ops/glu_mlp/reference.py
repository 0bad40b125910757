"""The unfused GLU MLP: two reference grouped matmuls, differentiated by JAX (the XLA path, baseline and oracle)."""

import jax

from moe_jax.ops.grouped_matmul import reference
from moe_jax.ops.grouped_matmul.packing import PackedGateUp


def glu_mlp(
    x: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """Reference for ``moe_jax.glu_mlp``: x [M, D] -> hidden [M, F] in x.dtype -> [M, D] in x.dtype."""
    hidden = reference.grouped_matmul(x, w_gate_up, group_sizes, activation=activation)
    return reference.grouped_matmul(hidden, w_down, group_sizes, row_scale=row_scale)
