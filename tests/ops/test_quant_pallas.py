"""The sm90 quantizer kernels under the Mosaic GPU interpreter (races detected, memory NaN-poisoned) against the XLA
reference: the same f32 arithmetic per block, so values and scales must be equal bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax._core.hardware import interpret_params
from moe_jax.ops.quant import reference, sm90, sm90_row_blocks, sm90_square
from moe_jax.ops.quant.api import (
    quantize_blockwise,
    quantize_blockwise_with_transpose,
    quantize_row_blocks_transposed,
    quantize_square_blocks,
)
from moe_jax.ops.quant.config import ROW_BLOCK_BANDS, TILE, Config
from tests.helpers import checked_interpreter

E4M3 = jnp.float8_e4m3fn


def _random(seed: int, shape, dtype) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=shape) * 2.0 ** rng.uniform(-8, 8, size=shape), dtype)


def _interpreted(fn, *args):
    with checked_interpreter():
        return jax.block_until_ready(jax.jit(fn)(*args))


def _reference(x, block_shape, dtype, pow2_scales, transpose=None):
    """``reference.quantize_blockwise`` of x (or of ``x.transpose(transpose)``) as one jitted program: op by op, each
    operation would compile on its own."""

    def quantize(x):
        return reference.quantize_blockwise(
            x if transpose is None else x.transpose(transpose), block_shape, dtype, pow2_scales
        )

    return jax.jit(quantize)(x)


def _reference_row_blocks(x, first_rows, row_counts, dtype, pow2_scales):
    """``reference.quantize_row_blocks_transposed`` in 128-row blocks as one jitted program."""
    quantize = functools.partial(
        reference.quantize_row_blocks_transposed, block=128, dtype=dtype, pow2_scales=pow2_scales
    )
    return jax.jit(quantize)(x, first_rows, row_counts)


def _bits(array) -> np.ndarray:
    """The bytes of an array (FP8 values, f32 or e8m0 scales): equal bits, NaN's included."""
    return np.asarray(array).view(np.uint8)


def _assert_same(actual, expected) -> None:
    assert actual.shape == expected.shape and actual.block_shape == expected.block_shape
    assert actual.values.dtype == expected.values.dtype and actual.scales.dtype == expected.scales.dtype
    np.testing.assert_array_equal(_bits(actual.values), _bits(expected.values))
    np.testing.assert_array_equal(_bits(actual.scales), _bits(expected.scales))


# (M, K, block, x dtype, FP8 dtype, pow2_scales): partial row and column tiles; M off a multiple of 8 (one-row
# buffer tiles); K = 2880, no multiple of 128 (64-byte swizzle on the FP8 tile); MXFP8's 1 x 32 blocks; f32 and
# f16 inputs; e5m2.
CASES = [
    (200, 320, 128, jnp.bfloat16, E4M3, False),
    (203, 192, 32, jnp.float32, E4M3, True),
    (64, 2880, 128, jnp.bfloat16, E4M3, True),
    (72, 256, 128, jnp.float16, jnp.float8_e5m2, False),
]


@pytest.mark.parametrize("rows, cols, block, x_dtype, dtype, pow2_scales", CASES)
def test_kernel_matches_reference_bit_for_bit(rows, cols, block, x_dtype, dtype, pow2_scales):
    x = _random(rows + cols, (rows, cols), x_dtype)

    def quantize(x):
        return quantize_blockwise(x, (1, block), dtype=dtype, pow2_scales=pow2_scales, backend="pallas")

    _assert_same(_interpreted(quantize, x), _reference(x, (1, block), dtype, pow2_scales))


# M and K multiples of 64, off the 128-row tile (192); MXFP8 blocks along both.
@pytest.mark.parametrize("rows, cols, block, pow2_scales", [(192, 320, 128, False), (128, 192, 32, True)])
def test_transposed_copy_matches_reference_of_x_transposed(rows, cols, block, pow2_scales):
    x = _random(rows * cols, (rows, cols), jnp.bfloat16)

    def quantize(x):
        return quantize_blockwise_with_transpose(x, block, pow2_scales=pow2_scales, backend="pallas")

    quantized, transposed = _interpreted(quantize, x)
    _assert_same(quantized, _reference(x, (1, block), E4M3, pow2_scales))
    _assert_same(transposed, _reference(x, (1, block), E4M3, pow2_scales, transpose=(1, 0)))


