"""Device-side work schedules of the sm90 kernels, computed in XLA from ``group_sizes`` (no host sync).

Row tiles (fwd / dgrad). Every group gets its own tiles, starting at the group's first row rounded down to a
multiple of 8 (Mosaic GPU's TMA into 8-row-tiled shared memory needs 8-aligned row offsets), so no tile computes for
two groups and an empty group gets none. The rows past ``sum(group_sizes)`` form one last segment whose tiles only
write zeros. With block_m = 8 and group sizes [13, 0, 4], M = 24:

    rows     0 ........ 7 8 ........ 15 16 ....... 23
    group    0 0 0 0 0 0 0 0 0 0 0 0 0 2 2 2 2 . . . . . . .     (. = past the sum: written as zeros)
    tiles    [ t0: g0, rows 0-7    ][ t1: g0, 8-12 ]
                                     [ t2: g2, box 8-15, stores 13-15 ][ t3: g2, 16 ]
                                                                       [ t4: zeros, box 16-23, stores 17-23 ]

A tile is (group, first row of its box, first row it stores - box start, rows it stores, and its segment's first
tile and one past its last); its TMA box is always block_m rows, rows it does not store are loaded (harmless) but
never written. Compared with tiles aligned to multiples of block_m (jax's ragged_dot_mgpu), a group costs
ceil((size + start % 8) / block_m) tiles instead of up to one more; inside the kernel a compute warpgroup with no
stored rows in its share of a tile skips its MMAs unless ``Config.keep_ctas_in_step`` (see sm90.py), so a group wastes
under block_m / 2 + 8 rows of MMA work.

Row-tile bands (``row_tile_bands``, for ``Config(grid_minor="g")``): the order in which the kernel walks (row tile,
column tile) work items when bands of row tiles must not mix groups.
"""

import jax
import jax.numpy as jnp

# Rows of the [6, T] row-tile table. The kernels read the first four; row_tile_bands reads the segment bounds (a group's
# tiles, or the zero segment's), which spare it scans over the tiles.
TILE_GROUP, TILE_ROW, TILE_SKIP, TILE_ROWS, TILE_SEG_FIRST, TILE_SEG_END = range(6)
ROW_ALIGN = 8  # tile boxes start at multiples of this many rows
ZERO_TILE = -1  # TILE_GROUP of a tile past sum(group_sizes): no MMA, store zeros


