"""Block-scaled FP8 operands for the sm90 row kernel: x [M, K] and w [G, N, K] in float8_e4m3fn, x with one scale
per row and 128-wide K block, w with one per 128 x 128 block (the "fp8_block" recipe, reference_fp8.py).

Hopper's wgmma multiplies FP8 only with both operands K-major (w stored [G, N, K], read transposed) and has no
block scaling, and it accumulates FP8 products with about 14 bits of precision. So every pipeline step is one
128-wide K block (block_k = 128: one 128-byte swizzle row of FP8), and a consumer multiplies each step into a fresh
accumulator (sm90_fresh_product.py: its registers are never zeroed), then folds that into an f32 total with both
scales ("promotion", as DeepGEMM does):

    total[r, c] += partial[r, c] * x_scale[k, r] * w_scale[g, c // 128, k]          (one w_scale per step and block)

A tile is 128 columns (one weight-scale block) or 192 (FP8_WIDE_BLOCK_N): a 192-column tile starts 0 or 64
columns past a block's start and lies over two blocks, and its partial is promoted in 64-column chunks, each with
its own block's scale.

The scales travel beside the tiles:
  * x's scales come MN-major, [K / 128, M] f32 (launch.py transposes them), so a tile's scales of one K block are
    block_m contiguous floats: the producer TMA-loads them with the step's x and w tiles into a ring of its own
    (the step's "produced" barrier counts three copies). Gathered rows (x [T, K] tokens, row r of the product
    x[row_tokens[r]], sm90_gather.py) come with their scales gathered into the rows' order by launch.py: a step's
    128 FP8 values of a row are one 128-byte cp.async segment, as 64 bf16 ones are;
  * w's scales of one tile are one or two rows of [G, N / 128 + 1, K blocks] f32 (a padded block past the last, for
    the last 192-column tile), which each consumer TMA-loads at the tile's start into its [tile blocks, K blocks]
    buffer and reads as scalars, one per step and block. K blocks are padded to a multiple of 32, so that every
    consumer's buffer starts on the 128 bytes a TMA destination needs.

The consumer reads its x scales before it issues the step's MMA (ptxas may schedule loads issued after it between
its k-steps, delaying the later ones: sm90_fp8_wgrad.py), waits for the MMA, promotes, and releases the step's slot
(after a fence: those were generic-proxy reads of memory the producer's next TMA overwrites); the other consumers'
MMAs run during its promotion. Registers bound the tile (``check``): the total of a [64, 128] tile takes 64 a
thread, the partial 64 more, and two consumers get 232 registers, three 152: three consumers of 64 rows (192-row
tiles) fit, two of [64, 192] (96 + 96) too, 128 rows a consumer do not. config.fp8_config picks the consumers and
columns by the output columns. The epilogue stores the total as the plain kernel stores its accumulator (any
``sm90.Epilogue`` forward).
"""

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from moe_jax.ops.grouped_matmul.config import (
    FP8_BLOCK,
    FP8_WIDE_BLOCK_N,
    Config,
    fp8_scale_k_blocks,
    fp8_tile_scale_blocks,
)

DTYPE = jnp.float8_e4m3fn
# Registers a consumer thread needs beside its f32 arrays (addresses, loop counters, the step's scales).
ADDRESS_REGISTERS = 24
_ROW_VECTOR = plgpu.Layout.WGMMA.reduce(1)
# Tile widths: one weight-scale block, or one and a half.
BLOCK_N_CHOICES = (FP8_BLOCK, FP8_WIDE_BLOCK_N)
# Columns promoted with one weight scale: 192-column tiles meet a block boundary at a multiple of 64.
_SCALE_CHUNK = 64


def check(config: Config, *, w_transposed: bool, overlap: bool) -> None:
    """Raises ValueError where the kernel cannot take FP8 operands this way (gathered rows it takes as the bf16
    kernel does: a 128-column FP8 step is one 128-byte segment a row, sm90_gather.py)."""
    if not w_transposed:
        raise ValueError("FP8 operands need w stored [G, N, K] (w_transposed=True)")
    if config.block_k != FP8_BLOCK or config.block_n not in BLOCK_N_CHOICES:
        raise ValueError(
            f"FP8 operands need block_k = {FP8_BLOCK} (one weight-scale block a step) and block_n in "
            f"{BLOCK_N_CHOICES}, got {config}"
        )
    # The total and the partial, [wg_block_m, block_n] f32 each over a warpgroup's 128 threads.
    arrays = 2 * config.wg_block_m * config.block_n // pipe.THREADS
    if arrays > pipe.compute_registers(config.num_compute_wgs) - ADDRESS_REGISTERS:
        raise ValueError(
            f"the total and the partial take {arrays} registers a thread, more than {config.num_compute_wgs} "
            f"consumer(s) can hold beside the addresses: {config}"
        )
    if overlap:
        raise ValueError(
            "FP8 operands run without the overlapped epilogue (the total and the partial fill the registers)"
        )


