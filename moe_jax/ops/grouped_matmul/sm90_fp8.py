"""Block-scaled FP8 operands for the sm90 row kernel: x [M, K] and w [G, N, K] in float8_e4m3fn, x with one scale
per row and 128-wide K block, w with one per 128 x 128 block (the "fp8_block" recipe, reference_fp8.py).

Hopper's wgmma multiplies FP8 only with both operands K-major (w stored [G, N, K], read transposed) and has no
block scaling, and it accumulates FP8 products with about 14 bits of precision. So every pipeline step is one
128-wide K block (block_k = 128: one 128-byte swizzle row of FP8), and a consumer multiplies it into a fresh
accumulator, then folds that into an f32 total with both scales ("promotion", as DeepGEMM does):

    total[r, c] += partial[r, c] * x_scale[k, r] * w_scale[g, c // 128, k]          (block_n = 128: one w_scale)

The scales travel beside the tiles:
  * x's scales come MN-major, [K / 128, M] f32 (launch.py transposes them), so a tile's scales of one K block are
    block_m contiguous floats: the producer TMA-loads them with the step's x and w tiles into a ring of its own
    (the step's "produced" barrier counts three copies);
  * w's scales of one tile are one row of [G, N / 128, K blocks] f32, which each consumer TMA-loads at the tile's
    start into its row of a [consumers, K blocks] buffer and reads as scalars, one per step. K blocks are padded to a
    multiple of 32, so that every row of that buffer starts on the 128 bytes a TMA destination needs.

The consumer reads its x scales while the step's MMA runs, then releases the slot (after a fence: those were
generic-proxy reads of memory the producer's next TMA overwrites). The total and the partial of a [64, 128] tile
take 64 registers a thread each, hence block_n = 128: a 256-column tile would need 256 next to the addresses.
The epilogue stores the total as the plain kernel stores its accumulator (any ``sm90.Epilogue`` forward).
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul.config import FP8_BLOCK, Config, fp8_scale_k_blocks

DTYPE = jnp.float8_e4m3fn
_ROW_VECTOR = plgpu.Layout.WGMMA.reduce(1)


def check(config: Config, *, w_transposed: bool, gathered: bool, overlap: bool) -> None:
    """Raises ValueError where the kernel cannot take FP8 operands this way."""
    if not w_transposed or gathered:
        raise ValueError("FP8 operands need w stored [G, N, K] (w_transposed=True) and no gathered rows")
    if config.block_k != FP8_BLOCK or config.block_n != FP8_BLOCK:
        raise ValueError(f"FP8 operands need block_k = block_n = {FP8_BLOCK} (one scale block), got {config}")
    if overlap:
        raise ValueError(
            "FP8 operands run without the overlapped epilogue (the total and the partial fill the registers)"
        )


def scratch(config: Config, contraction: int) -> list:
    """[the x scales' ring [stages, block_m], the w scales [consumers, K blocks], their "loaded" barriers]."""
    return [
        plgpu.SMEM((config.num_stages, config.block_m), jnp.float32),
        plgpu.SMEM((config.num_compute_wgs, fp8_scale_k_blocks(contraction)), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=config.num_compute_wgs),
    ]


def load_x_scales(x_scales_gmem, k, row0, dst_smem, barrier) -> None:
    """Producer: the x scales of K block ``k`` of the tile's rows [row0, row0 + block_m) into the step's slot."""
    plgpu.copy_gmem_to_smem(x_scales_gmem.at[k, pl.ds(row0, dst_smem.shape[0])], dst_smem, barrier)


def load_w_scales(w_scales_gmem, group, ni, dst_smem, barrier, steps) -> None:
    """Consumer, at a tile's start: the scales of the tile's weight block (column tile ``ni`` of ``group``) along K.

    A zero tile (no steps) loads nothing. The buffer was last read by the previous tile's promotions: those
    generic-proxy reads are ordered before the TMA's write by commit_smem's fence.
    """

    @pl.when(steps > 0)
    def _():
        plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(w_scales_gmem.at[group, ni], dst_smem, barrier)


def promoted_products(first_step, steps, stages: int, produced, consumed, wgmma, scales, shape, wg, *, chain, k_steps):
    """Consumer side of one FP8 tile: its ``steps`` K blocks, each multiplied into a fresh accumulator by
    ``wgmma(acc, slot)`` and added to the f32 total with its scales. Returns the total [wg_block_m, block_n] f32.

    Args:
      first_step, steps: the tile's pipeline steps (counted over the CTA's tiles, as in sm90_pipeline): 0 or
        ``k_steps`` (static).
      stages, produced, consumed: the pipeline's ring.
      scales: (x scales' ring [stages, block_m], this consumer's w scales [K blocks], its "loaded" barrier).
      shape: (wg_block_m, block_n); wg: this consumer.
      chain: Config.fp8_chain: the steps go in chains of this many, within which each step's MMA is issued before
        the previous step is promoted, so that it runs during that promotion; 1 waits for every MMA.
    """
    x_scales_smem, w_scales_smem, w_scales_loaded = scales
    rows = pl.ds(pl.multiple_of(wg * shape[0], shape[0]), shape[0])

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_wait(w_scales_loaded)

    def issue(k, acc):
        slot = lax.rem(first_step + k, stages)
        plgpu.barrier_wait(produced.at[slot])
        wgmma(acc, slot)

    def promote(k, acc, total, wait_n: int):
        """Adds step k's product (in ``acc``, read once at most ``wait_n`` MMA groups are in flight: the next step's)
        times its scales to the total, and releases the step's slot."""
        slot = lax.rem(first_step + k, stages)
        scale = plgpu.load(x_scales_smem.at[slot, rows], layout=_ROW_VECTOR) * w_scales_smem[k]
        partial = plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)
        # The partial is in registers; the fence orders the scales' generic-proxy reads before the producer's next
        # TMA write into the slot.
        plgpu.commit_smem()
        plgpu.barrier_arrive(consumed.at[slot])
        return total + partial * lax.broadcast_in_dim(scale, shape, [0])

    def run_chain(first_k, length: int, total):
        """Steps [first_k, first_k + length): step j's accumulator is scoped inside step j - 1's (a fresh one is a
        new scope), and step j - 1 is promoted once step j is issued."""

        def link(j, total, previous):
            def body(acc):
                issue(first_k + j, acc)
                promoted = total if previous is None else promote(first_k + j - 1, previous, total, 1)
                if j + 1 < length:
                    return link(j + 1, promoted, acc)
                return promote(first_k + j, acc, promoted, 0)

            return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

        return link(0, total, None)

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    chains = pl.loop(0, steps // chain, init_carry=zeros)(lambda i, total: run_chain(i * chain, chain, total))
    tail = k_steps % chain
    if not tail:
        return chains
    # The steps past the last whole chain: one shorter chain, where the tile has steps.
    return pl.loop(0, jnp.minimum(steps, 1), init_carry=chains)(lambda _, total: run_chain(k_steps - tail, tail, total))
