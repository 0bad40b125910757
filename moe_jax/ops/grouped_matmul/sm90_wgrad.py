"""Mosaic GPU (sm90) ragged-contraction grouped matmul (wgrad): out[g] = x[rows of g]^T · y[rows of g] -> [G, P, Q].

For ``grouped_matmul``'s weight gradient (x, y) = (lhs, dout) gives d rhs [G, K, N], and (dout, lhs) gives it in the
K-major layout [G, N, K]. Neither operand is copied or transposed in memory: the x tile is loaded [block_k rows,
block_m] and wgmma reads it transposed (bf16/f16 wgmma takes a transposed A from shared memory).

Work: every group owns ceil(P / block_m) * ceil(Q / block_n) output tiles, handed out round-robin over the SMs,
largest group first (schedule.wgrad_groups); within a group the tiles follow a planar snake over (P tile, Q tile)
(``config.grid_minor`` / ``grid_width``), so that a band of x or y blocks stays in L2 while the other operand
streams past it once.

A tile's pipeline walks the group's rows in block_k chunks from the group start rounded down to 8 (the TMA row
alignment); the first and last chunk also hold rows of the neighbouring groups, so before their MMA each consumer
zeroes those rows of its own x columns in shared memory (``where``, not a multiply, so that NaN or Inf there cannot
leak in). The y tile is shared by the consumers: its foreign rows are zeroed too (each consumer a share, then a
barrier) only for a group whose table entry says one of them is not finite, since 0 * finite = 0 (zeroing them
always makes qwen3-30b down's wgrad 8% slower and gpt-oss-120b down's 29% on an H100).
An empty group does no MMA and writes zeros.

The pipeline (producer warpgroup + consumers splitting the tile's P rows) is sm90_pipeline's. With
``config.overlap_epilogue`` (the tuned default: a group's rows make short tiles, 4-5 steps at 128 experts) a
consumer stores each tile's output during the first steps of its next tile.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from moe_jax.ops.grouped_matmul.config import Config
from moe_jax.ops.grouped_matmul.schedule import GROUP_B_FINITE, GROUP_ID, GROUP_SIZE, GROUP_START, ROW_ALIGN


def mask_rows(ref, first_row, start, end) -> None:
    """Zeroes the rows of the shared-memory tile ``ref`` [R, C] whose row first_row + i lies outside [start, end)."""
    tile = ref[...]
    row = first_row + plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=plgpu.Layout.WGMMA)
    ref[...] = jnp.where((row >= start) & (row < end), tile, jnp.zeros_like(tile))


def grouped_matmul_wgrad(
    x: jax.Array,
    y: jax.Array,
    groups: jax.Array,
    *,
    out_dtype,
    config: Config,
    num_sms: int,
    interpret=None,
) -> jax.Array:
    """out[g] = x[rows of g]^T · y[rows of g] for every group g.

    Args:
      x: [M, P] and y: [M, Q], same dtype (bf16 or f16); M a multiple of 8, P and Q multiples of 64.
      groups: schedule.wgrad_groups(group_sizes, y, config.block_k).
      out_dtype: output dtype (accumulation is f32).
      config: tile shapes (block_m over P, block_n over Q, block_k over rows) and the tile order within a group
        (grid_minor "m": P tiles fastest); num_sms: persistent CTAs; interpret: Mosaic GPU interpreter
        params or None.

    Returns:
      [G, P, Q], zeros for empty groups.
    """
    m, p = x.shape
    q = y.shape[1]
    num_groups = groups.shape[1]
    cfg = config
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wg_m, num_wgs, stages = cfg.wg_block_m, cfg.num_compute_wgs, cfg.num_stages
    wg_n = bn // num_wgs  # columns of y each consumer zeroes in a masked chunk
    swizzle_cols = 128 // jnp.dtype(y.dtype).itemsize
    if wg_n % swizzle_cols:
        # A consumer's share of the y tile is a slice of its 128-byte swizzle rows: whole rows only.
        raise ValueError(
            f"wgrad splits block_n={bn} over {num_wgs} compute warpgroups, so each zeroes {wg_n} columns of y, which "
            f"must be a multiple of {swizzle_cols}: block_n must be a multiple of {swizzle_cols * num_wgs} here, got "
            f"{cfg}"
        )
    epi_n = cfg.epilogue_n
    # The overlapped epilogue keeps the [wg_m, bn] output tile in registers across tiles where it fits.
    overlap = pipe.overlaps_epilogue(cfg, wg_m * bn * jnp.dtype(out_dtype).itemsize)
    p_tiles, q_tiles = pl.cdiv(p, bm), pl.cdiv(q, bn)
    items_per_group = p_tiles * q_tiles
    if cfg.grid_minor == "g":
        raise ValueError(f"wgrad tiles one group's [K, N] output: grid_minor must be 'm' or 'n', got {cfg}")
    minor_dim = 0 if cfg.grid_minor == "m" else 1

    def body(groups_gmem, x_gmem, y_gmem, out_gmem, x_smem, y_smem, out_smem, produced, consumed, masked):
        wg = lax.axis_index("wg")
        work = (num_groups * items_per_group,)

        def tile_of(lin):
            """Linear work index -> (group, first row, rows, first chunk row, steps, p tile, q tile, whether y's
            foreign rows are finite)."""
            gi, t = lax.div(lin, items_per_group), lax.rem(lin, items_per_group)
            pi, qi = plgpu.planar_snake(t, (p_tiles, q_tiles), minor_dim, cfg.grid_width)
            group = groups_gmem[GROUP_ID, gi]
            start, size = groups_gmem[GROUP_START, gi], groups_gmem[GROUP_SIZE, gi]
            box = lax.div(start, ROW_ALIGN) * ROW_ALIGN
            steps = jnp.where(size > 0, pl.cdiv(start + size - box, bk), 0).astype(jnp.int32)
            y_finite = groups_gmem[GROUP_B_FINITE, gi] != 0
            return group, start, size, box, steps, pi, qi, y_finite

        @pl.when(wg == num_wgs)
        def _producer():
            plgpu.set_max_registers(pipe.PRODUCER_REGISTERS, action="decrease")

            def load_tile(info, carry):
                _, _, _, box, steps, pi, qi, _ = tile_of(info.index[0])
                x_cols = pl.ds(pi * bm, bm)

                def load(k, slot):
                    rows = pl.ds(pl.multiple_of(box + k * bk, ROW_ALIGN), bk)
                    plgpu.copy_gmem_to_smem(x_gmem.at[rows, x_cols], x_smem.at[slot], produced.at[slot])
                    plgpu.copy_gmem_to_smem(y_gmem.at[rows, pl.ds(qi * bn, bn)], y_smem.at[slot], produced.at[slot])

                pipe.produce(carry, steps, stages, consumed, load)
                return carry + steps

            total_steps = plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))(load_tile)
            pipe.drain(total_steps, stages, consumed)

        @pl.when(wg < num_wgs)
        def _consumer():
            plgpu.set_max_registers(pipe.compute_registers(num_wgs), action="increase")
            wg_cols = pl.ds(pl.multiple_of(wg * wg_m, wg_m), wg_m)

            def stores(outputs):
                """One callable per column chunk of a tile's output."""
                chunks, (group, pi, qi) = outputs
                row0 = pi * bm + wg * wg_m

                def store(c, chunk):
                    col = qi * bn + c * epi_n
                    pipe.store_chunk(c, chunk, out_smem, wg, out_gmem.at[group], row0, 0, wg_m, col, q)

                return [functools.partial(store, c, chunk) for c, chunk in enumerate(chunks)]

            def tile_step(info, first_step, overlapped):
                group, start, size, box, steps, pi, qi, y_finite = tile_of(info.index[0])

                def mma(acc):
                    def issue(k, slot):
                        first_row = box + k * bk

                        # The group's first and last chunks hold rows of other groups: zero them in x (each
                        # consumer its own columns) and, where one is not finite, in y (a share each, then all
                        # meet at `masked`).
                        @pl.when((first_row < start) | (first_row + bk > start + size))
                        def _mask():
                            mask_rows(x_smem.at[slot, :, wg_cols], first_row, start, start + size)

                            @pl.when(~y_finite)
                            def _mask_y():
                                y_cols = pl.ds(pl.multiple_of(wg * wg_n, wg_n), wg_n)
                                mask_rows(y_smem.at[slot, :, y_cols], first_row, start, start + size)

                            plgpu.commit_smem()

                            @pl.when(~y_finite)
                            def _meet():
                                plgpu.barrier_arrive(masked.at[0])
                                plgpu.barrier_wait(masked.at[0])

                        plgpu.wgmma(acc, x_smem.at[slot, :, wg_cols].transpose((1, 0)), y_smem.at[slot])

                    pipe.consume(first_step, steps, stages, produced, consumed, issue, overlapped)
                    return acc[...]

                out = pl.run_scoped(mma, plgpu.ACC((wg_m, bn), jnp.float32)).astype(out_dtype)
                return steps, (pipe.column_chunks(out, epi_n), (group, pi, qi))

            empty = (pipe.empty_chunks(bn // epi_n, wg_m, epi_n, out_dtype), (jnp.int32(0),) * 3)
            pipe.consume_tiles(work, tile_step, stores, empty, overlap)
            plgpu.wait_smem_to_gmem(0)

    in_dtype = x.dtype
    scratch = [
        plgpu.SMEM((stages, bk, bm), in_dtype, transforms=pipe.swizzled(bm, in_dtype)),
        plgpu.SMEM((stages, bk, bn), in_dtype, transforms=pipe.swizzled(bn, in_dtype)),
        pipe.epilogue_smem(num_wgs, wg_m, cfg.epilogue_n, out_dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # produced: the two TMA loads of a step landed
        pipe.consumed_barriers(num_wgs, stages),
        plgpu.Barrier(num_arrivals=num_wgs, num_barriers=1),  # masked: every consumer zeroed its share
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, p, q), out_dtype),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=num_wgs + 1,
        thread_name="wg",
        kernel_name="moe_gmm_wgrad",
        # Lanes lower in half the time of warpgroups (no layout inference pass) and run the same.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return kernel(groups, x, y)
