"""Mosaic GPU (sm90) FP8 wgrad: out[g] = x_g^T . y_g -> [G, P, Q] on block-scaled float8_e4m3fn operands, both
quantized in 128-row blocks from each group's first row (the "fp8_block" recipe's wgrad, reference_fp8.py).

For ``grouped_matmul``'s weight gradient (x, y) = (lhs, dout) gives d rhs [G, K, N], and (dout, lhs) gives it in the
K-major layout [G, N, K]. Hopper's FP8 wgmma reads both operands K-major, and the contraction here is the token axis,
so the kernel reads transposed copies on the group-padded token axis of token_blocks.py: x^T [P, M'] and y^T [Q, M']
in which every group starts on a 128-token boundary. A pipeline step is one 128-token block of one group: its x^T
tile [block_m, 128] is wgmma's A, its y^T tile [block_n, 128] is B read transposed (as the FP8 forward reads w), no
step reads another group's rows and none needs masking.

Promotion, as in the FP8 forward (sm90_fp8.py): each block is multiplied into a fresh accumulator, whose sums of
128 FP8 products the tensor cores keep to about 14 bits, and added to an f32 total with both operands' scales:

    total[p, q] += partial[p, q] * x_scale[b, p] * y_scale[b, q]

x's scales are a column of the tile (wgmma's row layout), y's a row (its column layout: each thread holds the 32
scales of its 32 columns). The scales come MN-major, [blocks, P] and [blocks, Q], and each consumer loads its own
from global memory into registers, one step ahead (during the previous step's MMA), rather than through the
pipeline's ring: a ring slot then holds only what the MMA reads (the async proxy), and its release needs no proxy
fence, which cost 12 % with the scales in the ring (docs/kernels/grouped_matmul.md, "FP8 wgrad"). The total and the
partial of a [64, 128] tile take 64 registers a thread each and the two steps' scales 68, hence block_n = 128, and
the epilogue runs between tiles.

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
from moe_jax.ops.grouped_matmul.token_blocks import GROUP_BLOCKS, GROUP_FIRST_BLOCK, GROUP_ID

DTYPE = jnp.float8_e4m3fn
_ROW_VECTOR = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
_COLUMN_VECTOR = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def check(config: Config) -> None:
    """Raises ValueError where the kernel cannot run this config."""
    if config.block_k != FP8_BLOCK or config.block_n != FP8_BLOCK:
        raise ValueError(f"the FP8 wgrad needs block_k = block_n = {FP8_BLOCK} (one scale block), got {config}")
    if config.overlap_epilogue:
        raise ValueError(
            "the FP8 wgrad runs without the overlapped epilogue (the total, the partial and the scales fill the "
            "registers)"
        )
    if config.grid_minor == "g":
        raise ValueError(f"the FP8 wgrad tiles one group's [P, Q] output: grid_minor must be 'm' or 'n', got {config}")


def smem_bytes(config: Config, out_itemsize: int) -> int:
    """Shared memory of one CTA: the x^T and y^T rings and the epilogue's double buffer, each starting on a
    SMEM_ALIGNMENT boundary (config.Config.smem_bytes's rule)."""
    stages, bm, bn, bk = config.num_stages, config.block_m, config.block_n, config.block_k
    buffers = [stages * bm * bk, stages * bn * bk, 2 * bm * config.epilogue_n * out_itemsize]
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
      config: block_m over P, block_n = block_k = 128, the tile order within a group (``check``); num_sms:
        persistent CTAs; interpret: Mosaic GPU interpreter params or None.

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
        x_smem, y_smem, out_smem, produced, consumed = scratch
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
                    tokens = pl.ds(pl.multiple_of((first + k) * bk, bk), bk)
                    plgpu.copy_gmem_to_smem(x_gmem.at[x_cols, tokens], x_smem.at[slot], produced.at[slot])
                    plgpu.copy_gmem_to_smem(y_gmem.at[y_cols, tokens], y_smem.at[slot], produced.at[slot])

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
                group, first, steps, pi, qi = tile_of(info.index[0])
                x_cols = pl.ds(pi * bm + wg * wg_m, wg_m)
                y_cols = pl.ds(qi * bn, bn)

                def scales_of(k):
                    """Step k's (x scales [wg_m], y scales [block_n]) from global memory. Past the tile's last step
                    (the prefetch after it) and for a group without blocks they read a block that exists."""
                    block = jnp.minimum(first + jnp.clip(k, 0, jnp.maximum(steps - 1, 0)), num_blocks - 1)
                    x_scale = plgpu.load(x_scales_gmem.at[block, x_cols], layout=_ROW_VECTOR, optimized=False)
                    y_scale = plgpu.load(y_scales_gmem.at[block, y_cols], layout=_COLUMN_VECTOR, optimized=False)
                    return x_scale, y_scale

                def step(k, carry):
                    total, (x_scale, y_scale) = carry
                    slot = lax.rem(first_step + k, stages)
                    plgpu.barrier_wait(produced.at[slot])

                    def mma(acc):
                        plgpu.wgmma(acc, x_smem.at[slot, rows], y_smem.at[slot].transpose((1, 0)))
                        # The next step's scales load while the MMA runs; reading acc then waits for it.
                        upcoming = scales_of(k + 1)
                        return plgpu.wgmma_accumulator_load(acc, wait_n=0), upcoming

                    partial, upcoming = pl.run_scoped(mma, plgpu.ACC((wg_m, bn), jnp.float32))
                    # The slot's tiles were read by the MMA alone (the async proxy): no fence before the release.
                    plgpu.barrier_arrive(consumed.at[slot])
                    x_scale = lax.broadcast_in_dim(x_scale, (wg_m, bn), [0])
                    total = total + partial * x_scale * lax.broadcast_in_dim(y_scale, (wg_m, bn), [1])
                    return total, upcoming

                zeros = plgpu.layout_cast(jnp.zeros((wg_m, bn), jnp.float32), plgpu.Layout.WGMMA)
                total, _ = pl.loop(0, steps, init_carry=(zeros, scales_of(0)))(step)
                return steps, (pipe.column_chunks(total.astype(out_dtype), epi_n), (group, pi, qi))

            empty = (pipe.empty_chunks(bn // epi_n, wg_m, epi_n, out_dtype), (jnp.int32(0),) * 3)
            pipe.consume_tiles(work, tile_step, stores, empty, overlap=False)
            plgpu.wait_smem_to_gmem(0)

    num_blocks = x_scales.shape[0]
    # The consumers load the scales themselves, and a load, unlike a TMA copy, does not stop at the array's end: a
    # partial last tile reads zeros here.
    x_scales = jnp.pad(x_scales, [(0, 0), (0, p_tiles * bm - p)])
    y_scales = jnp.pad(y_scales, [(0, 0), (0, q_tiles * bn - q)])
    scratch = [
        plgpu.SMEM((stages, bm, bk), DTYPE, transforms=pipe.swizzled(bk, DTYPE)),
        plgpu.SMEM((stages, bn, bk), DTYPE, transforms=pipe.swizzled(bk, DTYPE)),
        pipe.epilogue_smem(num_wgs, wg_m, epi_n, out_dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # produced: both tiles landed
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
        # Lanes lower in half the time of warpgroups (no layout inference pass).
        compiler_params=plgpu.CompilerParams(
            reduction_scratch_bytes=0, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
        interpret=interpret,
    )
    return kernel(groups, x_t, x_scales, y_t, y_scales)
