"""Block-scaled FP8 operands for the sm90 row kernel: x [M, K] and w [G, N, K] in float8_e4m3fn, x with one scale
per row and 128-wide K block, w with one per 128 x 128 block (the "fp8_block" recipe, reference_fp8.py).

Hopper's wgmma multiplies FP8 only with both operands K-major (w stored [G, N, K], read transposed) and has no
block scaling, and it accumulates FP8 products with about 14 bits of precision. So every pipeline step is one
128-wide K block (block_k = 128: one 128-byte swizzle row of FP8), and a consumer multiplies each 128-column block
of its tile's step ("a unit": one weight-scale block) into a fresh accumulator, then folds that into an f32 total
with both scales ("promotion", as DeepGEMM does):

    total[r, c] += partial[r, c] * x_scale[k, r] * w_scale[g, c // 128, k]          (one w_scale per unit)

The scales travel beside the tiles:
  * x's scales come MN-major, [K / 128, M] f32 (launch.py transposes them), so a tile's scales of one K block are
    block_m contiguous floats: the producer TMA-loads them with the step's x and w tiles into a ring of its own
    (the step's "produced" barrier counts three copies);
  * w's scales of one tile are block_n / 128 rows of [G, N / 128, K blocks] f32, which each consumer TMA-loads at
    the tile's start into its [block_n / 128, K blocks] of a buffer and reads as scalars, one per unit. K blocks are
    padded to a multiple of 32, so that every row of that buffer starts on the 128 bytes a TMA destination needs.

The consumer reads its x scales while the unit's MMA runs, and releases the step's slot after its last unit (after a
fence: those were generic-proxy reads of memory the producer's next TMA overwrites). Registers bound the tile
(``check``): the total of a [64, block_n] tile takes block_n / 2 a thread, each unit's partial 64, and two consumers
get 232 registers, three 152. Config.fp8_chain > 1 keeps two partials live (the next unit's MMA runs during this
one's promotion), so two consumers of 128-column tiles (192 registers); a 256-column tile (128 + 64) promotes each
unit before issuing the next, and reads its x and w tiles from L2 for twice the MMAs of a 128-column one; three
consumers (192-row tiles of 128 columns, 64 + 64) interleave three warpgroups' MMAs and promotions. The epilogue
stores the total as the plain kernel stores its accumulator (any ``sm90.Epilogue`` forward).
"""

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from moe_jax.ops.grouped_matmul.config import FP8_BLOCK, WGMMA_M, Config, fp8_scale_k_blocks

DTYPE = jnp.float8_e4m3fn
# Registers a consumer thread needs beside its f32 arrays (addresses, loop counters, the step's scales).
ADDRESS_REGISTERS = 24
_ROW_VECTOR = plgpu.Layout.WGMMA.reduce(1)


