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

With ``copy_rows`` the pass also writes x's own 1 x 128 copy (the FP8 GEMMs' lhs) from the same read: a tile's rows
hold their 1 x 128 blocks of its column tile whole, so each consumer also loads its 64 rows of both column pieces,
quantizes them as sm90.py does and TMA-stores the rows of its block's window [first_rows[b], + copy_rows[b]) alone
(the windows tile the rows; a consumer's part of a window shorter than its 64 rows goes as one copy per set bit of
that length, from an FP8 buffer of one-row tiles). Their scales go to a [C / 128, 128 B] array of 128 slots per
block, gathered into row order after the kernel (``row_slots``): a store from registers writes all 64 rows, and the
rows past a window are another block's. The d_gate_up of the GLU backward is such an operand: its dgrad and its
wgrad then read one pass's copies.

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
    copy_rows: jax.Array | None = None,
    dtype,
    pow2_scales: bool,
    config: Config,
    num_sms: int,
    interpret=None,
) -> tuple[jax.Array, ...]:
    """Quantizes blocks of up to 128 rows of x, each along its rows, into the transposed, block-padded layout.

    Args:
      x: [M, C] bf16 or f16, C a multiple of 64; or with ``row_tokens``, [T, C] tokens.
      first_rows: [B] int32, each block's first row in [0, M) (any row for an empty block).
      row_counts: [B] int32, each block's rows in [0, 128]; rows past M read as zeros.
      row_tokens: optional [M] int32 in [0, T): row r is x[row_tokens[r]].
      copy_rows: optional [B] int32 in [0, 128], not with ``row_tokens``: also write x's 1 x 128 copy, block b its
        rows [first_rows[b], first_rows[b] + copy_rows[b]) (windows that tile the rows to be written; rows in no
        window are left unwritten).
      dtype: float8_e4m3fn or float8_e5m2.
      pow2_scales: scales rounded up to powers of two, stored as their exponent bytes.
      config: see ``Config`` (``heuristic_config(x.dtype, False, "row blocks")``, "gathered row blocks" with
        ``row_tokens``).
      num_sms: CTAs of the persistent grid.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      values_t [C, 128 B] in dtype (zeros past each block's rows) and scales [B, C] (f32, or uint8 exponent bytes);
      with ``copy_rows`` also values [M, C] in dtype and their 1 x 128 blocks' scales [M, ceil(C / 128)].
    """
    cols = x.shape[1]
    gathered = row_tokens is not None
    with_rows = copy_rows is not None
    if gathered and with_rows:
        raise ValueError("copy_rows writes x's own rows: it does not go with row_tokens")
    rows = row_tokens.shape[0] if gathered else x.shape[0]
    (num_blocks,) = first_rows.shape
    col_tiles = pl.cdiv(cols, TILE)
    grid = (num_blocks * col_tiles,)

    def tile_index(index) -> tuple:
        return tile_of(index[0], num_blocks, col_tiles, config.block_band)

    stages = config.stages

    def body(x_gmem, first_rows_gmem, row_counts_gmem, *refs):
        refs = list(refs)
        row_tokens_gmem = refs.pop(0) if gathered else None
        copy_rows_gmem = refs.pop(0) if with_rows else None
        values_t_gmem, scales_gmem = refs.pop(0), refs.pop(0)
        values_gmem, row_scales_gmem = (refs.pop(0), refs.pop(0)) if with_rows else (None, None)
        x_smem, out_smem = refs.pop(0), refs.pop(0)
        rows_smem = refs.pop(0) if with_rows else None
        loaded, consumed = refs
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
            own = pl.ds(pl.multiple_of(wg * _ROWS, _ROWS), _ROWS)

            def quantize(info):
                block, col_tile = tile_index(info.index)
                step = info.local_index
                slot = lax.rem(step, stages)
                # The block's table entries come from global memory: read here, used after the wait and the tile's
                # load, so that their latency passes during those instead of holding up every tile before the wait.
                first_row, row_count = first_rows_gmem[block], row_counts_gmem[block]
                plgpu.barrier_wait(loaded.at[slot])
                x_cols = plgpu.load(x_smem.at[slot, wg].T, layout=_LAYOUT)
                # The consumer's 64 rows of the tile, whole: its two 64-column pieces side by side.
                x_rows = None
                if with_rows:
                    pieces = [plgpu.load(x_smem.at[slot, piece, own, :], layout=_LAYOUT) for piece in range(CONSUMERS)]
                    x_rows = plgpu.layout_cast(lax.concatenate(pieces, 1), _LAYOUT)
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
                # The buffer's previous stores (two tiles back) have finished reading it.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, buffer] = values
                col0 = col_tile * TILE + wg * _ROWS
                scales_gmem[block, pl.ds(col0, _ROWS)] = scale
                if with_rows:
                    # The rows' 1 x 128 blocks lie whole in the tile. Their scales go to the block's own 128 slots
                    # (a scale store from registers has no row mask; the wrapper gathers them into row order).
                    values_rows, (row_scale,) = quantize_rows(x_rows, TILE, dtype, pow2_scales)
                    rows_smem[wg, buffer] = values_rows
                    row_scales_gmem[col_tile, pl.ds(block * TILE + wg * _ROWS, _ROWS)] = row_scale
                plgpu.commit_smem()
                window = values_t_gmem.at[pl.ds(col0, _ROWS), pl.ds(block * TILE, TILE)]
                plgpu.copy_smem_to_gmem(out_smem.at[wg, buffer], window, commit_group=False)
                if with_rows:
                    window_rows = jnp.clip(copy_rows_gmem[block] - wg * _ROWS, 0, _ROWS)
                    destination = values_gmem.at[pl.ds(first_row + wg * _ROWS, _ROWS), pl.ds(col_tile * TILE, TILE)]
                    store_row_prefix(rows_smem.at[wg, buffer], destination, window_rows)
                plgpu.commit_smem_to_gmem_group()

            plgpu.nd_loop(grid, collective_axes="sm")(quantize)
            plgpu.wait_smem_to_gmem(0)

    padded_cols = col_tiles * TILE
    if gathered:
        # The GPU's cp.async rows arrive once per copy call and warpgroup, the interpreter's copies once per row.
        transforms = sm90_gather.smem_transforms(_ROWS, x.dtype, interpret)
        loads = CONSUMERS * (TILE if interpret is not None else 1)
    else:
        transforms, loads = swizzled(x.dtype, (1, cols)), CONSUMERS  # one-row tiles: the module docstring
    scale_bits = scale_bits_dtype(pow2_scales)
    out_type = [
        jax.ShapeDtypeStruct((cols, num_blocks * TILE), dtype),
        # Whole column tiles of scales: a partial tile's rows of x^T past C are stored too, then sliced off.
        jax.ShapeDtypeStruct((num_blocks, padded_cols), scale_bits),
    ]
    out_buffers = [
        plgpu.SMEM((CONSUMERS, 2, _ROWS, TILE), dtype, transforms=swizzled(dtype, (cols, num_blocks * TILE)))
    ]
    if with_rows:
        out_type += [
            jax.ShapeDtypeStruct((rows, cols), dtype),
            jax.ShapeDtypeStruct((col_tiles, num_blocks * TILE), scale_bits),  # block b's rows at [128 b, 128 b + 128)
        ]
        # One-row tiles: a window starts on any row, and stores a prefix of any length (store_row_prefix).
        out_buffers.append(plgpu.SMEM((CONSUMERS, 2, _ROWS, TILE), dtype, transforms=swizzled(dtype, (1, cols))))
    kernel = persistent_kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=[
            plgpu.SMEM((stages, CONSUMERS, TILE, _ROWS), x.dtype, transforms=transforms),
            *out_buffers,
            *ring_barriers(stages, loads=loads),  # a slot's loads: [128, 64] of it per consumer
        ],
        kernel_name=_kernel_name(gathered, with_rows),
        semantics=lowering_semantics(x.dtype, transposed_reads=True),
        num_sms=num_sms,
        interpret=interpret,
    )
    # Rows past M in a block's 128 read token 0 (a row that exists), counted out by the consumers.
    extra = (jnp.pad(row_tokens, (0, TILE)),) if gathered else (copy_rows,) if with_rows else ()
    values_t, scales, *row_copy = kernel(x, first_rows, row_counts, *extra)
    if not with_rows:
        return values_t, scales[:, :cols]
    values, block_row_scales = row_copy
    return values_t, scales[:, :cols], values, block_row_scales[:, row_slots(first_rows, copy_rows, rows)].T


