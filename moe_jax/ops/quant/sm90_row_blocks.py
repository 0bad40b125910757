"""Mosaic GPU (sm90) quantizer for blocks of rows at given starts, written transposed: x [M, C] and a table of B
blocks (first row r_b, rows n_b <= 128) -> values_t [C, 128 B] FP8, block b's rows in columns [128 b, 128 b + n_b)
and zeros after, and scales [B, C], one per block and column.

The FP8 wgrad contracts over each group's rows in 128-row blocks counted from the group's first row, with the token
axis contiguous (grouped_matmul/token_blocks.py lays the blocks out on a group-padded axis): a block starts at any row
of x, and its scale per column is the amax over its own rows only.

One CTA per SM walks the (block, 128-column tile) pairs round-robin, ``config.block_band`` blocks of a column tile
before the next column tile (a planar snake), so that the tiles in flight together write runs of that many 128-byte
pieces of each row of values_t. A producer warpgroup TMA-loads rows [r_b, r_b + 128) of the column tile into a ring
of ``config.stages`` buffers (rows past M read as zeros); the two consumer warpgroups each read 64 of its columns as
rows of x^T (ldmatrix's transposing form), zero the rows past n_b (the next group's, or none), and quantize each row
of x^T (a column of the block) as one 1 x 128 block, as sm90.py's transposed copy does, then TMA-store the FP8 rows
and store the scales from registers.

A block starts on any row, and TMA addresses a tiled buffer by whole tiles of rows: the input buffer takes one-row
tiles (sm90.py's ``swizzled``: 2-way bank conflicts on the transposing reads, against an 8-row tiling's none). Each
consumer's 64 columns are a buffer of their own, [TILE, 64] (two TMA copies per tile), so that a row is exactly one
128-byte swizzle line and eight consecutive rows one swizzle pattern, as the transposing read assumes: on a [TILE,
TILE] buffer of one-row tiles a row spans two lines and the sm90 GPU reads 16-byte chunks of the wrong columns (the
interpreter, which does not swizzle, cannot show it; tests/gpu/test_quant_gpu.py does).

With ``row_tokens`` the rows are gathered: row r is ``x[row_tokens[r]]`` of tokens x [T, C] (the wgrad of the
gate_up projection contracts the expert-sorted copies of the tokens, which are then never written). Hopper's TMA has
no row gather, so the producer warpgroup copies the rows with cp.async (grouped_matmul/sm90_gather.py, the gathered
GEMM's loader), each into its own row of a [TILE, 64] buffer in the 8-row tiles of the 128-byte swizzle: copied
row by row, the block may start on any row without one-row tiles, and the transposing reads have no bank conflicts.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_gather
from moe_jax.ops.quant.config import CONSUMER_REGISTERS, CONSUMERS, TILE, Config
from moe_jax.ops.quant.sm90 import (
    launch_per_signature,
    lowering_semantics,
    persistent_kernel,
    produce_tiles,
    quantize_rows,
    ring_barriers,
    scale_bits_dtype,
    swizzled,
    tma_windows,
)

_LAYOUT = plgpu.Layout.WGMMA
_ROWS = TILE // CONSUMERS


def tile_of(index, num_blocks: int, col_tiles: int, block_band: int) -> tuple:
    """The linear tile ``index`` -> (block, column tile): bands of ``block_band`` blocks (the last one possibly
    shorter), each walking its blocks of a column tile before the next column tile, every other band's column tiles
    in reverse (``plgpu.planar_snake``)."""
    return plgpu.planar_snake(index, (num_blocks, col_tiles), 0, block_band)


@launch_per_signature("dtype", "pow2_scales", "config", "num_sms", "interpret")
def quantize_row_blocks_transposed(
    x: jax.Array,
    first_rows: jax.Array,
    row_counts: jax.Array,
    *,
    row_tokens: jax.Array | None = None,
    dtype,
    pow2_scales: bool,
    config: Config,
    num_sms: int,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes blocks of up to 128 rows of x, each along its rows, into the transposed, block-padded layout.

    Args:
      x: [M, C] bf16 or f16, C a multiple of 64; or with ``row_tokens``, [T, C] tokens.
      first_rows: [B] int32, each block's first row in [0, M) (any row for an empty block).
      row_counts: [B] int32, each block's rows in [0, 128]; rows past M read as zeros.
      row_tokens: optional [M] int32 in [0, T): row r is x[row_tokens[r]].
      dtype: float8_e4m3fn or float8_e5m2.
      pow2_scales: scales rounded up to powers of two, stored as their exponent bytes.
      config: see ``Config`` (``heuristic_config(x.dtype, False, "row blocks")``, "gathered row blocks" with
        ``row_tokens``).
      num_sms: CTAs of the persistent grid.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      values_t [C, 128 B] in dtype (zeros past each block's rows) and scales [B, C] (f32, or uint8 exponent bytes).
    """
    cols = x.shape[1]
    gathered = row_tokens is not None
    rows = row_tokens.shape[0] if gathered else x.shape[0]
    (num_blocks,) = first_rows.shape
    col_tiles = pl.cdiv(cols, TILE)
    grid = (num_blocks * col_tiles,)

    def tile_index(index) -> tuple:
        return tile_of(index[0], num_blocks, col_tiles, config.block_band)

    stages = config.stages

    def body(x_gmem, first_rows_gmem, row_counts_gmem, *refs):
        row_tokens_gmem, values_t_gmem, scales_gmem, x_smem, out_smem, loaded, consumed = (
            refs if gathered else (None, *refs)
        )
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _producer():
            def window(index):
                block, col_tile = tile_index(index)
                return x_gmem.at[pl.ds(first_rows_gmem[block], TILE), pl.ds(col_tile * TILE, TILE)]

            def gather(index, slot):
                block, col_tile = tile_index(index)
                for piece in range(CONSUMERS):
                    # A piece past C (C % 128 == 64) copies the last 64 columns again instead: cp.async has no
                    # bounds, and what the consumer makes of them is stored past C, which the outputs drop.
                    col0 = jnp.minimum(col_tile * TILE + piece * _ROWS, cols - _ROWS)
                    sm90_gather.load_rows(
                        x_gmem,
                        row_tokens_gmem,
                        first_rows_gmem[block],
                        col0,
                        x_smem.at[slot, piece],
                        loaded.at[slot],
                        interpret=interpret,
                    )

            produce_tiles(grid, gather if gathered else tma_windows(window, x_smem, loaded), stages, consumed)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

            def quantize(info):
                block, col_tile = tile_index(info.index)
                step = info.local_index
                slot = lax.rem(step, stages)
                # The block's table entries come from global memory: read here, used after the wait and the tile's
                # load, so that their latency passes during those instead of holding up every tile before the wait.
                first_row, row_count = first_rows_gmem[block], row_counts_gmem[block]
                plgpu.barrier_wait(loaded.at[slot])
                x_cols = plgpu.load(x_smem.at[slot, wg].T, layout=_LAYOUT)
                # The tile is in registers; with the reads ordered before the async proxy's next write to the slot
                # (commit_smem's fence), the producer may refill it.
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed.at[slot])
                # A gathered row past M has a token (row_tokens is padded), not zeros: count it out here.
                count = jnp.minimum(row_count, rows - first_row)

                # Rows past the block's (columns here) belong to another group or to none: zeros, which no amax
                # notices and which the padded layout holds there.
                row = plgpu.broadcasted_iota(jnp.int32, x_cols.shape, 1, layout=_LAYOUT)
                x_cols = jnp.where(row < count, x_cols, jnp.zeros_like(x_cols))
                values, (scale,) = quantize_rows(x_cols, TILE, dtype, pow2_scales)

                buffer = lax.rem(step, 2)
                # The buffer's previous store (two tiles back) has finished reading it.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, buffer] = values
                col0 = col_tile * TILE + wg * _ROWS
                scales_gmem[block, pl.ds(col0, _ROWS)] = scale
                plgpu.commit_smem()
                window = values_t_gmem.at[pl.ds(col0, _ROWS), pl.ds(block * TILE, TILE)]
                plgpu.copy_smem_to_gmem(out_smem.at[wg, buffer], window)

            plgpu.nd_loop(grid, collective_axes="sm")(quantize)
            plgpu.wait_smem_to_gmem(0)

    padded_cols = col_tiles * TILE
    if gathered:
        # The GPU's cp.async rows arrive once per copy call and warpgroup, the interpreter's copies once per row.
        transforms = sm90_gather.smem_transforms(_ROWS, x.dtype, interpret)
        loads = CONSUMERS * (TILE if interpret is not None else 1)
    else:
        transforms, loads = swizzled(x.dtype, (1, cols)), CONSUMERS  # one-row tiles: the module docstring
    kernel = persistent_kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((cols, num_blocks * TILE), dtype),
            # Whole column tiles of scales: a partial tile's rows of x^T past C are stored too, then sliced off.
            jax.ShapeDtypeStruct((num_blocks, padded_cols), scale_bits_dtype(pow2_scales)),
        ),
        scratch_types=[
            plgpu.SMEM((stages, CONSUMERS, TILE, _ROWS), x.dtype, transforms=transforms),
            plgpu.SMEM((CONSUMERS, 2, _ROWS, TILE), dtype, transforms=swizzled(dtype, (cols, num_blocks * TILE))),
            *ring_barriers(stages, loads=loads),  # a slot's loads: [128, 64] of it per consumer
        ],
        kernel_name="moe_quantize_gathered_row_blocks_transposed" if gathered else "moe_quantize_row_blocks_transposed",
        semantics=lowering_semantics(x.dtype, transposed_reads=True),
        num_sms=num_sms,
        interpret=interpret,
    )
    # Rows past M in a block's 128 read token 0 (a row that exists), counted out by the consumers.
    extra = () if not gathered else (jnp.pad(row_tokens, (0, TILE)),)
    values_t, scales = kernel(x, first_rows, row_counts, *extra)
    return values_t, scales[:, :cols]
