"""The FP8 wgrad's operand layout (``token_blocks``: x quantized in row blocks per group, transposed onto a
group-padded token axis) against ``reference_fp8.quantize_rows_per_group``, the recipe's own quantization: the same
values and scales, rearranged, so the comparison is bit for bit (no tolerance); zeros everywhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.grouped_matmul import reference_fp8, token_blocks
from moe_jax.ops.grouped_matmul.token_blocks import GROUP_BLOCKS, GROUP_FIRST_BLOCK, GROUP_ID
from moe_jax.ops.quant.api import quantize_blockwise
from tests.helpers import pairwise_by_default

# Jitted: dispatched op by op, each call would compile one small program per operation and shape.
quantize_token_blocks = jax.jit(token_blocks.quantize_token_blocks, static_argnums=2)
quantize_rows_per_group = jax.jit(reference_fp8.quantize_rows_per_group, static_argnums=2)
group_table = jax.jit(token_blocks.group_table, static_argnums=(1, 2))

# (M, C, group sizes): empty, one row, one short of / exactly / one past a 128-row block and 35 rows past the sum; one
# hot group; sizes past M (the last group is cut) and a negative one (counts as 0); M shorter than one block.
CASES = {
    "edges": (420, 64, [0, 1, 127, 128, 129]),
    "hot": (300, 128, [0, 300, 0, 0]),
    "past_m": (200, 64, [150, -4, 100]),
    "short": (40, 64, [10, 0, 30]),
}


def _padded_token(group_sizes, num_rows, block) -> np.ndarray:
    """[M] int: the padded token of each row of x (-1 past the groups), from the sizes with NumPy loops."""
    token = np.full(num_rows, -1)
    row = first_block = 0
    for size in np.maximum(group_sizes, 0):
        size = min(size, num_rows - row)
        token[row : row + size] = first_block * block + np.arange(size)
        row, first_block = row + size, first_block + -(-size // block)
    return token


@pytest.mark.parametrize(
    "dtype, case, quantization",
    pairwise_by_default([jnp.float32, jnp.bfloat16], list(CASES), list(reference_fp8.RECIPES)),
)
def test_layout_is_the_recipes_quantization_rearranged(case, quantization, dtype):
    num_rows, cols, sizes = CASES[case]
    recipe = reference_fp8.RECIPES[quantization]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(num_rows, cols)) * 3, dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    layout = quantize_token_blocks(x, group_sizes, recipe)

    capacity = token_blocks.max_token_blocks(num_rows, len(sizes), recipe.block)
    assert layout.values_t.shape == (cols, capacity * recipe.block) and layout.values_t.dtype == jnp.float8_e4m3fn
    assert layout.scales.shape == (capacity, cols) and layout.scales.dtype == jnp.float32
    values = np.asarray(layout.values_t.astype(jnp.float32)).T  # [M', C]
    scales = np.asarray(layout.scales)
    token = _padded_token(np.asarray(sizes), num_rows, recipe.block)
    rows = token >= 0
    dequantized = np.zeros((num_rows, cols), np.float32)
    dequantized[rows] = values[token[rows]] * scales[token[rows] // recipe.block]
    expected = np.asarray(quantize_rows_per_group(x, group_sizes, recipe))
    np.testing.assert_array_equal(dequantized, expected)
    padding = np.ones(len(values), bool)
    padding[token[rows]] = False
    np.testing.assert_array_equal(values[padding], 0.0)


def test_non_finite_rows_stay_in_their_block():
    """An Inf makes its own block (one group's 128 rows of one column) non-finite and no other."""
    x = np.random.default_rng(1).normal(size=(300, 64)).astype(np.float32)
    x[130, 5] = np.inf  # group 1's first block (rows 100-227)
    layout = quantize_token_blocks(jnp.asarray(x), jnp.asarray([100, 200]), reference_fp8.RECIPES["fp8_block"])
    finite = np.isfinite(np.asarray(layout.scales))
    assert not finite[1, 5] and finite.sum() == finite.size - 1


def test_group_table_lists_largest_groups_first_with_their_blocks():
    sizes = [0, 1, 127, 128, 129, 300]
    table = np.asarray(group_table(jnp.asarray(sizes, jnp.int32), 1000, 128))
    blocks = [-(-s // 128) for s in sizes]
    firsts = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    assert list(table[GROUP_ID]) == [5, 4, 1, 2, 3, 0]
    np.testing.assert_array_equal(table[GROUP_BLOCKS], np.asarray(blocks)[table[GROUP_ID]])
    np.testing.assert_array_equal(table[GROUP_FIRST_BLOCK], firsts[table[GROUP_ID]])


# Group sizes where every group's last block is one row long (the most padded blocks), sums short of M, no rows at
# all, one group past M.
WINDOW_CASES = [
    (700, [1, 129, 257]),
    (1000, [1, 1, 1, 1]),
    (130, [1]),
    (500, [0, 0, 0]),
    (300, [0, 500, 7]),
    (64, [3, 0, 5]),
]


@pytest.mark.parametrize("num_rows, sizes", WINDOW_CASES)
def test_block_windows_tile_the_rows_and_hold_each_blocks_rows(num_rows, sizes):
    """The 1 x 128 copy's windows cover every row of M exactly once, each within its block's 128 loaded rows, and the
    blocks of the groups keep their rows (``_padded_token``: the same first rows and counts as the layout test's)."""
    first_rows, row_counts, windows = map(np.asarray, token_blocks.block_table(jnp.asarray(sizes), num_rows, 128))
    covered = np.zeros(num_rows, int)
    for first, window in zip(first_rows, windows, strict=True):
        assert 0 <= first < num_rows and 0 <= window <= 128
        covered[first : first + window] += 1
    np.testing.assert_array_equal(covered, 1)
    token = _padded_token(np.asarray(sizes), num_rows, 128)
    rows = np.flatnonzero(token >= 0)
    np.testing.assert_array_equal(first_rows[token[rows] // 128] + token[rows] % 128, rows)
    assert row_counts.sum() == len(rows)
    used = row_counts > 0
    np.testing.assert_array_equal(windows[used][:-1], row_counts[used][:-1])  # a group's rows, but the last block


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_token_blocks_and_rows_are_both_quantizations(pow2_scales):
    """``quantize_token_blocks_and_rows``: the token blocks as ``quantize_token_blocks`` gives them, and every row of
    x in 1 x 128 blocks as ``quantize_blockwise`` does, bit for bit (XLA's path here; the kernel's in
    tests/ops/test_quant_pallas.py)."""
    recipe = reference_fp8.Recipe(block=128, weight_cols=128, pow2_scales=pow2_scales)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(700, 192)) * 3, jnp.bfloat16)
    group_sizes = jnp.asarray([1, 129, 257], jnp.int32)
    blocks, rows = jax.jit(token_blocks.quantize_token_blocks_and_rows, static_argnums=2)(x, group_sizes, recipe)
    expected_blocks = quantize_token_blocks(x, group_sizes, recipe)
    expected_rows = quantize_blockwise(x, (1, 128), pow2_scales=pow2_scales, backend="xla")
    for actual, expected in ((blocks.values_t, expected_blocks.values_t), (rows.values, expected_rows.values)):
        np.testing.assert_array_equal(np.asarray(actual).view(np.uint8), np.asarray(expected).view(np.uint8))
    np.testing.assert_array_equal(blocks.scales, expected_blocks.scales)
    np.testing.assert_array_equal(rows.scales.astype(jnp.float32), expected_rows.scales.astype(jnp.float32))