def max_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static bound on the row tiles of any routing: each of the G groups and the zero segment rounds up once."""
    return (num_rows + (num_groups + 1) * (block_m - 1 + ROW_ALIGN - 1)) // block_m


def _prefix_sums(values: jax.Array) -> jax.Array:
    """Inclusive prefix sums of a short [n] int32 vector (n = G or G + 1).

    A masked [n, n] reduction (XLA fuses the mask into the reduction: nothing [n, n] is stored) rather than
    jnp.cumsum, which XLA lowers on the GPU to a reduce-window kernel of its own (4.9 us at G = 128), and the schedule
    runs before every grouped-matmul kernel.
    """
    index = jnp.arange(values.shape[0])
    return jnp.sum(jnp.where(index[None, :] <= index[:, None], values[None, :], 0), axis=1, dtype=values.dtype)


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(first row, one past the last row) of every group, [G] int32 each: negative sizes count as 0 and rows past
    ``num_rows`` are dropped."""
    ends = jnp.minimum(_prefix_sums(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def row_tiles(
    group_sizes: jax.Array, num_rows: int, block_m: int, *, zero_tail: bool = True
) -> tuple[jax.Array, jax.Array]:
    """The fwd/dgrad row-tile table.

    Args:
      group_sizes: [G] int32; negative sizes count as 0 and rows beyond ``num_rows`` are dropped.
      num_rows: M.
      block_m: rows per tile.
      zero_tail: True: the rows past the sum get ZERO_TILE tiles, so the kernel writes zeros there and every output
        row is defined. False: they get no tile and the kernel leaves them unwritten (whatever the output buffer held),
        for callers that never read them. Either way a table without any row holds one ZERO_TILE tile, for row 0, so
        that the kernel always has a tile to read.

    Returns:
      tiles: [6, T] int32 with T = max_row_tiles(M, G, block_m): per tile (group or ZERO_TILE, first row of the box,
        first stored row - first row of the box, rows stored, first tile of its segment, one past its segment's
        last tile); entries at or past ``num_tiles`` are padding.
      num_tiles: [1] int32, the tiles in use.
    """
    _, ends = group_bounds(group_sizes, num_rows)
    # The zero segment [sum, M) is one more "group", so that one table drives both kinds of tile.
    tail_end = num_rows if zero_tail else jnp.maximum(ends[-1], min(num_rows, 1))
    seg_ends = jnp.concatenate([ends, jnp.full((1,), tail_end, jnp.int32)])
    seg_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_ends[:-1]])
    seg_ids = jnp.concatenate([jnp.arange(group_sizes.shape[0], dtype=jnp.int32), jnp.full((1,), ZERO_TILE, jnp.int32)])
    seg_boxes = seg_starts // ROW_ALIGN * ROW_ALIGN
    seg_tiles = jnp.where(seg_ends > seg_starts, (seg_ends - seg_boxes + block_m - 1) // block_m, 0)
    seg_end_tile = _prefix_sums(seg_tiles)
    seg_first_tile = seg_end_tile - seg_tiles
    num_tiles = seg_end_tile[-1]

    capacity = max_row_tiles(num_rows, group_sizes.shape[0], block_m)
    t = jnp.arange(capacity, dtype=jnp.int32)
    # The segment of tile t: the last one whose first tile is <= t (empty segments share their successor's start).
    seg = jnp.searchsorted(seg_end_tile, t, side="right", method="compare_all")
    seg = jnp.minimum(seg, seg_ids.shape[0] - 1).astype(jnp.int32)
    box = seg_boxes[seg] + (t - seg_first_tile[seg]) * block_m
    skip = jnp.clip(seg_starts[seg] - box, 0, block_m)
    rows = jnp.clip(seg_ends[seg] - box, 0, block_m) - skip
    seg_first, seg_end = seg_first_tile[seg], seg_end_tile[seg]
    tiles = jnp.stack([seg_ids[seg], box, skip, jnp.maximum(rows, 0), seg_first, seg_end]).astype(jnp.int32)
    return tiles, num_tiles.reshape(1).astype(jnp.int32)


BAND_FIRST, BAND_WIDTH, BAND_REVERSED = range(3)  # rows of the [3, T] row-tile band table


def row_tile_bands(tiles: jax.Array, num_tiles: jax.Array, max_width: int) -> jax.Array:
    """Bands of row tiles that never cross a group boundary, for ``Config(grid_minor="g")`` (fwd / dgrad / glu_dgrad).

    The kernel walks the row tiles in bands, each band over every column tile with its row tiles fastest (like the
    "m" order). Here a group's row tiles (its segment of the table) are split into the fewest bands of at most
    ``max_width`` tiles, as even as possible, so no band mixes two groups' weight tiles and the CTAs of a band read
    each of them together; every other band of a group walks the column tiles backwards (a snake: the next band
    starts on the weight tile the last one ended on). Elementwise on the table (its segment bounds): no scan.

    Args:
      tiles, num_tiles: row_tiles's table.
      max_width: most row tiles per band (Config.grid_width).

    Returns:
      [3, T] int32: for each row tile, its band's first row tile, the band's width in row tiles, and 1 where the band
      walks the column tiles backwards. Work item ``lin`` of ``num_tiles * n_tiles`` lies in the band of row tile
      ``lin // n_tiles``: a band of width w starting at row tile f holds items [f * n_tiles, (f + w) * n_tiles).
      Row tiles past the last one are bands of their own.
    """
    tile = jnp.arange(tiles.shape[1], dtype=jnp.int32)
    run_first = tiles[TILE_SEG_FIRST]
    run_length = tiles[TILE_SEG_END] - run_first
    real = tile < num_tiles[0]
    run_first, run_length = jnp.where(real, run_first, tile), jnp.where(real, run_length, 1)
    bands_in_run = (run_length + max_width - 1) // max_width
    # Band j of a run of L row tiles in n bands holds positions [j L // n, (j + 1) L // n).
    band = ((tile - run_first + 1) * bands_in_run - 1) // run_length
    band_first = run_first + band * run_length // bands_in_run
    band_width = run_first + (band + 1) * run_length // bands_in_run - band_first
    return jnp.stack([band_first, band_width, band % 2]).astype(jnp.int32)


GROUP_ID, GROUP_START, GROUP_SIZE, GROUP_B_FINITE = range(4)  # rows of the [4, G] wgrad group table


def wgrad_groups(group_sizes: jax.Array, b_rows: jax.Array, block_k: int) -> jax.Array:
    """The wgrad kernel's group table, largest group first.

    Each group's output tiles cost time in proportion to its rows; handing out the longest first (round-robin over
    the SMs) keeps a hot expert from finishing last. Rows past M are dropped.

    The kernel reads a group's rows in block_k chunks from its first row rounded down to ROW_ALIGN, so the first and
    last chunk also hold up to ROW_ALIGN - 1 and block_k - 1 rows of other groups (or past the sum). It always zeroes
    those rows of A, each consumer warpgroup its own columns. Zeroing them in B as well (a tile both consumers read:
    twice the shared-memory traffic and a barrier between them) only matters when one of them is not finite, as
    0 * inf = NaN; GROUP_B_FINITE says whether they all are, from two row windows of B per group (the ROW_ALIGN
    rows at its first row rounded down, and its last chunk): G * (ROW_ALIGN + block_k) rows, not all M.

    Args:
      group_sizes: [G] int32; negative sizes count as 0.
      b_rows: [M, Q], the kernel's B operand (y); M a multiple of ROW_ALIGN.
      block_k: rows per chunk.

    Returns:
      [4, G] int32: per group (in the order the kernel hands them out) its index, first row, rows, and 1 if every
      row of B its chunks read outside it is finite, else 0.
    """
    num_rows = b_rows.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    boxes = starts // ROW_ALIGN * ROW_ALIGN
    last_chunks = boxes + jnp.maximum(-(-(ends - boxes) // block_k) - 1, 0) * block_k
    finite = jnp.stack(
        [
            _foreign_rows_finite(b_rows, window_starts, rows, starts, ends, boxes, last_chunks + block_k)
            for window_starts, rows in ((boxes, ROW_ALIGN), (last_chunks, block_k))
        ]
    )
    b_finite = jnp.all(finite, axis=0) | (ends == starts)
    order = jnp.argsort(-(ends - starts), stable=True).astype(jnp.int32)
    return jnp.stack([order, starts[order], (ends - starts)[order], b_finite[order]]).astype(jnp.int32)


def _foreign_rows_finite(b_rows, window_starts, rows, starts, ends, boxes, chunk_ends) -> jax.Array:
    """[G] bool: whether the rows of ``b_rows[window_starts[g] : + rows]`` that group g reads (in [boxes[g],
    chunk_ends[g])) but does not own (outside [starts[g], ends[g])) are all finite. A window running past M is moved
    back to end at M; one wider than M covers all of it."""
    num_rows = b_rows.shape[0]
    rows = min(rows, num_rows)
    first = jnp.minimum(window_starts, num_rows - rows)
    windows = jax.vmap(lambda at: jax.lax.dynamic_slice_in_dim(b_rows, at, rows))(first)  # [G, rows, Q]
    row = first[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
    read = (row >= boxes[:, None]) & (row < chunk_ends[:, None])
    foreign = read & ((row < starts[:, None]) | (row >= ends[:, None]))
    return jnp.all(jnp.all(jnp.isfinite(windows), axis=-1) | ~foreign, axis=1)


def gather_tile_rows(per_tile: jax.Array, tiles: jax.Array, num_tiles: jax.Array, num_rows: int) -> jax.Array:
    """[C tiles, M] row values from the per-tile rows an epilogue writes (partial sums, scales).

    Args:
      per_tile: [C tiles, T, block_m]: entry (n, t, i) is column tile n's value of box row i of row tile t (only the
        rows that tile stores were written).
      tiles, num_tiles: the row_tiles table the kernel ran on (T entries, ``num_tiles`` in use).
      num_rows: M.

    Every row is stored by exactly one tile and the tiles in use are in row order from row 0, so row r belongs to the
    last tile whose first stored row is <= r: mark each tile's first row with its index and take a running maximum.
    """
    capacity = tiles.shape[1]
    index = jnp.arange(capacity, dtype=jnp.int32)
    first_stored = jnp.where(index < num_tiles[0], tiles[TILE_ROW] + tiles[TILE_SKIP], num_rows)  # padding: dropped
    marks = jnp.zeros((num_rows,), jnp.int32).at[first_stored].set(index, mode="drop")
    tile = jax.lax.cummax(marks, axis=0)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    return per_tile[:, tile, row - tiles[TILE_ROW][tile]]


def gather_row_partials(partials: jax.Array, tiles: jax.Array, num_tiles: jax.Array, num_rows: int) -> jax.Array:
    """[M] row sums from the per-tile partial sums [C tiles, T, block_m] the GLU backward epilogue writes (one per
    column tile, ``gather_tile_rows``)."""
    return jnp.sum(gather_tile_rows(partials, tiles, num_tiles, num_rows), axis=0)
