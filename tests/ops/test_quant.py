"""Reference block-scaled FP8 quantization against a float64 NumPy oracle written from the definition with loops.

The oracle rounds to FP8 by its own arithmetic (exponent from ``math.frexp``, quantum, round half to even), not by
ml_dtypes or XLA; it finds a power-of-two scale by exact comparisons, not from bits. Like the definition, it computes
the other scales as the f32 product ``amax * (1 / max)`` and the scaled values as the f32 product
``x * (1 / scale)`` (NumPy's f32 arithmetic is correctly rounded), and rounds that product once to FP8. Values and
scales must match exactly.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.quant.api import (
    BlockScaled,
    quantize_blockwise,
    quantize_blockwise_with_transpose,
    quantize_row_blocks_transposed,
    quantize_square_blocks,
)

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
# (mantissa bits, exponent of the smallest normal number, largest finite value) of each FP8 format.
FORMATS = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}


# ---------------------------------------------------------------------------------------------------------- oracle


def _round_to_fp8(value: float, dtype) -> float:
    """``value`` clipped to the format's range, then rounded to the nearest FP8 number, ties to an even mantissa."""
    mantissa_bits, min_exponent, largest = FORMATS[dtype]
    if math.isnan(value):
        return math.nan
    value = min(max(value, -largest), largest)
    if value == 0:
        return 0.0
    _, exponent = math.frexp(abs(value))  # |value| = f * 2**exponent, f in [0.5, 1)
    quantum = 2.0 ** (max(exponent - 1, min_exponent) - mantissa_bits)  # spacing of FP8 numbers near |value|
    steps = abs(value) / quantum  # exact: a power-of-two division
    rounded = math.floor(steps)
    if steps - rounded > 0.5 or (steps - rounded == 0.5 and rounded % 2 == 1):
        rounded += 1
    return math.copysign(rounded * quantum, value)


def _oracle(x: np.ndarray, block_shape, dtype, pow2_scales: bool):
    """(values [x.shape] float64, scales [ceil(x.shape / block_shape)] float64), block by block."""
    _, _, largest = FORMATS[dtype]
    x = np.asarray(x, np.float64)
    grid = [math.ceil(size / block) for size, block in zip(x.shape, block_shape, strict=True)]
    values = np.zeros(x.shape)
    scales = np.zeros(grid)
    for index in itertools.product(*map(range, grid)):
        window = tuple(slice(i * b, (i + 1) * b) for i, b in zip(index, block_shape, strict=True))
        block = x[window]
        amax = math.nan if np.isnan(block).any() else float(np.max(np.abs(block)))
        if not math.isfinite(amax):
            scale = amax
        elif pow2_scales:
            scale = 2.0**-126
            while largest * scale < amax:  # exact: largest has 3 significant bits
                scale *= 2
        else:
            scale = max(float(np.float32(amax) * np.float32(1 / largest)), 2.0**-126)
        scales[index] = scale
        scaled = np.asarray(np.float32(block) * (np.float32(1) / np.float32(scale)), np.float64)
        values[window] = np.vectorize(lambda v: _round_to_fp8(v, dtype))(scaled)
    return values, scales


