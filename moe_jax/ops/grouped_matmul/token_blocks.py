"""The FP8 wgrad's operands: x [M, C] quantized in blocks of rows counted from each group's first row (the recipe of
reference_fp8.py, ``quantize_rows_per_group``), laid out transposed on a group-padded token axis.

The wgrad d w[g] = x_g^T . dy_g contracts over a group's rows, and Hopper's FP8 wgmma reads both operands K-major,
K being the token axis here: the kernel (sm90_fp8_wgrad.py) reads x^T [C, M'] with the tokens contiguous. One
pipeline step is one 128-token block, so a block must lie inside one group and start where the recipe's does: every
group starts on a block boundary of the padded axis, the rest of its last block holds zeros. With block = 4 and
group sizes [6, 0, 3]:

    rows of x         0 1 2 3 4 5 | 6 7 8                   (M = 9)
    padded tokens     0 1 2 3 | 4 5 . . | 6 7 8 . | . . . .  (M' = 16; . = zero)
    blocks            b0 (g0)   b1 (g0)   b2 (g2)   unused

Group g's rows fill tokens [block * f_g, block * f_g + size_g), f_g = sum over the groups before it of
ceil(size / block) (its first block). Zeros raise no amax, so each block's scale and values are the recipe's, bit for
bit. M' is static, block * ``max_token_blocks(M, G)``, as the sizes stay on the device; the blocks past the last
group's are zeros too, and the kernel never reads them.

The quantizer (moe_jax/ops/quant/sm90_row_blocks.py on an H100/H200, else XLA) reads each block's rows of x once
and writes M' * C FP8 values and (M' / block) * C f32 scales; the table of the blocks' first rows and row counts is
a few XLA ops on [M' / block] integers.
"""

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.ops.grouped_matmul.reference_fp8 import DTYPE, Recipe
from moe_jax.ops.grouped_matmul.schedule import _prefix_sums, group_bounds
from moe_jax.ops.quant.api import BlockScaled, quantize_row_blocks_transposed

GROUP_ID, GROUP_FIRST_BLOCK, GROUP_BLOCKS = range(3)  # rows of the [3, G] group table (``group_table``)


