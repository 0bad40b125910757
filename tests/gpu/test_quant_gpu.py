"""The sm90 quantizer kernels on the device against the XLA reference on the same device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py``. Both compute each block
with the same f32 operations (IEEE products and one IEEE division per block, a round-to-nearest-even cast to FP8),
so values and scales must be equal bit for bit; only a NaN's sign bit may differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.quant import reference
from moe_jax.ops.quant.api import (
    quantize_blockwise,
    quantize_blockwise_with_transpose,
    quantize_row_blocks_transposed,
    quantize_square_blocks,
)

pytestmark = pytest.mark.gpu

E4M3 = jnp.float8_e4m3fn


def _random(seed: int, shape, dtype) -> jax.Array:
    key, spread = jax.random.split(jax.random.key(seed))
    # Values across 16 binades, so that blocks hit FP8 subnormals and every exponent.
    x = jax.random.normal(key, shape, jnp.float32) * 2.0 ** jax.random.uniform(spread, shape, minval=-8, maxval=8)
    return x.astype(dtype)


def _assert_same_bits(actual, expected) -> None:
    """Equal bits, but for the sign of a NaN (each side makes its own NaN)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(actual.astype(np.float32)), nan)
    bits = f"u{actual.dtype.itemsize}"  # an unsigned integer as wide as an element
    np.testing.assert_array_equal(actual.view(bits)[~nan], expected.view(bits)[~nan])


def _assert_same(actual, expected) -> None:
    assert actual.block_shape == expected.block_shape
    _assert_same_bits(actual.values, expected.values)
    _assert_same_bits(actual.scales, expected.scales)


# (M, K, block, x dtype, FP8 dtype, pow2_scales): the benchmark models' widths (7168, 2880: a partial block, 768),
# M off a multiple of 8, f32 / f16 inputs, e5m2, MXFP8.
CASES = [
    (8192, 7168, 128, jnp.bfloat16, E4M3, False),
    (4100, 2880, 128, jnp.bfloat16, E4M3, False),
    (16384, 768, 32, jnp.bfloat16, E4M3, True),
    (3000, 2048, 128, jnp.float32, jnp.float8_e5m2, True),
    (2048, 4096, 32, jnp.float16, E4M3, False),
]


@pytest.mark.parametrize("rows, cols, block, x_dtype, dtype, pow2_scales", CASES)
def test_kernel_matches_reference(rows, cols, block, x_dtype, dtype, pow2_scales):
    x = _random(rows + cols, (rows, cols), x_dtype)

    def quantize(x, backend):
        return quantize_blockwise(x, (1, block), dtype=dtype, pow2_scales=pow2_scales, backend=backend)

    _assert_same(jax.jit(quantize, static_argnums=1)(x, "pallas"), jax.jit(quantize, static_argnums=1)(x, "xla"))


@pytest.mark.parametrize("rows, cols, block, pow2_scales", [(8192, 7168, 128, False), (4096, 2880, 32, True)])
def test_transposed_copy_matches_reference(rows, cols, block, pow2_scales):
    x = _random(rows * cols, (rows, cols), jnp.bfloat16)

    def quantize(x, backend):
        return quantize_blockwise_with_transpose(x, block, pow2_scales=pow2_scales, backend=backend)

    kernel = jax.jit(quantize, static_argnums=1)(x, "pallas")
    expected = jax.jit(quantize, static_argnums=1)(x, "xla")
    for actual, wanted in zip(kernel, expected, strict=True):
        _assert_same(actual, wanted)


def test_zero_and_non_finite_blocks_match_reference():
    x = np.array(_random(0, (1024, 1024), jnp.float32))
    x[3] = 0.0
    x[:, 130] = 0.0
    x[5, 7], x[9, 200], x[64, 255], x[700, 900] = np.nan, np.inf, -np.inf, 3e38
    x = jnp.asarray(x)
    kernel = jax.jit(lambda x: quantize_blockwise_with_transpose(x, backend="pallas"))(x)
    for actual, wanted in zip(kernel, (x, x.T), strict=True):
        _assert_same(actual, jax.jit(lambda a: reference.quantize_blockwise(a, (1, 128), E4M3, False))(wanted))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_dequantize_in_the_same_program_keeps_the_rounding(backend):
    """Quantize and dequantize under one jit equal the two run apart: XLA:GPU must not fold the FP8 round trip of the
    XLA quantizer into the identity (BlockScaled.dequantize's barrier)."""
    x = _random(7, (1024, 1024), jnp.bfloat16)

    def quantize(x):
        return quantize_blockwise(x, (1, 128), backend=backend)

    fused = jax.jit(lambda x: quantize(x).dequantize())(x)
    apart = jax.jit(lambda q: q.dequantize())(jax.jit(quantize)(x))
    _assert_same_bits(fused, apart)
    # e4m3 keeps 3 fraction bits: most bf16 inputs (7 bits) change.
    assert float(jnp.mean((fused != x.astype(jnp.float32)).astype(jnp.float32))) > 0.5


# Weights [G, A, B] in 128 x 128 blocks: Qwen3-30B-A3B's w_gate_up and w_down (both copies), a partial tile along both
# axes with f32 input and power-of-two scales.
SQUARE_CASES = [
    ((128, 2048, 1536), jnp.bfloat16, False),
    ((128, 768, 2048), jnp.bfloat16, False),
    ((3, 2880, 320), jnp.float32, False),
]