def test_zero_and_non_finite_blocks_match_reference():
    x = np.array(_random(0, (128, 256), jnp.float32))
    x[3] = 0.0  # two all-zero blocks of x; column 130's block of x^T
    x[:, 130] = 0.0
    x[5, 7], x[9, 200], x[64, 255] = np.nan, np.inf, -np.inf
    x = jnp.asarray(x)

    def quantize(x):
        return quantize_blockwise_with_transpose(x, backend="pallas")

    quantized, transposed = _interpreted(quantize, x)
    _assert_same(quantized, _reference(x, (1, 128), E4M3, False))
    _assert_same(transposed, _reference(x, (1, 128), E4M3, False, transpose=(1, 0)))


def test_the_ring_wraps_around_on_one_sm():
    # One CTA walks all 24 tiles through a 2-slot ring: every slot and output buffer is reused many times, so the
    # consumed barriers and the store waits are exercised (races would be reported).
    x = _random(1, (384, 1024), jnp.bfloat16)

    def quantize(x):
        return sm90.quantize_tiles(
            x,
            block=128,
            dtype=E4M3,
            pow2_scales=False,
            with_transpose=True,
            config=Config(stages=2),
            num_sms=1,
            interpret=None,  # the checked interpreter is forced around the call
        )

    values, scales, values_t, scales_t = _interpreted(quantize, x)
    expected, expected_t = (_reference(x, (1, 128), E4M3, False, transpose) for transpose in (None, (1, 0)))
    for actual, wanted in ((values, expected.values), (scales, expected.scales)):
        np.testing.assert_array_equal(_bits(actual), _bits(wanted))
    for actual, wanted in ((values_t, expected_t.values), (scales_t, expected_t.scales)):
        np.testing.assert_array_equal(_bits(actual), _bits(wanted))


# Weights [G, A, B] in 128 x 128 blocks: partial row and column tiles (A = 192, B = 320: a 64-wide last tile of
# each), f32 and f16 inputs, e5m2, power-of-two scales.
SQUARE_CASES = [
    ((2, 192, 320), jnp.bfloat16, E4M3, False),
    ((1, 128, 256), jnp.float32, jnp.float8_e5m2, False),
    ((3, 64, 128), jnp.float16, E4M3, False),
]