def check(config: Config, *, w_transposed: bool, gathered: bool, overlap: bool) -> None:
    """Raises ValueError where the kernel cannot take FP8 operands this way."""
    if not w_transposed or gathered:
        raise ValueError("FP8 operands need w stored [G, N, K] (w_transposed=True) and no gathered rows")
    if config.block_k != FP8_BLOCK or config.block_n % FP8_BLOCK:
        raise ValueError(
            f"FP8 operands need block_k = {FP8_BLOCK} and block_n a multiple of it (whole scale blocks), got {config}"
        )
    arrays = config.wg_block_m // 2 * (config.block_n + FP8_BLOCK * (1 + (config.fp8_chain > 1))) // WGMMA_M
    if arrays > pipe.compute_registers(config.num_compute_wgs) - ADDRESS_REGISTERS:
        raise ValueError(
            f"the total and {1 + (config.fp8_chain > 1)} partial(s) take {arrays} registers a thread, more than "
            f"{config.num_compute_wgs} consumer(s) can hold beside the addresses: {config}"
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
    """[the x scales' ring [stages, block_m], the w scales [consumers, block_n / 128, K blocks], their "loaded"
    barriers]."""
    units = config.block_n // FP8_BLOCK
    return [
        plgpu.SMEM((config.num_stages, config.block_m), jnp.float32),
        plgpu.SMEM((config.num_compute_wgs, units, fp8_scale_k_blocks(contraction)), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=config.num_compute_wgs),
    ]


def load_x_scales(x_scales_gmem, k, row0, dst_smem, barrier) -> None:
    """Producer: the x scales of K block ``k`` of the tile's rows [row0, row0 + block_m) into the step's slot."""
    plgpu.copy_gmem_to_smem(x_scales_gmem.at[k, pl.ds(row0, dst_smem.shape[0])], dst_smem, barrier)


def load_w_scales(w_scales_gmem, group, ni, dst_smem, barrier, steps) -> None:
    """Consumer, at a tile's start: the scales along K of the tile's weight blocks (column tile ``ni`` of ``group``)
    into ``dst_smem`` [block_n / 128, K blocks]. Blocks past N read zeros (their columns are not stored).

    A zero tile (no steps) loads nothing. The buffer was last read by the previous tile's promotions: those
    generic-proxy reads are ordered before the TMA's write by commit_smem's fence.
    """
    units = dst_smem.shape[0]

    @pl.when(steps > 0)
    def _():
        plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(w_scales_gmem.at[group, pl.ds(ni * units, units)], dst_smem, barrier)


def promoted_products(first_step, steps, stages: int, produced, consumed, wgmma, scales, shape, wg, *, chain, k_steps):
    """Consumer side of one FP8 tile: its ``steps`` K blocks, each 128-column unit multiplied into a fresh accumulator
    by ``wgmma(acc, slot, unit)`` and added to the f32 total with its scales. Returns the total [wg_block_m, block_n]
    f32.

    Args:
      first_step, steps: the tile's pipeline steps (counted over the CTA's tiles, as in sm90_pipeline): 0 or
        ``k_steps`` (static).
      stages, produced, consumed: the pipeline's ring.
      scales: (x scales' ring [stages, block_m], this consumer's w scales [block_n / 128, K blocks], its "loaded"
        barrier).
      shape: (wg_block_m, block_n); wg: this consumer.
      chain: Config.fp8_chain: the steps go in chains of this many, within which each step's MMA is issued before
        the previous step is promoted, so that it runs during that promotion; 1 waits for every MMA.
    """
    x_scales_smem, w_scales_smem, w_scales_loaded = scales
    rows = pl.ds(pl.multiple_of(wg * shape[0], shape[0]), shape[0])
    units = shape[1] // FP8_BLOCK
    unit_shape = (shape[0], FP8_BLOCK)

    @pl.when(steps > 0)
    def _():
        plgpu.barrier_wait(w_scales_loaded)

    def issue(k, unit: int, acc):
        slot = lax.rem(first_step + k, stages)
        if unit == 0:
            plgpu.barrier_wait(produced.at[slot])
        wgmma(acc, slot, unit)

    def promote(k, unit: int, acc, totals, wait_n: int):
        """Adds unit ``unit`` of step k (in ``acc``, read once at most ``wait_n`` MMA groups are in flight: the next
        unit's) times its scales to its columns of the totals; the step's last unit releases its slot."""
        slot = lax.rem(first_step + k, stages)
        scale = plgpu.load(x_scales_smem.at[slot, rows], layout=_ROW_VECTOR) * w_scales_smem[unit, k]
        partial = plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)
        if unit == units - 1:
            # The partial is in registers; the fence orders the scales' generic-proxy reads before the producer's
            # next TMA write into the slot.
            plgpu.commit_smem()
            plgpu.barrier_arrive(consumed.at[slot])
        promoted = totals[unit] + partial * lax.broadcast_in_dim(scale, unit_shape, [0])
        return totals[:unit] + (promoted,) + totals[unit + 1 :]

    def run_chain(first_k, length: int, totals):
        """Steps [first_k, first_k + length). Chained (``chain`` > 1): unit j's accumulator is scoped inside unit
        j - 1's (a fresh one is a new scope), and unit j - 1 is promoted once unit j is issued. Else each unit is
        issued and promoted in a scope of its own."""
        order = [(j, unit) for j in range(length) for unit in range(units)]
        if chain == 1:
            for j, unit in order:

                def alone(acc, j=j, unit=unit, totals=totals):
                    issue(first_k + j, unit, acc)
                    return promote(first_k + j, unit, acc, totals, 0)

                totals = pl.run_scoped(alone, plgpu.ACC(unit_shape, jnp.float32))
            return totals

        def link(i, totals, previous):
            j, unit = order[i]

            def body(acc):
                issue(first_k + j, unit, acc)
                promoted = totals
                if previous is not None:
                    promoted = promote(first_k + order[i - 1][0], order[i - 1][1], previous, totals, 1)
                if i + 1 < len(order):
                    return link(i + 1, promoted, acc)
                return promote(first_k + j, unit, acc, promoted, 0)

            return pl.run_scoped(body, plgpu.ACC(unit_shape, jnp.float32))

        return link(0, totals, None)

    zeros = tuple(plgpu.layout_cast(jnp.zeros(unit_shape, jnp.float32), plgpu.Layout.WGMMA) for _ in range(units))
    chains = pl.loop(0, steps // chain, init_carry=zeros)(lambda i, totals: run_chain(i * chain, chain, totals))
    tail = k_steps % chain
    if tail:
        # The steps past the last whole chain: one shorter chain, where the tile has steps.
        chains = pl.loop(0, jnp.minimum(steps, 1), init_carry=chains)(
            lambda _, totals: run_chain(k_steps - tail, tail, totals)
        )
    return chains[0] if units == 1 else jnp.concatenate(chains, axis=1)
