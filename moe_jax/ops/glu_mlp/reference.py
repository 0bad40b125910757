"""The GLU MLP in pure JAX: the unfused MLP (two reference grouped matmuls, differentiated by JAX: the XLA path,
baseline and oracle), and the block-scaled FP8 MLP with the recipe of ``glu_mlp(quantization=...)``'s backward.

The FP8 recipe. The forward is the two quantized grouped matmuls (reference_fp8.py): x and the hidden activations
quantized along their rows, the weights per the recipe, the GLU and the row scale on the f32 products. The backward
is the one the fused kernels run (api.py's module docstring), each GEMM quantized along its contraction:

    e      = q(dy) . q(W_d)^T                    dy quantized before the row scale (1 x 128 along D)
    d_h    = s e;  (h, d_gate, d_up) = GLU'(q(pre)) d_h;  d_s = sum_f h e
    d W_d  = wgrad(h s, dy)                      both in row blocks per group (reference_fp8.quantized_wgrad)
    d x    = q(d_gate_up) . q(W_gu)^T;  d W_gu = wgrad(x, d_gate_up)

with d_gate_up and h s rounded to x's dtype, as the kernels write them, and the pre-activation kept for the backward
in x's dtype and quantized along its rows (1 x 128 of the packed gate/up columns; DeepSeek-V3 caches its SwiGLU
inputs in FP8 alike): the GLU backward runs on its values dequantized in f32. It differs from differentiating the
composition of two quantized ``grouped_matmul`` calls only in where the row scale meets the down GEMM's quantized
gradient operands (dy rather than s dy; h s rather than h): the same straight-through gradient, quantized at other
points.
"""

import functools

import jax
import jax.numpy as jnp

from moe_jax.ops.grouped_matmul import reference, reference_fp8
from moe_jax.ops.grouped_matmul.glu import glu
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, split_gate_up
from moe_jax.ops.quant.reference import BlockScaled


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


def quantized_glu_mlp(
    x: jax.Array,
    w_gate_up: jax.Array | BlockScaled | PackedGateUp,
    w_down: jax.Array | BlockScaled,
    group_sizes: jax.Array,
    *,
    activation: str,
    quantization: str,
    row_scale: jax.Array | None = None,
    gemms: reference_fp8.Gemms = reference_fp8.XLA_GEMMS,
) -> jax.Array:
    """Reference for ``moe_jax.glu_mlp(quantization=...)``: x [M, D] high precision; the weights [G, D, 2F] and
    [G, F, D] high precision or BlockScaled (no gradient); row_scale [M] or None -> [M, D] in x.dtype, with the FP8
    recipe's gradients (the module docstring); every GEMM's dequantized operands multiplied by ``gemms``."""
    recipe = reference_fp8.RECIPES[quantization]
    weights, block = reference_fp8.stored_weights(w_gate_up, activation, False)
    group_sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    return _quantized_mlp(x, weights, w_down, group_sizes, row_scale, block, activation, recipe, gemms)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _quantized_mlp(x, w_gate_up, w_down, group_sizes, row_scale, block, activation, recipe, gemms):
    return _quantized_mlp_fwd(x, w_gate_up, w_down, group_sizes, row_scale, block, activation, recipe, gemms)[0]


def _quantized_mlp_fwd(x, w_gate_up, w_down, group_sizes, row_scale, block, activation, recipe, gemms):
    pre, w_gate_up_q = reference_fp8.quantized_forward(x, w_gate_up, group_sizes, recipe, False, gemms)
    hidden = reference.epilogue(pre, block, activation, None, x.dtype)
    out, w_down_q = reference_fp8.quantized_forward(hidden, w_down, group_sizes, recipe, False, gemms)
    y = reference.epilogue(out, None, None, row_scale, x.dtype)
    # The pre-activation is kept as the kernels keep it: written in x's dtype, then quantized along its rows.
    kept_pre = reference_fp8.quantize(pre.astype(x.dtype), recipe.lhs_block, recipe)
    return y, (x, w_gate_up, w_gate_up_q, w_down, w_down_q, group_sizes, row_scale, kept_pre)


def _quantized_mlp_bwd(block, activation, recipe, gemms, residuals, d_y):
    x, w_gate_up, w_gate_up_q, w_down, w_down_q, group_sizes, row_scale, kept_pre = residuals
    pre = kept_pre.dequantize(jnp.float32)  # as the GLU-backward kernel's epilogue dequantizes it
    dgrad = functools.partial(reference_fp8.quantized_dgrad, recipe=recipe, transpose_rhs=False, gemms=gemms)
    wgrad = functools.partial(reference_fp8.quantized_wgrad, recipe=recipe, transpose_rhs=False, gemms=gemms)
    down_weights = reference_fp8.dgrad_weights(w_down, w_down_q, recipe, False)
    e = dgrad(down_weights, group_sizes, d_y, out_dtype=jnp.float32)
    scale = jnp.ones((x.shape[0], 1), jnp.float32) if row_scale is None else row_scale.astype(jnp.float32)[:, None]
    hidden, glu_vjp = jax.vjp(lambda p: glu(*split_gate_up(p, block or p.shape[1] // 2), activation), pre)
    d_gate_up = glu_vjp(e * scale)[0].astype(x.dtype)
    hidden_scaled = (hidden * scale).astype(x.dtype)
    d_row_scale = None if row_scale is None else jnp.sum(hidden * e, axis=1).astype(row_scale.dtype)
    gate_up_weights = reference_fp8.dgrad_weights(w_gate_up, w_gate_up_q, recipe, False)
    d_x = dgrad(gate_up_weights, group_sizes, d_gate_up, out_dtype=x.dtype)
    d_w_gate_up = d_w_down = None
    if not isinstance(w_gate_up, BlockScaled):
        d_w_gate_up = wgrad(x, group_sizes, d_gate_up, out_dtype=w_gate_up.dtype)
    if not isinstance(w_down, BlockScaled):
        d_w_down = wgrad(hidden_scaled, group_sizes, d_y, out_dtype=w_down.dtype)
    return d_x, d_w_gate_up, d_w_down, None, d_row_scale


_quantized_mlp.defvjp(_quantized_mlp_fwd, _quantized_mlp_bwd)