def test_square_blocks_refuse_power_of_two_scales_on_the_kernel():
    w = _random(1, (1, 128, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="power-of-two"):
        quantize_square_blocks(w, pow2_scales=True, backend="pallas")
    # "auto" quantizes them in XLA, the reference's way.
    auto, xla = (
        jax.jit(functools.partial(quantize_square_blocks, pow2_scales=True, backend=backend))(w)
        for backend in ("auto", "xla")
    )
    for actual, wanted in zip(auto, xla, strict=True):
        np.testing.assert_array_equal(np.asarray(actual.scales, np.float32), np.asarray(wanted.scales, np.float32))


@pytest.mark.parametrize("shape, w_dtype, dtype, pow2_scales", SQUARE_CASES)
def test_square_blocks_match_reference_in_both_layouts(shape, w_dtype, dtype, pow2_scales):
    w = _random(sum(shape), shape, w_dtype)

    def quantize(w):
        return quantize_square_blocks(w, dtype=dtype, pow2_scales=pow2_scales, backend="pallas")

    as_is, transposed = _interpreted(quantize, w)
    block = (1, 128, 128)
    _assert_same(as_is, _reference(w, block, dtype, pow2_scales))
    _assert_same(transposed, _reference(w, block, dtype, pow2_scales, transpose=(0, 2, 1)))


@pytest.mark.parametrize("copies", [("transposed",), ("as_is",), ("transposed", "as_is")])
def test_square_blocks_write_the_copies_asked_for_in_order(copies):
    w = _random(2, (2, 128, 192), jnp.bfloat16)

    def quantize(w):
        return quantize_square_blocks(w, copies=copies, backend="pallas")

    made = _interpreted(quantize, w)
    expected = {
        "as_is": _reference(w, (1, 128, 128), E4M3, False),
        "transposed": _reference(w, (1, 128, 128), E4M3, False, transpose=(0, 2, 1)),
    }
    assert len(made) == len(copies)
    for copy, actual in zip(copies, made, strict=True):
        _assert_same(actual, expected[copy])


def test_square_blocks_of_zeros_and_non_finite_values_match_reference():
    w = np.array(_random(3, (2, 256, 128), jnp.float32))
    w[0, :128] = 0.0  # an all-zero block: values 0, the smallest scale
    w[1, 5, 7], w[1, 200, 100] = np.nan, np.inf  # two blocks with one non-finite value each
    w[0, 140, 3] = -np.inf
    w = jnp.asarray(w)

    def quantize(w):
        return quantize_square_blocks(w, backend="pallas") + (quantize_blockwise(w, (1, 128, 128), backend="pallas"),)

    as_is, transposed, alone = _interpreted(quantize, w)
    expected = _reference(w, (1, 128, 128), E4M3, False)
    _assert_same(as_is, expected)
    _assert_same(alone, expected)
    _assert_same(transposed, _reference(w, (1, 128, 128), E4M3, False, transpose=(0, 2, 1)))
    assert np.all(np.asarray(as_is.values[0, :128]).astype(np.float32) == 0)
    # An Inf makes its block's scale infinite: no finite value comes back from the block. A NaN stays NaN.
    dequantized = np.asarray(jax.jit(lambda q: q.dequantize())(as_is))
    assert not np.isfinite(dequantized[1, 128:]).any() and not np.isfinite(dequantized[0, 128:]).any()
    assert np.isnan(dequantized[1, 5, 7])


def test_square_blocks_ring_and_amax_exchange_wrap_around_on_one_sm():
    # One CTA walks 2 x 3 x 2 tiles through a 2-slot ring: the slots, the output buffers and the two amax buffers are
    # each reused several times, so their barriers are exercised (races would be reported).
    w = _random(4, (2, 384, 256), jnp.bfloat16)

    def quantize(w):
        return sm90_square.quantize_square_tiles(
            w, dtype=E4M3, pow2_scales=False, as_is=True, transposed=True, config=Config(stages=2), num_sms=1
        )

    values, scales, values_t, scales_t = _interpreted(quantize, w)
    expected = _reference(w, (1, 128, 128), E4M3, False)
    np.testing.assert_array_equal(_bits(values), _bits(expected.values))
    np.testing.assert_array_equal(_bits(scales), _bits(expected.scales))
    np.testing.assert_array_equal(_bits(values_t), _bits(jnp.swapaxes(expected.values, 1, 2)))
    np.testing.assert_array_equal(_bits(scales_t), _bits(jnp.swapaxes(expected.scales, 1, 2)))


# Blocks of rows at any start (off multiples of 8), short and empty ones, one running past M, a block of another's
# rows; C = 192: a partial column tile.
ROW_BLOCKS = ([0, 5, 133, 290, 0, 250], [128, 3, 128, 20, 0, 128])


@pytest.mark.parametrize(
    "cols, x_dtype, dtype, pow2_scales",
    [(192, jnp.bfloat16, E4M3, False), (128, jnp.bfloat16, jnp.float8_e5m2, True), (64, jnp.float16, E4M3, False)],
)
def test_row_blocks_transposed_match_reference(cols, x_dtype, dtype, pow2_scales):
    x = np.array(_random(cols, (300, cols), jnp.float32))
    # Infinities in two blocks, and an all-zero column. No NaN: XLA:CPU's reduce-max (the reference's on this host)
    # drops NaN, so a NaN block's scale would differ; tests/gpu/test_quant_gpu.py checks NaN against XLA:GPU's.
    x[7, 3], x[140, cols - 1] = np.inf, -np.inf
    x[:, 10] = 0.0
    x = jnp.asarray(x, x_dtype)
    first_rows, row_counts = (jnp.asarray(table, jnp.int32) for table in ROW_BLOCKS)

    def quantize(x, first_rows, row_counts):
        return quantize_row_blocks_transposed(
            x, first_rows, row_counts, dtype=dtype, pow2_scales=pow2_scales, backend="pallas"
        )

    values_t, scales = _interpreted(quantize, x, first_rows, row_counts)
    expected = _reference_row_blocks(x, first_rows, row_counts, dtype, pow2_scales)
    assert values_t.shape == (cols, 128 * 6) and scales.shape == (6, cols)
    assert values_t.dtype == expected[0].dtype and scales.dtype == expected[1].dtype
    np.testing.assert_array_equal(_bits(values_t), _bits(expected[0]))
    np.testing.assert_array_equal(_bits(scales), _bits(expected[1]))


def test_gathered_row_blocks_are_the_row_blocks_of_the_gathered_rows():
    """Rows gathered from 117 tokens by ``row_tokens`` (each token several times, in any order): bit for bit the
    kernel's blocks of the gathered copy x[row_tokens], computed by XLA and quantized by the reference. Blocks at
    unaligned starts, an empty one, one running past M (the gather reads a token there, which must count
    as zeros), and C = 192 (a last column tile of 64; the interpreter's copies read zeros past C, so that the producer
    keeps its cp.async reads inside the rows is tests/gpu/test_quant_gpu.py's to check); on one SM with two ring
    slots, so that the producer refills slots, in bands of 2 blocks. Under the interpreter each row is a copy of its
    own, hence the small size."""
    tokens = np.array(_random(7, (117, 192), jnp.float32))
    tokens[4, 5] = np.inf
    tokens = jnp.asarray(tokens, jnp.bfloat16)
    row_tokens = jnp.asarray(np.random.default_rng(8).integers(0, 117, size=300), jnp.int32)
    first_rows, row_counts = jnp.asarray([5, 133, 7, 290], jnp.int32), jnp.asarray([3, 128, 0, 20], jnp.int32)

    def quantize(tokens, first_rows, row_counts, row_tokens):
        return sm90_row_blocks.quantize_row_blocks_transposed(
            tokens,
            first_rows,
            row_counts,
            row_tokens=row_tokens,
            dtype=E4M3,
            pow2_scales=False,
            config=Config(stages=2, block_band=2),
            num_sms=1,
            interpret=interpret_params(),
        )

    actual = _interpreted(quantize, tokens, first_rows, row_counts, row_tokens)
    expected = _reference_row_blocks(tokens[row_tokens], first_rows, row_counts, E4M3, False)
    assert actual[0].shape == (192, 128 * 4)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(e))


