"""Mosaic GPU (sm90) ragged grouped matmul, row-ragged: out[M, C] = x[M, R] · w[g][R, C] on each row tile of group g.

The forward pass is (x, w) = (lhs, rhs) and dgrad is (x, w^T) = (dout, rhs read transposed): one kernel, the B
operand's shared-memory tile is either [block_k, block_n] (w stored [G, R, C]) or [block_n, block_k] (w stored
[G, C, R], "K-major") and wgmma takes the latter transposed, so no transposed copy of the weights is ever made.

Structure (one CTA per SM, persistent; the pipeline itself is in sm90_pipeline.py):
  * the producer warpgroup streams the block_k slices of the tile's x rows and of w[g] into a ring of swizzled
    shared-memory buffers with TMA, running ahead across tile boundaries;
  * consumer warpgroup w owns rows [w * wg_block_m, (w+1) * wg_block_m) of the tile and accumulates them with
    wgmma; a warpgroup none of whose rows is stored (the tail tile of a group) issues no MMA. The epilogue casts
    the f32 accumulator and TMA-stores the tile's own rows only (sm90_pipeline.store_tile);
  * tiles come from schedule.row_tiles, walked in a planar-snake order over (row tile, column tile); the loop
    bound is read from the device, so empty groups cost nothing and no host sync is needed.

Everything element-type specific sits in the two TMA loads and the wgmma call: an FP8 variant needs both operands
K-major (x is, w must be stored [G, C, R]: ``w_transposed``) plus per-block scales applied to the accumulator.
For a GLU epilogue the tile's [gate | up] column pair can be loaded as one B tile (see docs/kernels/grouped_matmul.md).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from moe_jax.ops.grouped_matmul.config import Config
from moe_jax.ops.grouped_matmul.schedule import ROW_ALIGN, TILE_GROUP, TILE_ROW, TILE_ROWS, TILE_SKIP, ZERO_TILE


def grouped_matmul_rows(
    x: jax.Array,
    w: jax.Array,
    tiles: jax.Array,
    num_tiles: jax.Array,
    *,
    w_transposed: bool,
    out_dtype,
    config: Config,
    num_sms: int,
    interpret=None,
) -> jax.Array:
    """out[M, C] = x[rows of g] · w[g] over the row tiles of schedule.row_tiles.

    Args:
      x: [M, R] with M a multiple of 8 and R of 64.
      w: [G, R, C], or [G, C, R] with ``w_transposed``; C a multiple of 64; same dtype as x (bf16 or f16).
      tiles, num_tiles: schedule.row_tiles(group_sizes, M, config.block_m).
      w_transposed: w's last axis is the contraction.
      out_dtype: output dtype (accumulation is f32).
      config: tile shapes; num_sms: persistent CTAs; interpret: Mosaic GPU interpreter params or None.

    Returns:
      [M, C]: the rows of every tile's group, zeros for the rows of ZERO_TILE tiles.
    """
    m, r = x.shape
    cols = w.shape[1] if w_transposed else w.shape[2]
    cfg = config
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wg_m, num_wgs, stages = cfg.wg_block_m, cfg.num_compute_wgs, cfg.num_stages
    k_steps = pl.cdiv(r, bk)
    n_tiles = pl.cdiv(cols, bn)

    def body(tiles_gmem, count_gmem, x_gmem, w_gmem, out_gmem, x_smem, w_smem, out_smem, produced, consumed):
        num_row_tiles = count_gmem[0]
        wg = lax.axis_index("wg")
        work = (num_row_tiles * n_tiles,)

        def tile_of(lin):
            """Linear work index -> (row tile, column tile), in planar-snake order."""
            shape = (num_row_tiles, n_tiles)
            return plgpu.planar_snake(lin, shape, 0 if cfg.grid_minor == "m" else 1, cfg.grid_width)

        def tile_steps(group):
            return jnp.where(group == ZERO_TILE, 0, k_steps).astype(jnp.int32)

        @pl.when(wg == num_wgs)
        def _producer():
            plgpu.set_max_registers(pipe.PRODUCER_REGISTERS, action="decrease")

            def load_tile(info, carry):
                mi, ni = tile_of(info.index[0])
                group = tiles_gmem[TILE_GROUP, mi]
                row0 = pl.multiple_of(tiles_gmem[TILE_ROW, mi], ROW_ALIGN)

                def blocks(k):
                    ks, ns = pl.ds(k * bk, bk), pl.ds(ni * bn, bn)
                    w_block = w_gmem.at[group, ns, ks] if w_transposed else w_gmem.at[group, ks, ns]
                    return x_gmem.at[pl.ds(row0, bm), ks], w_block

                def load(k, slot):
                    x_block, w_block = blocks(k)
                    plgpu.copy_gmem_to_smem(x_block, x_smem.at[slot], produced.at[slot])
                    plgpu.copy_gmem_to_smem(w_block, w_smem.at[slot], produced.at[slot])

                steps = tile_steps(group)
                pipe.produce(carry, steps, stages, consumed, load)
                return carry + steps

            total_steps = plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))(load_tile)
            pipe.drain(total_steps, stages, consumed)

        @pl.when(wg < num_wgs)
        def _consumer():
            plgpu.set_max_registers(pipe.compute_registers(num_wgs), action="increase")

            @plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))
            def _tile(info, carry):
                mi, ni = tile_of(info.index[0])
                group, row0 = tiles_gmem[TILE_GROUP, mi], tiles_gmem[TILE_ROW, mi]
                skip, rows = tiles_gmem[TILE_SKIP, mi], tiles_gmem[TILE_ROWS, mi]
                # The tile's stored rows within this warpgroup's wg_m-row slice.
                wg_first = jnp.clip(skip - wg * wg_m, 0, wg_m)
                wg_rows = jnp.clip(skip + rows - wg * wg_m, 0, wg_m) - wg_first
                steps = tile_steps(group)

                def mma(acc):
                    def issue(k, slot):
                        @pl.when(wg_rows > 0)
                        def _():
                            x_tile = x_smem.at[slot, pl.ds(pl.multiple_of(wg * wg_m, wg_m), wg_m)]
                            w_tile = w_smem.at[slot].transpose((1, 0)) if w_transposed else w_smem.at[slot]
                            plgpu.wgmma(acc, x_tile, w_tile)

                    pipe.consume(carry, steps, stages, produced, consumed, issue)
                    return acc[...]

                out = pl.run_scoped(mma, plgpu.ACC((wg_m, bn), jnp.float32)).astype(out_dtype)
                pipe.store_tile(out, out_smem, wg, out_gmem, row0 + wg * wg_m, wg_first, wg_rows, ni * bn, cols)
                return carry + steps

            plgpu.wait_smem_to_gmem(0)

    in_dtype = x.dtype
    w_block_shape = (bn, bk) if w_transposed else (bk, bn)
    scratch = [
        plgpu.SMEM((stages, bm, bk), in_dtype, transforms=pipe.swizzled(bk, in_dtype)),
        plgpu.SMEM((stages, *w_block_shape), in_dtype, transforms=pipe.swizzled(w_block_shape[1], in_dtype)),
        pipe.epilogue_smem(num_wgs, wg_m, cfg.epilogue_n, out_dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # produced: the two TMA loads of a step landed
        plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),  # consumed: every consumer released the buffer
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, cols), out_dtype),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=num_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret,
    )
    return kernel(tiles, num_tiles, x, w)
