"""Mosaic GPU (sm90) quantizer: x [M, K] -> FP8 values and one scale per 1 x b block of each row (b = 128, or
MXFP8's 32), and optionally the same for x^T [K, M] from the same read of x (the weight gradient contracts over M, so
its operand is quantized along M).

One CTA per SM walks the [128, 128] tiles of x, round-robin over the CTAs in row-major order. A producer warpgroup
TMA-loads them into a ring of ``config.stages`` swizzled buffers; two consumer warpgroups share each tile:

  producer    for each tile: [wait consumed[slot] once the slot was used]  TMA x tile -> slot  (arrive loaded[slot])
  consumer c  for each tile: wait loaded[slot]
                             rows [64c, 64c + 64) of the tile -> registers          (x's blocks lie in rows)
                             columns [64c, 64c + 64), read as rows of x^T           (x^T's blocks lie in x's columns)
                             release the slot (arrive consumed[slot])
                             per block: amax -> scale -> values; TMA-store the FP8 rows, store the scales

so every element of x is read from memory once and each FP8 copy written once. Both register tiles are [64, 128] in
the wgmma layout, the columns read through a transposed view of the buffer (ldmatrix's transposing form): each thread
holds 32 elements of each of two rows, and a block's amax is a reduction within a thread and across the four threads
sharing the row. The FP8 rows leave through a double buffer per consumer and copy; the scales are stored from
registers (a TMA box needs 16-byte rows, and a [M, K / b] array rarely has them) MN-major, [K / b, M] for x and
[M / b, K] for x^T, so that a consumer's 64 scales of a block are one contiguous run, and transposed after the kernel
(the FP8 kernels read them MN-major: there the two transposes cancel). Rows past M (columns past K) read as zeros,
which no amax notices; the FP8 stores drop them, and the scales arrays get whole tiles, sliced to size after the
kernel.

The arithmetic per block is the reference's (``scales_from_amax``, ``reciprocals``, ``scaled_values``) on the
registers, so the kernel and the XLA path agree bit for bit. Power-of-two scales leave as their exponent byte (uint8:
what float8_e8m0fnu stores; sm90 has no conversion to that type).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.quant import reference
from moe_jax.ops.quant.config import CONSUMER_REGISTERS, CONSUMERS, PRODUCER_REGISTERS, TILE, Config

_LAYOUT = plgpu.Layout.WGMMA
_ROWS = TILE // CONSUMERS  # rows of a tile (and of x^T's) that one consumer quantizes
_F32_FRACTION_BITS = 23
_SWIZZLE_ROWS = 8  # rows of one swizzle pattern: 8 x 16-byte chunks


def swizzled(dtype, gmem_shape: tuple[int, int]) -> tuple:
    """Tiling + swizzle of a shared-memory tile with TILE columns of ``dtype`` that TMA copies to or from an array of
    ``gmem_shape``. Mosaic GPU wants the array's dims to be multiples of the tiling's, hence the widest swizzle (128
    bytes at most) whose columns divide the array's, and 8-row tiles where they divide its rows (8 rows of 16-byte
    chunks are one swizzle pattern: ldmatrix reads a chunk of 8 rows without bank conflicts). Other row counts take
    1-row tiles, where the two 128-byte halves of a 16-bit row share the pattern: 2-way conflicts."""
    rows, cols = gmem_shape
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(math.gcd(TILE, cols) * itemsize * 8)
    tiling = plgpu.TilingTransform((_SWIZZLE_ROWS if rows % _SWIZZLE_ROWS == 0 else 1, swizzle // itemsize))
    return (tiling,) if swizzle == 16 else (tiling, plgpu.SwizzleTransform(swizzle))


def scale_bits_dtype(pow2_scales: bool):
    """What the kernel stores per block: f32 scales, or the exponent byte of a power-of-two scale."""
    return jnp.uint8 if pow2_scales else jnp.float32


def quantize_rows(tile, block: int, dtype, pow2_scales: bool):
    """[R, TILE] registers (wgmma layout), ``block`` | TILE -> ([R, TILE] FP8 values, the scales of the TILE / block
    column blocks as stored: [R] f32 or exponent bytes each)."""
    column_blocks = [tile[:, c : c + block] for c in range(0, TILE, block)]
    amax = [jnp.max(jnp.abs(values), axis=1).astype(jnp.float32) for values in column_blocks]
    scales = [reference.scales_from_amax(a, dtype, pow2_scales) for a in amax]
    per_element = [lax.broadcast_in_dim(reference.reciprocals(s), (tile.shape[0], block), (0,)) for s in scales]
    per_element = plgpu.layout_cast(lax.concatenate(per_element, 1) if len(scales) > 1 else per_element[0], _LAYOUT)
    values = reference.scaled_values(tile.astype(jnp.float32), per_element, dtype)
    if pow2_scales:
        scales = [exponent_bytes(s) for s in scales]
    return values, scales


def exponent_bytes(scales):
    """Power-of-two f32 scales -> their biased exponents as uint8 (float8_e8m0fnu's bits): a power of two's f32 bits
    are its biased exponent, shifted; NaN's exponent byte is 0xFF, e8m0's NaN."""
    bits = lax.bitcast_convert_type(scales, jnp.uint32)
    return lax.shift_right_logical(bits, jnp.uint32(_F32_FRACTION_BITS)).astype(jnp.uint8)


def tma_windows(window, x_smem, loaded):
    """``fill(index, slot)`` for ``produce_tiles``: TMA-loads ``window(index)`` (a [TILE, TILE] window of the input)
    into ``x_smem[slot]``, arriving at ``loaded[slot]``.

    A ring [stages, P, TILE, TILE / P] takes each window as P column pieces, one copy each (``loaded`` then counts P
    arrivals; sm90_row_blocks.py says why).
    """

    def fill(index, slot):
        src = window(index)
        if x_smem.ndim == 3:
            plgpu.copy_gmem_to_smem(src, x_smem.at[slot], loaded.at[slot])
            return
        width = x_smem.shape[-1]
        for piece in range(x_smem.shape[1]):
            columns = pl.ds(piece * width, width)
            plgpu.copy_gmem_to_smem(src.at[:, columns], x_smem.at[slot, piece], loaded.at[slot])

    return fill


def produce_tiles(grid: tuple[int, ...], fill, stages: int, consumed) -> None:
    """The producer warpgroup of a quantizer: ``fill(tile index, slot)`` loads each tile of ``grid`` that this CTA
    takes (``nd_loop``'s round-robin) into ring slot ``slot`` of ``stages`` (e.g. ``tma_windows``); a slot is
    refilled once both consumers arrived at ``consumed[slot]``."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def load(info, carry):
        step = info.local_index
        slot = lax.rem(step, stages)

        # The slot held the tile `stages` steps back: wait until both consumers have read it.
        @pl.when(step >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        fill(info.index, slot)
        return carry + 1

    steps = plgpu.nd_loop(grid, collective_axes="sm", init_carry=jnp.int32(0))(load)

    # Observe the release of the last slots too, so that every barrier ends with no phase pending.
    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _drain(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])


def lowering_semantics(in_dtype, transposed_reads: bool) -> plgpu.LoweringSemantics:
    """How a quantizer reading ``in_dtype`` tiles (also transposed, with ``transposed_reads``) lowers.

    The lane semantics take the kernel's explicit layouts as they are, with no layout inference over the module:
    about a third less lowering time (the FP8 training step's layer launches 20 quantizers). Mosaic GPU has no
    transposing load of a 32-bit tile into the WGMMA layout under them; the warpgroup semantics' layout inference
    finds one."""
    if transposed_reads and jnp.dtype(in_dtype).itemsize == 4:
        return plgpu.LoweringSemantics.Warpgroup
    return plgpu.LoweringSemantics.Lane


def persistent_kernel(body, *, out_type, scratch_types, kernel_name: str, semantics, num_sms: int, interpret):
    """``plgpu.kernel`` of a quantizer: one persistent CTA per SM, CONSUMERS warpgroups and the producer (the last
    "wg"), the scratch ending in its ring's "loaded" and "consumed" barriers (``ring_barriers``), lowered under
    ``semantics`` (``lowering_semantics``)."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=kernel_name,
        # Every reduction stays within a warp (a block of a row lies in one quad of lanes; a tile's amax meets in a
        # buffer of the kernel's own), so no shared memory is set aside for cross-warp ones: an f32 ring of three
        # stages with one FP8 copy fits only so.
        compiler_params=plgpu.CompilerParams(lowering_semantics=semantics, reduction_scratch_bytes=0),
        interpret=interpret,
    )


def ring_barriers(stages: int, loads: int) -> list:
    """[loaded: a slot's ``loads`` TMA copies landed, consumed: both consumers read the slot], per ring slot."""
    return [
        plgpu.Barrier(num_arrivals=loads, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    ]


def launch_per_signature(*static_argnames: str):
    """Decorates a kernel launch with ``jax.jit``, these keyword arguments static: the launches of one program on
    equal operand types and options then share one trace and one lowering of the kernel (the FP8 training step's
    layer quantizes several arrays of one shape)."""
    return functools.partial(jax.jit, static_argnames=static_argnames)


@launch_per_signature("block", "dtype", "pow2_scales", "with_transpose", "config", "num_sms", "interpret")
def quantize_tiles(
    x: jax.Array,
    *,
    block: int,
    dtype,
    pow2_scales: bool,
    with_transpose: bool,
    config: Config,
    num_sms: int,
    interpret=None,
) -> tuple[jax.Array, ...]:
    """Quantizes x per 1 x ``block`` block of its rows (and of x^T's rows with ``with_transpose``).

    Args:
      x: [M, K] bf16, f16 or f32; K (and M with ``with_transpose``) a multiple of 64.
      block: 32 or 128.
      dtype: float8_e4m3fn or float8_e5m2.
      pow2_scales: scales rounded up to powers of two, stored as their exponent bytes.
      with_transpose: also quantize x^T.
      config: see ``Config``.
      num_sms: CTAs of the persistent grid.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      values [M, K] dtype and scales [M, ceil(K / block)]; with ``with_transpose`` also values [K, M] and scales
      [K, ceil(M / block)] of x^T. Scales are f32, or uint8 exponent bytes with ``pow2_scales``.
    """
    rows, cols = x.shape
    grid = (pl.cdiv(rows, TILE), pl.cdiv(cols, TILE))
    blocks_per_tile = TILE // block
    stages = config.stages
    scale_bits = scale_bits_dtype(pow2_scales)

    def body(x_gmem, *refs):
        if with_transpose:
            values_gmem, scales_gmem, values_t_gmem, scales_t_gmem, *scratch = refs
            x_smem, out_smem, out_t_smem, loaded, consumed = scratch
        else:
            values_gmem, scales_gmem, *scratch = refs
            x_smem, out_smem, loaded, consumed = scratch
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _producer():
            def window(index):
                row_tile, col_tile = index
                return x_gmem.at[pl.ds(row_tile * TILE, TILE), pl.ds(col_tile * TILE, TILE)]

            produce_tiles(grid, tma_windows(window, x_smem, loaded), stages, consumed)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            own = pl.ds(pl.multiple_of(wg * _ROWS, _ROWS), _ROWS)

            def quantize(info):
                row_tile, col_tile = info.index
                step = info.local_index
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(loaded.at[slot])
                x_rows = plgpu.load(x_smem.at[slot, own, :], layout=_LAYOUT)
                x_cols = plgpu.load(x_smem.at[slot, :, own].T, layout=_LAYOUT) if with_transpose else None
                # Both tiles are in registers; with the reads ordered before the async proxy's next write to the slot
                # (commit_smem's fence), the producer may refill it.
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed.at[slot])

                buffer = lax.rem(step, 2)
                # The buffer's previous store (two tiles back) has finished reading it.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                row0, col0 = row_tile * TILE + wg * _ROWS, col_tile * TILE
                values, scales = quantize_rows(x_rows, block, dtype, pow2_scales)
                out_smem[wg, buffer] = values
                for c, scale in enumerate(scales):
                    scales_gmem[col_tile * blocks_per_tile + c, pl.ds(row0, _ROWS)] = scale
                if with_transpose:
                    values_t, scales_t = quantize_rows(x_cols, block, dtype, pow2_scales)
                    out_t_smem[wg, buffer] = values_t
                    for c, scale in enumerate(scales_t):
                        scales_t_gmem[row_tile * blocks_per_tile + c, pl.ds(col0 + wg * _ROWS, _ROWS)] = scale
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg, buffer],
                    values_gmem.at[pl.ds(row0, _ROWS), pl.ds(col0, TILE)],
                    commit_group=False,
                )
                if with_transpose:
                    plgpu.copy_smem_to_gmem(
                        out_t_smem.at[wg, buffer],
                        values_t_gmem.at[pl.ds(col0 + wg * _ROWS, _ROWS), pl.ds(row_tile * TILE, TILE)],
                        commit_group=False,
                    )
                plgpu.commit_smem_to_gmem_group()

            plgpu.nd_loop(grid, collective_axes="sm")(quantize)
            plgpu.wait_smem_to_gmem(0)

    out_types = [
        jax.ShapeDtypeStruct((rows, cols), dtype),
        # MN-major: stored [M, K blocks], each of a consumer's 64 scales would be a write of its own.
        jax.ShapeDtypeStruct((grid[1] * blocks_per_tile, grid[0] * TILE), scale_bits),
    ]
    out_buffers = [plgpu.SMEM((CONSUMERS, 2, _ROWS, TILE), dtype, transforms=swizzled(dtype, (rows, cols)))]
    if with_transpose:
        out_types += [
            jax.ShapeDtypeStruct((cols, rows), dtype),
            # x^T's scales MN-major likewise, [M blocks, K] (stored [K, M blocks], the pass takes about 9 % longer
            # on an H200; docs/design.md, "FP8").
            jax.ShapeDtypeStruct((grid[0] * blocks_per_tile, grid[1] * TILE), scale_bits),
        ]
        out_buffers.append(plgpu.SMEM((CONSUMERS, 2, _ROWS, TILE), dtype, transforms=swizzled(dtype, (cols, rows))))
    kernel = persistent_kernel(
        body,
        out_type=tuple(out_types),
        scratch_types=[
            plgpu.SMEM((stages, TILE, TILE), x.dtype, transforms=swizzled(x.dtype, x.shape)),
            *out_buffers,
            *ring_barriers(stages, loads=1),
        ],
        kernel_name="moe_quantize_blockwise",
        semantics=lowering_semantics(x.dtype, with_transpose),
        num_sms=num_sms,
        interpret=interpret,
    )
    outputs = kernel(x)
    # The scales arrays have whole tiles; keep those of x (and of x^T), each block's row of scales a column again.
    values, scales, *transposed = outputs
    results = [values, scales[: pl.cdiv(cols, block), :rows].T]
    if with_transpose:
        values_t, scales_t = transposed
        results += [values_t, scales_t[: pl.cdiv(rows, block), :cols].T]
    return tuple(results)
