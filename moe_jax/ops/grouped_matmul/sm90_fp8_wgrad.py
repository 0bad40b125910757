"""Mosaic GPU (sm90) FP8 wgrad: out[g] = x_g^T . y_g -> [G, P, Q] on block-scaled float8_e4m3fn operands, both
quantized in 128-row blocks from each group's first row (the "fp8_block" recipe's wgrad, reference_fp8.py).

For ``grouped_matmul``'s weight gradient (x, y) = (lhs, dout) gives d rhs [G, K, N], and (dout, lhs) gives it in the
K-major layout [G, N, K]. Hopper's FP8 wgmma reads both operands K-major, and the contraction here is the token axis,
so the kernel reads transposed copies on the group-padded token axis of token_blocks.py: x^T [P, M'] and y^T [Q, M']
in which every group starts on a 128-token boundary. A pipeline step is one 128-token block of one group: its x^T
tile [block_m, 128] is wgmma's A, its y^T tile [block_n, 128] is B read transposed (as the FP8 forward reads w), no
step reads another group's rows and none needs masking. The scales come MN-major, [blocks, P] and [blocks, Q], so a
tile's scales of one block are two contiguous rows, which the producer TMA-loads with the step's tiles into rings of
their own (the step's "produced" barrier counts four copies).

Promotion, as in the FP8 forward (sm90_fp8.py): each block is multiplied into a fresh accumulator
(sm90_fresh_product.py), whose sums of 128 FP8 products the tensor cores keep to about 14 bits, and added to an f32
total with both operands' scales:

    total[p, q] += partial[p, q] * x_scale[b, p] * y_scale[b, q]

x's scales are a column of the tile (wgmma's row layout), y's a row (its column layout). The total and the partial
of a consumer's [64, 128] tile take 64 registers a thread each; three consumers on [192, 128] tiles get 152 registers
a thread, which leave no room for the 32 y scales of a thread's 32 columns held at once. So the total is kept as
column chunks of SCALE_COLUMNS, each promoted with the two y scales a thread loads for it just before, and the slot
is released after the promotion. The epilogue runs between tiles.

Work: every group owns ceil(P / block_m) * ceil(Q / block_n) output tiles, handed out round-robin over the SMs,
largest group first (token_blocks.group_table); within a group the tiles follow the planar snake of
``config.grid_minor`` / ``grid_width``. An empty group does no MMA and writes zeros.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from moe_jax.ops.grouped_matmul.config import FP8_BLOCK, SMEM_ALIGNMENT, Config
from moe_jax.ops.grouped_matmul.sm90_fresh_product import fresh_product
from moe_jax.ops.grouped_matmul.token_blocks import GROUP_BLOCKS, GROUP_FIRST_BLOCK, GROUP_ID

DTYPE = jnp.float8_e4m3fn
_ROW_VECTOR = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
_COLUMN_VECTOR = plgpu.Layout.WGMMA.reduce(0)  # one value per column
# The promotion's column chunk: a thread's two columns of it, whose two y scales it loads just before their use.
SCALE_COLUMNS = 8


def check(config: Config) -> None:
    """Raises ValueError where the kernel cannot run this config."""
    if config.block_k != FP8_BLOCK or config.block_n != FP8_BLOCK:
        raise ValueError(f"the FP8 wgrad needs block_k = block_n = {FP8_BLOCK} (one scale block), got {config}")
    if config.overlap_epilogue:
        raise ValueError(
            "the FP8 wgrad runs without the overlapped epilogue (the total and the partial fill the registers)"
        )
    if config.grid_minor == "g":
        raise ValueError(f"the FP8 wgrad tiles one group's [P, Q] output: grid_minor must be 'm' or 'n', got {config}")


def smem_bytes(config: Config, out_itemsize: int) -> int:
    """Shared memory of one CTA: the x^T and y^T rings, their scales' rings and the epilogue's double buffer, each
    starting on a SMEM_ALIGNMENT boundary (config.Config.smem_bytes's rule)."""
    stages, bm, bn, bk = config.num_stages, config.block_m, config.block_n, config.block_k
    buffers = [
        stages * bm * bk,
        stages * bn * bk,
        stages * bm * 4,
        stages * bn * 4,
        2 * bm * config.epilogue_n * out_itemsize,
    ]
    return sum(-(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for size in buffers)


def grouped_matmul_wgrad_fp8(
    x_t: jax.Array,
    x_scales: jax.Array,
    y_t: jax.Array,
    y_scales: jax.Array,
    groups: jax.Array,
    *,
    out_dtype,
    config: Config,
    num_sms: int,
    interpret=None,
) -> jax.Array:
    """out[g][p, q] = sum over group g's blocks b and their tokens t of x_t[p, t] y_t[q, t] x_scales[b, p]
    y_scales[b, q].

    Args:
      x_t: [P, M'] float8_e4m3fn and y_t: [Q, M'] likewise, on the group-padded token axis (token_blocks.py); P and Q
        multiples of 64, M' of 128.
      x_scales: [M' / 128, P] f32 and y_scales: [M' / 128, Q] f32, block b's scale of column p at [b, p].
      groups: token_blocks.group_table(group_sizes, M, 128), [3, G] int32.
      out_dtype: f32, bf16 or f16 (accumulation is f32).
      config: block_m over P (64 rows a consumer), block_n = block_k = 128, the tile order within a group
        (``check``); num_sms: persistent CTAs; interpret: Mosaic GPU interpreter params or None.

    Returns:
      [G, P, Q], zeros for empty groups.
    """
    check(config)
    p, q = x_t.shape[0], y_t.shape[0]
    num_groups = groups.shape[1]
    cfg = config
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wg_m, num_wgs, stages, epi_n = cfg.wg_block_m, cfg.num_compute_wgs, cfg.num_stages, cfg.epilogue_n
    p_tiles, q_tiles = pl.cdiv(p, bm), pl.cdiv(q, bn)
    items_per_group = p_tiles * q_tiles
    minor_dim = 0 if cfg.grid_minor == "m" else 1

    def body(groups_gmem, x_gmem, x_scales_gmem, y_gmem, y_scales_gmem, out_gmem, *scratch):
        x_smem, y_smem, x_scales_smem, y_scales_smem, out_smem, produced, consumed = scratch
        wg = lax.axis_index("wg")
        work = (num_groups * items_per_group,)

        def tile_of(lin):
            """Linear work index -> (group, its first block, its blocks (the tile's steps), p tile, q tile)."""
            gi, t = lax.div(lin, items_per_group), lax.rem(lin, items_per_group)
            pi, qi = plgpu.planar_snake(t, (p_tiles, q_tiles), minor_dim, cfg.grid_width)
            group, first = groups_gmem[GROUP_ID, gi], groups_gmem[GROUP_FIRST_BLOCK, gi]
            return group, first, groups_gmem[GROUP_BLOCKS, gi], pi, qi

        @pl.when(wg == num_wgs)
        def _producer():
            plgpu.set_max_registers(pipe.PRODUCER_REGISTERS, action="decrease")

            def load_tile(info, carry):
                _, first, steps, pi, qi = tile_of(info.index[0])
                x_cols, y_cols = pl.ds(pi * bm, bm), pl.ds(qi * bn, bn)

                def load(k, slot):
                    block = first + k
                    tokens = pl.ds(pl.multiple_of(block * bk, bk), bk)
                    barrier = produced.at[slot]
                    plgpu.copy_gmem_to_smem(x_gmem.at[x_cols, tokens], x_smem.at[slot], barrier)
                    plgpu.copy_gmem_to_smem(y_gmem.at[y_cols, tokens], y_smem.at[slot], barrier)
                    plgpu.copy_gmem_to_smem(x_scales_gmem.at[block, x_cols], x_scales_smem.at[slot], barrier)
                    plgpu.copy_gmem_to_smem(y_scales_gmem.at[block, y_cols], y_scales_smem.at[slot], barrier)

                pipe.produce(carry, steps, stages, consumed, load)
                return carry + steps

            total_steps = plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))(load_tile)
            pipe.drain(total_steps, stages, consumed)

        @pl.when(wg < num_wgs)
        def _consumer():
            plgpu.set_max_registers(pipe.compute_registers(num_wgs), action="increase")
            rows = pl.ds(pl.multiple_of(wg * wg_m, wg_m), wg_m)

            def stores(outputs):
                """One callable per column chunk of a tile's output; rows past P are not stored."""
                chunks, (group, pi, qi) = outputs
                row0 = pi * bm + wg * wg_m
                stored_rows = jnp.clip(p - row0, 0, wg_m)

                def store(c, chunk):
                    col = qi * bn + c * epi_n
                    pipe.store_chunk(c, chunk, out_smem, wg, out_gmem.at[group], row0, 0, stored_rows, col, q)

                return [functools.partial(store, c, chunk) for c, chunk in enumerate(chunks)]

            def tile_step(info, first_step, overlapped):
                del overlapped  # the epilogue runs between tiles (``check``)
                group, _, steps, pi, qi = tile_of(info.index[0])

                def step(k, total):
                    slot = lax.rem(first_step + k, stages)
                    plgpu.barrier_wait(produced.at[slot])
                    # Read before the MMA is issued: read after it, ptxas places the loads between its k-steps.
                    x_scale = plgpu.load(x_scales_smem.at[slot, rows], layout=_ROW_VECTOR)
                    x_tile, y_tile = x_smem.at[slot, rows], y_smem.at[slot].transpose((1, 0))
                    partial = fresh_product(x_tile, y_tile, interpret=interpret)
                    x_scale = lax.broadcast_in_dim(x_scale, (wg_m, SCALE_COLUMNS), [0])
                    promoted = []
                    for c, chunk in enumerate(total):
                        col = c * SCALE_COLUMNS
                        y_scale = plgpu.load(y_scales_smem.at[slot, pl.ds(col, SCALE_COLUMNS)], layout=_COLUMN_VECTOR)
                        y_scale = lax.broadcast_in_dim(y_scale, (wg_m, SCALE_COLUMNS), [1])
                        promoted.append(chunk + partial[:, col : col + SCALE_COLUMNS] * x_scale * y_scale)
                    # Released once promoted: the promotion reads the slot's y scales, with generic-proxy loads
                    # (docs/kernels/grouped_matmul.md, "FP8 wgrad").
                    pipe.release_after_reads(consumed.at[slot], interpret=interpret)
                    return tuple(promoted)

                init = pipe.empty_chunks(bn // SCALE_COLUMNS, wg_m, SCALE_COLUMNS, jnp.float32)
                total = jnp.concatenate(pl.loop(0, steps, init_carry=init)(step), axis=1)
                return steps, (pipe.column_chunks(total.astype(out_dtype), epi_n), (group, pi, qi))

            empty = (pipe.empty_chunks(bn // epi_n, wg_m, epi_n, out_dtype), (jnp.int32(0),) * 3)
            pipe.consume_tiles(work, tile_step, stores, empty, overlap=False)
            plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((stages, bm, bk), DTYPE, transforms=pipe.swizzled(bk, DTYPE)),
        plgpu.SMEM((stages, bn, bk), DTYPE, transforms=pipe.swizzled(bk, DTYPE)),
        # A slot's scales are block_m or block_n floats, multiples of 32: every slot starts on the 128 bytes a TMA
        # destination needs.
        plgpu.SMEM((stages, bm), jnp.float32),
        plgpu.SMEM((stages, bn), jnp.float32),
        pipe.epilogue_smem(num_wgs, wg_m, epi_n, out_dtype),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # produced: both tiles and both scale rows landed
        pipe.consumed_barriers(num_wgs, stages),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, p, q), out_dtype),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=num_wgs + 1,
        thread_name="wg",
        kernel_name="moe_gmm_wgrad_fp8",
        compiler_params=plgpu.CompilerParams(
            reduction_scratch_bytes=0, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
        interpret=interpret,
    )
    return kernel(groups, x_t, x_scales, y_t, y_scales)