def _random(seed: int, shape, dtype=jnp.bfloat16, spread: float = 4.0) -> np.ndarray:
    """Normal numbers times a random power of two per element (2**-spread to 2**spread), rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * 2.0 ** rng.uniform(-spread, spread, size=shape)
    return np.array(jnp.asarray(x, dtype).astype(jnp.float32))


def _quantized(x: np.ndarray, block_shape, dtype=E4M3, pow2_scales=False, in_dtype=jnp.bfloat16) -> BlockScaled:
    quantize = functools.partial(quantize_blockwise, dtype=dtype, pow2_scales=pow2_scales, backend="xla")
    return jax.jit(quantize, static_argnums=1)(jnp.asarray(x, in_dtype), block_shape)


def _assert_matches_oracle(q: BlockScaled, x, block_shape, dtype, pow2_scales) -> None:
    values, scales = _oracle(x, block_shape, dtype, pow2_scales)
    np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.float32)), values)
    np.testing.assert_array_equal(np.asarray(q.scales.astype(jnp.float32)), scales)


# ---------------------------------------------------------------------------------------------------------- values


# (shape, block_shape, dtype, pow2_scales): activations 1 x 128 (a partial last block), MXFP8's 1 x 32 with
# power-of-two scales, weights 1 x 128 x 128 (partial along both blocked axes), and blocks along every axis.
CASES = [
    ((6, 300), (1, 128), E4M3, False),
    ((6, 300), (1, 128), E4M3, True),
    ((6, 300), (1, 128), E5M2, False),
    ((5, 96), (1, 32), E4M3, True),
    ((5, 96), (1, 32), E5M2, True),
    ((2, 160, 130), (1, 128, 128), E4M3, False),
    ((2, 160, 130), (1, 128, 128), E4M3, True),
    ((7, 9), (3, 4), E4M3, False),
    ((7, 9), (3, 4), E5M2, True),
    ((33,), (8,), E4M3, False),
]


@pytest.mark.parametrize("shape, block_shape, dtype, pow2_scales", CASES)
def test_reference_matches_the_oracle(shape, block_shape, dtype, pow2_scales):
    x = _random(sum(shape), shape)
    q = _quantized(x, block_shape, dtype, pow2_scales)
    assert q.shape == shape and q.dtype == dtype and q.block_shape == block_shape
    assert q.scales.shape == tuple(math.ceil(s / b) for s, b in zip(shape, block_shape, strict=True))
    assert q.scales.dtype == (jnp.float8_e8m0fnu if pow2_scales else jnp.float32)
    _assert_matches_oracle(q, x, block_shape, dtype, pow2_scales)


@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.float16])
def test_other_input_dtypes_match_the_oracle(in_dtype):
    x = _random(3, (4, 256), in_dtype)
    _assert_matches_oracle(_quantized(x, (1, 128), in_dtype=in_dtype), x, (1, 128), E4M3, False)


def test_each_block_reaches_the_largest_value_and_nothing_past_it():
    # Without power-of-two scales every block's amax lands on +-448: rounded there, or clipped where the f32 scale
    # came out below amax / 448 (an e4m3 cast of anything past 464 would be NaN). Also for blocks of huge values.
    x = _random(4, (8, 512))
    x[3, :128] *= 2.0**100
    q = _quantized(x, (1, 128), in_dtype=jnp.float32)
    largest = np.max(np.abs(np.asarray(q.values.astype(jnp.float32))).reshape(8, 4, 128), axis=-1)
    np.testing.assert_array_equal(largest, 448.0)


def test_power_of_two_scales_round_up_so_nothing_saturates():
    x = _random(5, (16, 256))
    q = _quantized(x, (1, 32), pow2_scales=True)
    scales = np.asarray(q.scales.astype(jnp.float32), np.float64)
    assert np.all(np.frexp(scales)[0] == 0.5)  # powers of two
    # |x| / scale <= 448 before rounding: no value needed the clip.
    quotients = np.abs(x).reshape(16, 8, 32) / scales[..., None]
    assert quotients.max() <= 448.0
    # Rounding up loses at most one binade: the amax sits in (224, 448] of the scaled range.
    assert quotients.max(axis=-1).min() > 224.0


def test_all_zero_blocks_dequantize_to_exact_zeros():
    x = _random(6, (4, 384))
    x[1] = 0.0
    x[2, 128:256] = 0.0
    for pow2_scales in (False, True):
        q = _quantized(x, (1, 128), pow2_scales=pow2_scales)
        restored = np.asarray(q.dequantize())
        np.testing.assert_array_equal(restored[1], 0.0)
        np.testing.assert_array_equal(restored[2, 128:256], 0.0)
        assert np.all(np.isfinite(restored)) and np.all(np.signbit(restored[1]) == 0)


def test_ties_round_to_the_even_neighbour():
    # One block with amax 448 has scale 1: each value below is its own scaled value. e4m3's numbers near 1 are 1/8
    # apart, near 16 two apart; below 2**-6 they are subnormal, 2**-9 apart.
    ties = [1.0625, 1.1875, 17.0, 19.0, -19.0, 1.5 * 2.0**-9, 0.5 * 2.0**-9, 2.5 * 2.0**-9]
    expected = [1.0, 1.25, 16.0, 20.0, -20.0, 2.0**-8, 0.0, 2.0**-8]
    x = np.array([[448.0, *ties]], np.float32)
    q = _quantized(x, (1, 16), in_dtype=jnp.float32)
    assert float(q.scales[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.float32))[0, 1:], expected)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pow2_scales", [False, True])
def test_a_non_finite_input_makes_its_whole_block_non_finite(bad, pow2_scales):
    x = _random(7, (3, 256))
    x[1, 130] = bad
    restored = np.asarray(_quantized(x, (1, 128), pow2_scales=pow2_scales, in_dtype=jnp.float32).dequantize())
    assert not np.any(np.isfinite(restored[1, 128:]))
    # Every other block is untouched by it.
    others = np.ones(x.shape, bool)
    others[1, 128:] = False
    assert np.all(np.isfinite(restored[others]))
    finite_rows = x[[0, 2]]
    _assert_matches_oracle(
        _quantized(finite_rows, (1, 128), pow2_scales=pow2_scales), finite_rows, (1, 128), E4M3, pow2_scales
    )


@pytest.mark.parametrize("dtype, bits", [(E4M3, 3), (E5M2, 2)])
@pytest.mark.parametrize("pow2_scales", [False, True])
def test_dequantize_is_within_half_an_fp8_step_of_x(dtype, bits, pow2_scales):
    # Per element: |x - values * scale| <= 2**-(bits + 1) * |x| for normal FP8 values, and at most half the
    # subnormal spacing (2**(min_exponent - bits - 1) * scale) below them.
    _, min_exponent, _ = FORMATS[dtype]
    x = _random(8, (8, 512), jnp.float32, spread=12.0)
    q = _quantized(x, (1, 128), dtype, pow2_scales, in_dtype=jnp.float32)
    scales = np.repeat(np.asarray(q.scales.astype(jnp.float32), np.float64), 128, axis=1)
    error = np.abs(np.asarray(q.dequantize(), np.float64) - x)
    bound = np.maximum(2.0 ** -(bits + 1) * np.abs(x), 2.0 ** (min_exponent - bits - 1) * scales)
    assert np.all(error <= bound * (1 + 2**-16))  # and the f32 roundings of 1 / scale and both products


def test_dequantize_broadcasts_scales_over_partial_blocks():
    x = _random(9, (3, 70, 200))
    q = _quantized(x, (1, 64, 128))
    expected = np.asarray(q.values.astype(jnp.float32), np.float64)
    scales = np.asarray(q.scales, np.float64)
    for i, j, k in itertools.product(range(3), range(70), range(200)):
        expected[i, j, k] *= scales[i, j // 64, k // 128]
    restored = q.dequantize()
    assert restored.dtype == jnp.float32
    np.testing.assert_array_equal(restored, expected.astype(np.float32))  # the products are exact in float64
    np.testing.assert_array_equal(q.dequantize(jnp.bfloat16), restored.astype(jnp.bfloat16))


def test_transposed_pair_quantizes_x_and_x_transposed_along_their_rows():
    x = _random(10, (96, 160))
    rows, columns = quantize_blockwise_with_transpose(jnp.asarray(x, jnp.bfloat16), 32, backend="xla")
    _assert_matches_oracle(rows, x, (1, 32), E4M3, False)
    _assert_matches_oracle(columns, x.T, (1, 32), E4M3, False)
    assert columns.shape == (160, 96) and columns.scales.shape == (160, 3)


def test_the_k_major_weight_copy_is_the_transpose_of_the_quantized_weights():
    w = _random(12, (2, 160, 130))
    q, q_k_major = _quantized(w, (1, 128, 128)), _quantized(w.transpose(0, 2, 1), (1, 128, 128))
    for actual, expected in ((q_k_major.values, q.values), (q_k_major.scales, q.scales)):
        np.testing.assert_array_equal(actual.astype(jnp.float32), expected.astype(jnp.float32).transpose(0, 2, 1))


def test_square_blocks_give_the_weights_and_their_transpose_quantized():
    w = _random(13, (2, 160, 130))
    as_is, transposed = quantize_square_blocks(jnp.asarray(w, jnp.bfloat16), backend="xla")
    _assert_matches_oracle(as_is, w, (1, 128, 128), E4M3, False)
    _assert_matches_oracle(transposed, w.transpose(0, 2, 1), (1, 128, 128), E4M3, False)
    (alone,) = quantize_square_blocks(jnp.asarray(w, jnp.bfloat16), copies=("transposed",), backend="xla")
    np.testing.assert_array_equal(np.asarray(alone.values).view(np.uint8), np.asarray(transposed.values).view(np.uint8))


def test_block_scaled_is_a_pytree_with_a_static_block_shape():
    q = _quantized(_random(11, (4, 128)), (1, 128))
    leaves, treedef = jax.tree.flatten(q)
    assert [leaf.shape for leaf in leaves] == [(4, 128), (4, 1)]
    doubled = jax.jit(lambda q: BlockScaled(q.values, q.scales * 2, q.block_shape))(q)
    assert doubled.block_shape == (1, 128)
    np.testing.assert_array_equal(doubled.dequantize(), 2 * q.dequantize())
    assert jax.tree.unflatten(treedef, leaves).block_shape == (1, 128)


# ---------------------------------------------------------------------------------------------------------- errors


_TABLE = jnp.zeros((3,), jnp.int32)  # a block table: first rows or row counts


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda x: quantize_blockwise(x, (128,)), ValueError, r"block_shape must have one entry per axis of x"),
        (lambda x: quantize_blockwise(x, (1, 0)), ValueError, r"block_shape entries must be >= 1"),
        (lambda x: quantize_blockwise(x, (1, 128.0)), TypeError, r"block_shape must be a tuple of Python ints"),
        (lambda x: quantize_blockwise(x, 128), TypeError, r"block_shape must be a tuple"),
        (lambda x: quantize_blockwise(x, (1, 128), dtype=jnp.bfloat16), TypeError, r"dtype must be one of"),
        (lambda x: quantize_blockwise(x.astype(jnp.int32), (1, 128)), TypeError, r"x must have dtype in"),
        (lambda x: quantize_blockwise(x, (1, 128), pow2_scales=1), TypeError, r"pow2_scales must be a Python bool"),
        (lambda x: quantize_blockwise(x, (1, 128), backend="cuda"), ValueError, r"backend must be one of"),
        (lambda x: quantize_blockwise_with_transpose(x[0]), ValueError, r"x must have shape \[M, K\]"),
        (lambda x: quantize_blockwise_with_transpose(x, 0), ValueError, r"block_size must be >= 1"),
        (lambda x: quantize_square_blocks(x), ValueError, r"w must have shape \[G, A, B\]"),
        (lambda x: quantize_row_blocks_transposed(x, _TABLE.astype(float), _TABLE), TypeError, r"first_rows must be"),
        (lambda x: quantize_row_blocks_transposed(x, _TABLE, _TABLE[:1]), ValueError, r"row_counts: length \(B"),
        (lambda x: quantize_row_blocks_transposed(x, _TABLE[None], _TABLE), ValueError, r"first_rows must have"),
        (
            lambda x: quantize_row_blocks_transposed(x, _TABLE, _TABLE, row_tokens=_TABLE[None]),
            ValueError,
            r"row_tokens",
        ),
        (
            lambda x: quantize_row_blocks_transposed(x, _TABLE, _TABLE, row_tokens=x[0]),
            TypeError,
            r"row_tokens must be",
        ),
        (lambda x: quantize_square_blocks(x[None], copies=()), ValueError, r"copies must name each of"),
        (lambda x: quantize_square_blocks(x[None], copies=("as_is", "as_is")), ValueError, r"copies must name each"),
        (lambda x: quantize_square_blocks(x[None], copies=("k_major",)), ValueError, r"copies must name each of"),
    ],
)
def test_bad_arguments_are_named(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(jnp.ones((4, 256), jnp.bfloat16))


@pytest.mark.parametrize(
    "shape, block_shape, pattern",
    [
        ((4, 256), (1, 64), r"takes block_shape \(1, b\) with b in \(32, 128\)"),
        ((4, 2, 2, 256), (1, 1, 1, 128), r"takes \[M, K\] or \[G, A, B\] arrays"),
        ((4, 96), (1, 32), r"K positive multiples of 64"),
        ((4, 2, 256), (1, 1, 128), r"takes \[G, A, B\] arrays in block_shape \(1, 128, 128\)"),
        ((2, 96, 128), (1, 128, 128), r"A, B positive multiples of 64"),
    ],
)
def test_pallas_names_what_its_kernel_does_not_take(shape, block_shape, pattern):
    with pytest.raises(NotImplementedError, match=r"quantize_blockwise: the Pallas kernel .*" + pattern):
        quantize_blockwise(jnp.ones(shape, jnp.bfloat16), block_shape, backend="pallas")


@pytest.mark.parametrize(
    "dtype, block_size, pattern",
    [(jnp.bfloat16, 32, r"takes blocks of 128 rows"), (jnp.float32, 128, r"takes 16-bit inputs")],
)
def test_pallas_names_what_its_row_block_kernel_does_not_take(dtype, block_size, pattern):
    with pytest.raises(NotImplementedError, match=r"quantize_row_blocks_transposed: the Pallas kernel .*" + pattern):
        quantize_row_blocks_transposed(jnp.ones((4, 256), dtype), _TABLE, _TABLE, block_size, backend="pallas")


def test_row_blocks_are_the_blocks_quantized_along_their_rows_transposed():
    x = _random(14, (40, 96))
    first_rows, row_counts = jnp.asarray([3, 30, 0], jnp.int32), jnp.asarray([16, 16, 0], jnp.int32)
    values_t, scales = quantize_row_blocks_transposed(jnp.asarray(x, jnp.bfloat16), first_rows, row_counts, 16)
    # Block b padded with zeros to 16 rows (rows past M = 40 count as zeros), quantized along its rows.
    padded = np.zeros((3, 16, 96))
    padded[0], padded[1, :10] = x[3:19], x[30:40]
    for b in range(3):
        block = BlockScaled(values_t[:, 16 * b : 16 * (b + 1)].T, scales[b][None], (16, 1))
        _assert_matches_oracle(block, padded[b], (16, 1), E4M3, False)
