"""BlockScaled <-> qwix QArray: the conversions keep every number, and grouped_matmul takes QArray operands.

Oracles: qwix's own ``dequantize`` (the numbers a QArray stands for) and a float64 NumPy product of the dequantized
operands.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import moe_jax
from moe_jax.ops.quant.qwix_interop import is_qarray

E4M3 = jnp.float8_e4m3fn


def _random(seed: int, shape, scale: float = 1.0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


@pytest.mark.parametrize(
    ("qtype", "axes", "block_shape", "scale_dtype"),
    [
        (E4M3, dict(channelwise_axes=(0,), tiled_axes={1: 128}), (1, 128), jnp.float32),  # fp8_block activations
        (E4M3, dict(tiled_axes={0: 128, 1: 128}), (128, 128), jnp.float32),  # fp8_block weights
        ("mxfp8", dict(channelwise_axes=(0,), tiled_axes={1: 32}), (1, 32), jnp.float8_e8m0fnu),  # pow2 scales
    ],
)
def test_from_qarray_keeps_the_numbers_qwix_stands_for(qtype, axes, block_shape, scale_dtype):
    x = _random(0, (256, 384), scale=3.0)
    qarray = qwix.quantize(x, qtype, **axes)
    assert is_qarray(qarray)
    block_scaled = moe_jax.from_qarray(qarray)
    assert block_scaled.block_shape == block_shape
    assert block_scaled.scales.dtype == scale_dtype and block_scaled.dtype == E4M3
    np.testing.assert_array_equal(
        np.asarray(block_scaled.dequantize(jnp.float32)), np.asarray(qwix.dequantize(qarray), np.float32)
    )


@pytest.mark.parametrize(("block_shape", "pow2_scales"), [((1, 128), False), ((128, 128), False), ((1, 32), True)])
def test_to_qarray_and_back_is_the_identity(block_shape, pow2_scales):
    x = _random(1, (128, 256), scale=0.05)
    block_scaled = moe_jax.quantize_blockwise(x, block_shape, pow2_scales=pow2_scales)
    qarray = moe_jax.to_qarray(block_scaled)
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qarray)), np.asarray(block_scaled.dequantize()))
    back = moe_jax.from_qarray(qarray)
    assert back.block_shape == block_shape
    np.testing.assert_array_equal(np.asarray(back.values, np.float32), np.asarray(block_scaled.values, np.float32))
    # The qtype of a pow2 BlockScaled's QArray is its value dtype, so its scales come back as f32 of equal value.
    np.testing.assert_array_equal(np.asarray(back.scales, np.float32), np.asarray(block_scaled.scales, np.float32))


def test_grouped_matmul_takes_qarray_operands():
    num_rows, contraction, num_cols = 96, 256, 128
    group_sizes = jnp.asarray([40, 0, 50], jnp.int32)  # an empty group; rows past the sum stay zero
    lhs = qwix.quantize(_random(2, (num_rows, contraction)), E4M3, tiled_axes={0: 1, 1: 128})
    rhs = qwix.quantize(_random(3, (3, contraction, num_cols)), E4M3, tiled_axes={0: 1, 1: 128, 2: 128})
    out = moe_jax.grouped_matmul(
        lhs, rhs, group_sizes, quantization="fp8_block", preferred_element_type=jnp.float32, backend="xla"
    )
    lhs64 = np.asarray(qwix.dequantize(lhs), np.float64)
    rhs64 = np.asarray(qwix.dequantize(rhs), np.float64)
    expected = np.zeros((num_rows, num_cols))
    start = 0
    for group, size in enumerate(np.asarray(group_sizes)):
        expected[start : start + size] = lhs64[start : start + size] @ rhs64[group]
        start += size
    # f32 accumulation of exactly representable products: only the summation order differs.
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_conversion_errors_name_the_problem():
    x = _random(4, (128, 256))
    with pytest.raises(ValueError, match="asymmetric"):
        moe_jax.from_qarray(qwix.quantize(x, jnp.int8, tiled_axes={1: 128}, calibration_method="minmax"))
    with pytest.raises(TypeError, match=r"qarray\.qvalue must be float8"):
        moe_jax.from_qarray(qwix.quantize(x, jnp.int8, tiled_axes={1: 128}))
    partial = moe_jax.quantize_blockwise(_random(5, (128, 200)), (1, 128))
    with pytest.raises(ValueError, match="tile the array"):
        moe_jax.to_qarray(partial)