def test_row_block_tiles_go_in_bands_of_blocks():
    """7 blocks x 2 column tiles in bands of 4: a band's blocks of one column tile, then of the next; the second band
    (3 blocks) walks the column tiles the other way; every tile once."""
    order = [tuple(int(i) for i in sm90_row_blocks.tile_of(jnp.int32(t), 7, 2, 4)) for t in range(14)]
    first_band = [(b, c) for c in (0, 1) for b in range(4)]
    second_band = [(b, c) for c in (1, 0) for b in range(4, 7)]
    assert order == first_band + second_band


@pytest.mark.parametrize("gathered", [False, True])
def test_row_block_kernel_takes_its_pass_band(monkeypatch, gathered):
    """``quantize_row_blocks_transposed`` launches the kernel with the band of its pass: sorted or gathered rows."""
    launched = []

    def kernel(x, first_rows, row_counts, *, row_tokens, copy_rows, dtype, pow2_scales, config, num_sms, interpret):
        launched.append(config.block_band)
        blocks = first_rows.shape[0]
        return jnp.zeros((x.shape[1], TILE * blocks), dtype), jnp.zeros((blocks, x.shape[1]), jnp.float32)

    monkeypatch.setattr(sm90_row_blocks, "quantize_row_blocks_transposed", kernel)
    x, table = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32)
    row_tokens = jnp.zeros((256,), jnp.int32) if gathered else None
    quantize_row_blocks_transposed(x, table, table, row_tokens=row_tokens, backend="pallas")
    assert launched == [ROW_BLOCK_BANDS["gathered row blocks" if gathered else "row blocks"]]