@pytest.mark.parametrize("shape, w_dtype, pow2_scales", SQUARE_CASES)
def test_square_blocks_match_reference(shape, w_dtype, pow2_scales):
    w = np.array(_random(sum(shape), shape, jnp.float32))
    w[0, :128, :128] = 0.0
    w[1, 5, 7], w[1, 300, 200] = np.nan, np.inf
    w = jnp.asarray(w, w_dtype)

    def quantize(w, backend):
        return quantize_square_blocks(w, pow2_scales=pow2_scales, backend=backend)

    kernel = jax.jit(quantize, static_argnums=1)(w, "pallas")
    expected = jax.jit(quantize, static_argnums=1)(w, "xla")
    for actual, wanted in zip(kernel, expected, strict=True):
        _assert_same(actual, wanted)


def test_row_blocks_transposed_match_reference():
    """The wgrad's token blocks of Qwen3-30B-A3B's layer (16k tokens x top-8 over 128 experts, uneven), with NaN and
    Inf in some blocks."""
    from moe_jax.ops.grouped_matmul import token_blocks
    from moe_jax.ops.grouped_matmul.reference_fp8 import RECIPES

    x = np.array(_random(3, (131072, 2048), jnp.float32))
    x[5, 7], x[70000, 2047], x[100000, 3] = np.nan, np.inf, -np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    sizes = np.random.default_rng(4).multinomial(131072 - 300, np.random.default_rng(5).dirichlet(np.ones(128)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    kernel = jax.jit(lambda x, g: token_blocks.quantize_token_blocks(x, g, RECIPES["fp8_block"]))(x, group_sizes)

    def reference_blocks(x, group_sizes):
        starts, rows, first_blocks = token_blocks.group_blocks(group_sizes, x.shape[0], 128)
        capacity = token_blocks.max_token_blocks(x.shape[0], 128, 128)
        blocks = jnp.arange(capacity, dtype=jnp.int32)
        group = jnp.clip(jnp.searchsorted(first_blocks, blocks, side="right") - 1, 0, 127)
        offset = (blocks - first_blocks[group]) * 128
        counts = jnp.clip(rows[group] - offset, 0, 128).astype(jnp.int32)
        first_rows = jnp.where(counts > 0, starts[group] + offset, 0).astype(jnp.int32)
        return quantize_row_blocks_transposed(x, first_rows, counts, backend="xla")

    values_t, scales = jax.jit(reference_blocks)(x, group_sizes)
    _assert_same_bits(kernel.values_t, values_t)
    _assert_same_bits(kernel.scales, scales)


@pytest.mark.parametrize("num_rows, cols", [(131072, 1536), (32768, 2880)])
def test_token_blocks_and_rows_match_their_two_quantizations(num_rows, cols):
    """The row-block pass that also writes the 1 x 128 copy (the GLU backward's d_gate_up, both FP8 GEMMs' operand):
    at Qwen3-30B-A3B's d_gate_up width over 128 uneven groups that leave 300 rows past their sum, and at a width
    ending on half a column tile, with NaN and Inf, bit for bit ``quantize_token_blocks`` and
    ``quantize_blockwise`` on XLA, every row included."""
    from moe_jax.ops.grouped_matmul import token_blocks
    from moe_jax.ops.grouped_matmul.reference_fp8 import RECIPES

    x = np.array(_random(9, (num_rows, cols), jnp.float32))
    x[5, 7], x[num_rows // 2, cols - 1], x[num_rows - 400, 3] = np.nan, np.inf, -np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    sizes = np.random.default_rng(10).multinomial(num_rows - 300, np.random.default_rng(11).dirichlet(np.ones(128)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    recipe = RECIPES["fp8_block"]
    blocks, rows = jax.jit(lambda x, g: token_blocks.quantize_token_blocks_and_rows(x, g, recipe))(x, group_sizes)

    def separately(x, group_sizes):
        expected_blocks = token_blocks.quantize_token_blocks(x, group_sizes, recipe, backend="xla")
        return expected_blocks, quantize_blockwise(x, (1, 128), backend="xla")

    expected_blocks, expected_rows = jax.jit(separately)(x, group_sizes)
    _assert_same_bits(blocks.values_t, expected_blocks.values_t)
    _assert_same_bits(blocks.scales, expected_blocks.scales)
    _assert_same(rows, expected_rows)


@pytest.mark.parametrize("num_tokens, cols", [(16384, 2048), (4096, 2880)])
def test_gathered_row_blocks_are_the_row_blocks_of_the_gathered_rows(num_tokens, cols):
    """Rows gathered from tokens as a top-8 routing sorts them (each token's 8 rows, shuffled), in the token blocks of
    uneven groups, with Inf in a token: bit for bit the XLA reference of the gathered copy x[row_tokens]. C = 2880
    ends on half a column tile."""
    from moe_jax.ops.grouped_matmul import token_blocks
    from moe_jax.ops.grouped_matmul.reference_fp8 import RECIPES

    tokens = np.array(_random(5, (num_tokens, cols), jnp.float32))
    tokens[17, cols - 1] = np.inf
    tokens = jnp.asarray(tokens, jnp.bfloat16)
    num_rows = 8 * num_tokens
    row_tokens = jnp.asarray(np.random.default_rng(6).permutation(num_rows) // 8, jnp.int32)
    sizes = np.random.default_rng(7).multinomial(num_rows - 100, np.random.default_rng(8).dirichlet(np.ones(128)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    recipe = RECIPES["fp8_block"]

    @jax.jit
    def both(tokens, row_tokens, group_sizes):
        gathered = token_blocks.quantize_token_blocks(tokens, group_sizes, recipe, row_tokens=row_tokens)
        copy = token_blocks.quantize_token_blocks(tokens[row_tokens], group_sizes, recipe, backend="xla")
        return gathered, copy

    gathered, copy = both(tokens, row_tokens, group_sizes)
    _assert_same_bits(gathered.values_t, copy.values_t)
    _assert_same_bits(gathered.scales, copy.scales)