def ring_swizzle_columns(block_k: int, contraction: int) -> int:
    """Columns of the x and w ring buffers' swizzle: block_k (128 FP8 values, a 128-byte swizzle), or 64 (a 64-byte
    one) where the contraction is 64 off a multiple of 128. Mosaic GPU tiles a whole operand in global memory by its
    swizzle width for TMA, so the contraction must be a multiple of it (launch.run_fp8_forward_kernel pads other
    ones); the last step's box then runs half past the contraction, and TMA zero-fills that half."""
    return math.gcd(block_k, contraction)


def scratch(config: Config, contraction: int) -> list:
    """[the x scales' ring [stages, block_m], the w scales [consumers, tile blocks, K blocks], their "loaded"
    barriers]."""
    w_scales_shape = (config.num_compute_wgs, fp8_tile_scale_blocks(config.block_n), fp8_scale_k_blocks(contraction))
    return [
        plgpu.SMEM((config.num_stages, config.block_m), jnp.float32),
        plgpu.SMEM(w_scales_shape, jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=config.num_compute_wgs),
    ]


def load_x_scales(x_scales_gmem, k, row0, dst_smem, barrier) -> None:
    """Producer: the x scales of K block ``k`` of the tile's rows [row0, row0 + block_m) into the step's slot."""
    plgpu.copy_gmem_to_smem(x_scales_gmem.at[k, pl.ds(row0, dst_smem.shape[0])], dst_smem, barrier)


def load_w_scales(w_scales_gmem, group, col0, dst_smem, barrier, steps) -> None:
    """Consumer, at a tile's start: the scales along K of the weight blocks under the tile's columns (from column
    ``col0`` of ``group``) into ``dst_smem`` [tile blocks, K blocks].

    A zero tile (no steps) loads nothing. The buffer was last read by the previous tile's promotions: those
    generic-proxy reads are ordered before the TMA's write by commit_smem's fence.
    """

    @pl.when(steps > 0)
    def _():
        plgpu.commit_smem()
        blocks = pl.ds(col0 // FP8_BLOCK, dst_smem.shape[0])
        plgpu.copy_gmem_to_smem(w_scales_gmem.at[group, blocks], dst_smem, barrier)


def promoted_products(
    first_step, steps, stages: int, produced, consumed, product, scales, shape, wg, col0, has_rows=None
):
    """Consumer side of one FP8 tile: each of its ``steps`` K blocks multiplied by ``product(slot)`` (the slot's
    [wg_block_m, block_n] f32 product, sm90_fresh_product.py) and added to the f32 total with its scales. Returns the
    total [wg_block_m, block_n] f32.

    A consumer whose rows of the tile are all past its group (``has_rows`` false) multiplies nothing: it waits for
    each step's slot and releases it, and its total is zeros. The choice is made once a tile, not a step: a product
    chosen per step between the MMA and zeros makes ptxas zero its registers at every step.

    Args:
      first_step, steps: the tile's pipeline steps (counted over the CTA's tiles, as in sm90_pipeline).
      stages, produced, consumed: the pipeline's ring.
      scales: (x scales' ring [stages, block_m], this consumer's w scales [tile blocks, K blocks], its "loaded"
        barrier).
      shape: (wg_block_m, block_n); wg: this consumer; col0: the tile's first column.
      has_rows: whether this consumer has rows to store in the tile (a traced bool), or None: it always multiplies.
    """
    x_scales_smem, w_scales_smem, w_scales_loaded = scales
    rows = pl.ds(pl.multiple_of(wg * shape[0], shape[0]), shape[0])

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_wait(w_scales_loaded)

    def tile_scales(k, slot):
        """[wg_block_m, block_n] f32: x_scale[row] * w_scale[column's block] of step k."""
        x_scale = plgpu.load(x_scales_smem.at[slot, rows], layout=_ROW_VECTOR)
        if w_scales_smem.shape[0] == 1:
            return lax.broadcast_in_dim(x_scale * w_scales_smem[0, k], shape, [0])
        # Each 64-column chunk lies in one weight block: the first, or the next one past a 128-column boundary.
        offset = lax.rem(col0, FP8_BLOCK)
        chunk_shape = (shape[0], _SCALE_CHUNK)
        chunks = [
            lax.broadcast_in_dim(x_scale * w_scales_smem[(offset + col) // FP8_BLOCK, k], chunk_shape, [0])
            for col in range(0, shape[1], _SCALE_CHUNK)
        ]
        return jnp.concatenate(chunks, axis=1)

    def step(k, total):
        """Adds step k's product times its scales to the total and releases the step's slot."""
        slot = lax.rem(first_step + k, stages)
        plgpu.barrier_wait(produced.at[slot])
        scale = tile_scales(k, slot)
        partial = product(slot)
        # The partial is in registers; the fence orders the scales' generic-proxy reads before the producer's next
        # TMA write into the slot.
        plgpu.commit_smem()
        plgpu.barrier_arrive(consumed.at[slot])
        return total + partial * scale

    def release(k, total):
        """Releases step k's slot once it is filled (an earlier arrival would count toward its previous use)."""
        slot = lax.rem(first_step + k, stages)
        plgpu.barrier_wait(produced.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])
        return total

    def over_steps(body):
        return lambda: pl.loop(0, steps, init_carry=pipe.empty_chunks(1, *shape, jnp.float32)[0])(body)

    if has_rows is None:
        return over_steps(step)()
    return lax.cond(has_rows, over_steps(step), over_steps(release))