def _kernel_name(gathered: bool, with_rows: bool) -> str:
    if gathered:
        return "moe_quantize_gathered_row_blocks_transposed"
    return "moe_quantize_row_blocks_transposed" + ("_with_rows" if with_rows else "")


def row_slots(first_rows: jax.Array, copy_rows: jax.Array, num_rows: int) -> jax.Array:
    """[M] int32: where the kernel stores row r's scales among the blocks' 128 slots each, 128 b + r - first_rows[b]
    for the block b whose window [first_rows[b], first_rows[b] + copy_rows[b]) holds r (0 for a row in none)."""
    offsets = jnp.arange(TILE, dtype=jnp.int32)[None, :]
    rows = first_rows[:, None] + offsets  # [B, TILE]
    slots = jnp.arange(first_rows.shape[0], dtype=jnp.int32)[:, None] * TILE + offsets
    rows = jnp.where(offsets < copy_rows[:, None], rows, num_rows)  # out of the window: dropped by the scatter
    return jnp.zeros((num_rows,), jnp.int32).at[rows.ravel()].set(slots.ravel(), mode="drop")


def store_row_prefix(src, dst, count) -> None:
    """TMA-stores rows [0, count) of ``src`` [R, W] (shared memory in one-row tiles, R a power of two) to the same
    rows of the window ``dst`` [R, W], for a ``count`` in [0, R] known only at run time: whole, or one copy per set
    bit of ``count`` (a TMA box has a static shape; rows past count belong to another block's window)."""
    size = src.shape[0]

    @pl.when(count == size)
    def _whole():
        plgpu.copy_smem_to_gmem(src, dst, commit_group=False)

    @pl.when(count < size)
    def _pieces():
        piece = size // 2
        while piece:
            # The rows of the larger pieces come first: this one starts where count's higher bits end.
            start = lax.bitwise_and(count, jnp.int32(-2 * piece))

            @pl.when(lax.bitwise_and(count, jnp.int32(piece)) != 0)
            def _piece(start=start, piece=piece):
                rows = pl.ds(start, piece)
                plgpu.copy_smem_to_gmem(src.at[rows], dst.at[rows], commit_group=False)

            piece //= 2