def max_token_blocks(num_rows: int, num_groups: int, block: int) -> int:
    """Static bound on the blocks of any routing of ``num_rows`` rows over ``num_groups`` groups: ceil(size / block)
    <= (size + block - 1) / block for each group, and the sizes add up to at most M. At least one block."""
    return max((num_rows + (block - 1) * num_groups) // block, 1)


def group_blocks(group_sizes: jax.Array, num_rows: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(first row, rows, first block) of every group, [G] int32 each (``schedule.group_bounds``: negative sizes
    count as 0, rows past M are dropped, as in ``quantize_rows_per_group``)."""
    starts, ends = group_bounds(group_sizes, num_rows)
    rows = ends - starts
    blocks = (rows + block - 1) // block
    return starts, rows, _prefix_sums(blocks) - blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenBlocks:
    """x quantized per group in blocks of rows, transposed onto the group-padded token axis (module docstring).

    Attributes:
      values_t: [C, M'] float8_e4m3fn, M' = block * max_token_blocks(M, G); zeros outside the groups' rows.
      scales: [M' / block, C] f32: block b's scale of column c at [b, c] (MN-major: a tile's scales of one block are
        contiguous).
    """

    values_t: jax.Array
    scales: jax.Array


def block_table(group_sizes: jax.Array, num_rows: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The quantizer's table of the ``max_token_blocks`` padded blocks, [B] int32 each: (first row, rows, window).

    Block b holds rows [first, first + rows) of its group (rows = 0 for the blocks past every group's). The windows
    [first, first + window) tile [0, M) for the rows' 1 x 128 copy that the quantizer can write beside
    (``quantize_token_blocks_and_rows``): a block's own rows, the last group's last block up to 128 rows on, and
    the blocks past every group's the rest of M in 128-row steps (first then names a window's start, clipped into
    [0, M)). The bound leaves enough of those: it counts up to block - 1 padding rows for every group, and only
    the last group's last block reaches past its rows.
    """
    starts, rows, first_blocks = group_blocks(group_sizes, num_rows, block)
    capacity = max_token_blocks(num_rows, group_sizes.shape[0], block)
    blocks = jnp.arange(capacity, dtype=jnp.int32)
    group = jnp.searchsorted(first_blocks, blocks, side="right", method="compare_all") - 1
    group = jnp.clip(group, 0, group_sizes.shape[0] - 1).astype(jnp.int32)
    offset = (blocks - first_blocks[group]) * block
    row_counts = jnp.clip(rows[group] - offset, 0, block).astype(jnp.int32)
    used_blocks = first_blocks[-1] + (rows[-1] + block - 1) // block
    used = blocks < used_blocks
    group_rows = starts[group] + offset
    used_end = jnp.where(used_blocks > 0, group_rows[jnp.maximum(used_blocks - 1, 0)] + block, 0)
    window_starts = jnp.where(used, group_rows, used_end + (blocks - used_blocks) * block)
    next_starts = jnp.concatenate([window_starts[1:], jnp.full((1,), num_rows, jnp.int32)])
    windows = jnp.clip(jnp.minimum(next_starts, num_rows) - window_starts, 0, block).astype(jnp.int32)
    first_rows = jnp.clip(window_starts, 0, max(num_rows - 1, 0)).astype(jnp.int32)
    return first_rows, row_counts, windows


def quantize_token_blocks(
    x: jax.Array, group_sizes: jax.Array, recipe: Recipe, *, row_tokens: jax.Array | None = None, backend: str = "auto"
) -> TokenBlocks:
    """x [M, C] (any float dtype) quantized in blocks of ``recipe.block`` rows from each group's first row, in the
    group-padded transposed layout (``quantize_row_blocks_transposed``, by ``backend``: the Pallas kernel reads x
    once). group_sizes: [G] int32. With ``row_tokens`` [M] int32, x is [T, C] tokens and row r is
    ``x[row_tokens[r]]`` (gathered by the quantizer's loads)."""
    num_rows = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    first_rows, row_counts, _ = block_table(group_sizes, num_rows, recipe.block)
    values_t, scales = quantize_row_blocks_transposed(
        x,
        first_rows,
        row_counts,
        recipe.block,
        row_tokens=row_tokens,
        dtype=DTYPE,
        pow2_scales=recipe.pow2_scales,
        backend=backend,
    )
    return _token_blocks(values_t, scales)


def quantize_token_blocks_and_rows(
    x: jax.Array, group_sizes: jax.Array, recipe: Recipe, *, backend: str = "auto"
) -> tuple[TokenBlocks, BlockScaled]:
    """``quantize_token_blocks(x, ...)`` and x [M, C] in the recipe's 1 x 128 blocks along C (what the FP8 GEMMs
    take as their lhs, ``quantize_blockwise``'s bit for bit) from the same read of x: the two operands of a
    gradient that both an FP8 dgrad and an FP8 wgrad contract."""
    first_rows, row_counts, windows = block_table(group_sizes, x.shape[0], recipe.block)
    values_t, scales, rows = quantize_row_blocks_transposed(
        x,
        first_rows,
        row_counts,
        recipe.block,
        copy_rows=windows,
        dtype=DTYPE,
        pow2_scales=recipe.pow2_scales,
        backend=backend,
    )
    return _token_blocks(values_t, scales), rows


def num_cols(x: "jax.Array | TokenBlocks") -> int:
    """C of x [M, C], or of the x that ``TokenBlocks`` quantized."""
    return x.values_t.shape[0] if isinstance(x, TokenBlocks) else x.shape[1]


def _token_blocks(values_t: jax.Array, scales: jax.Array) -> TokenBlocks:
    # Power-of-two scales come as float8_e8m0fnu: f32 holds them exactly, as TokenBlocks does every scale.
    return TokenBlocks(values_t, scales.astype(jnp.float32))


def group_table(group_sizes: jax.Array, num_rows: int, block: int) -> jax.Array:
    """The FP8 wgrad kernel's group table, [3, G] int32: per group (largest first, so that a hot expert's tiles are
    handed out first and do not finish last) its index, first block and blocks on the padded token axis."""
    _, rows, first_blocks = group_blocks(group_sizes, num_rows, block)
    blocks = (rows + block - 1) // block
    order = jnp.argsort(-blocks, stable=True).astype(jnp.int32)
    return jnp.stack([order, first_blocks[order], blocks[order]]).astype(jnp.int32)