@pytest.mark.parametrize("block_band", [1, 4])
def test_row_blocks_ring_wraps_around_on_one_sm(block_band):
    """7 blocks x 2 column tiles on one SM with two ring slots; a band of 4 blocks leaves a last band of 3, walked the
    other way (planar snake). Blocks 1 and 4 are empty (the padded token axis has such blocks): their columns must be
    zero values with the smallest scale, whatever rows their table entries name."""
    x = _random(5, (1000, 256), jnp.bfloat16)
    rng = np.random.default_rng(6)
    first_rows = jnp.asarray(rng.integers(0, 1000, size=7), jnp.int32)
    row_counts = jnp.asarray(rng.integers(1, 129, size=7), jnp.int32).at[jnp.array([1, 4])].set(0)
    config = Config(stages=2, block_band=block_band)

    def quantize(x, first_rows, row_counts):
        return sm90_row_blocks.quantize_row_blocks_transposed(
            x, first_rows, row_counts, dtype=E4M3, pow2_scales=False, config=config, num_sms=1
        )

    actual = _interpreted(quantize, x, first_rows, row_counts)
    expected = _reference_row_blocks(x, first_rows, row_counts, E4M3, False)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(e))


def test_row_blocks_with_rows_write_the_1x128_copy_in_their_windows():
    """The row-block pass with ``copy_rows`` also writes x's 1 x 128 copy, each block the rows of its window: windows
    that tile M = 300 with lengths that split into several prefix stores per consumer (100 = 64 + 32 + 4, 37, 35 for
    a last block whose own rows end at 20), a full block, and an empty one. Bit for bit ``quantize_blockwise``'s, and
    the transposed blocks unchanged; C = 192, a partial column tile; on one SM with two ring slots, so that slots and
    output buffers are reused."""
    x = np.array(_random(11, (300, 192), jnp.float32))
    x[120, 7], x[250, 190] = np.inf, -np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    first_rows = jnp.asarray([0, 100, 228, 265, 299], jnp.int32)
    row_counts = jnp.asarray([100, 128, 37, 20, 0], jnp.int32)
    copy_rows = jnp.asarray([100, 128, 37, 35, 0], jnp.int32)

    def quantize(x, first_rows, row_counts, copy_rows):
        return sm90_row_blocks.quantize_row_blocks_transposed(
            x,
            first_rows,
            row_counts,
            copy_rows=copy_rows,
            dtype=E4M3,
            pow2_scales=False,
            config=Config(stages=2, block_band=2),
            num_sms=1,
            interpret=interpret_params(),
        )

    values_t, scales_t, values, scales = _interpreted(quantize, x, first_rows, row_counts, copy_rows)
    expected_t = _reference_row_blocks(x, first_rows, row_counts, E4M3, False)
    np.testing.assert_array_equal(_bits(values_t), _bits(expected_t[0]))
    np.testing.assert_array_equal(_bits(scales_t), _bits(expected_t[1]))
    expected = _reference(x, (1, 128), E4M3, False)
    assert values.shape == (300, 192) and scales.shape == (300, 2)
    np.testing.assert_array_equal(_bits(values), _bits(expected.values))
    np.testing.assert_array_equal(_bits(scales), _bits(expected.scales))


def test_row_slots_place_each_row_in_its_window():
    """Row r of a window of block b has its scales at slot 128 b + r - first_rows[b]; a row in no window at 0."""
    slots = sm90_row_blocks.row_slots(jnp.asarray([4, 0, 9], jnp.int32), jnp.asarray([5, 3, 0], jnp.int32), 10)
    assert slots.tolist() == [128, 129, 130, 0, 0, 1, 2, 3, 4, 0]
