"""Mosaic GPU (sm90) quantizer for square blocks: w [G, A, B] -> FP8 values with one scale per 128 x 128 block, in
w's own layout and/or transposed ([G, B, A]), from one read of w.

The FP8 grouped matmul reads its weights K-major for the forward ([G, N, K]) and N-major for the dgrad ([G, K, N]),
and a 128 x 128 block is the same block of both, with one scale: the kernel writes both copies from the same loaded
tiles, so that a training step reads the high-precision weights once and writes each FP8 copy once (XLA's path reads
them once per copy and transposes through memory).

One CTA per SM walks the [128, 128] tiles of w (group, row tile, column tile), round-robin over the CTAs. A producer
warpgroup TMA-loads them into a ring of ``config.stages`` buffers; two consumer warpgroups share each tile:

  consumer c  wait loaded[slot]
              rows [64c, 64c + 64) -> registers (for w's layout); columns [64c, 64c + 64), read as rows of w^T
              (ldmatrix's transposing form, for the transposed copy); release the slot
              amax of its half (per row, within threads and quads) -> amax[parity, 64c : 64c + 64] in shared memory
              arrive and wait exchanged[parity]: both halves are there
              the tile's amax: the 128 row maxima read back as a column vector and reduced across the quad
              scale -> values of each copy; TMA-store the FP8 rows; consumer 0 stores the scale (and its transpose)

The two halves cover the tile whichever copy a consumer reads (rows or columns), so one exchange per tile gives the
block's amax. The amax buffer alternates with the step's parity: a consumer writes a half again two tiles later, after
the other consumer has passed the exchange of the tile between, which it reaches only after reading this one.

The arithmetic per block is the reference's (``scales_from_amax``, ``reciprocals``, ``scaled_values``) on registers,
so the kernel and the XLA path agree bit for bit. Rows and columns past A and B read as zeros (no amax notices them)
and the FP8 stores drop them. Power-of-two scales leave as their exponent byte (uint8).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.quant import reference
from moe_jax.ops.quant.config import CONSUMER_REGISTERS, CONSUMERS, TILE, Config
from moe_jax.ops.quant.sm90 import (
    exponent_bytes,
    launch_per_signature,
    lowering_semantics,
    persistent_kernel,
    produce_tiles,
    ring_barriers,
    scale_bits_dtype,
    swizzled,
    tma_windows,
)

_LAYOUT = plgpu.Layout.WGMMA
_COLUMN_VECTOR = plgpu.Layout.WGMMA.reduce(0)  # [TILE] spread over a quad's lanes, each thread 32 of them
_ROWS = TILE // CONSUMERS


@launch_per_signature("dtype", "pow2_scales", "as_is", "transposed", "config", "num_sms", "interpret")
def quantize_square_tiles(
    w: jax.Array,
    *,
    dtype,
    pow2_scales: bool,
    as_is: bool,
    transposed: bool,
    config: Config,
    num_sms: int,
    interpret=None,
) -> tuple[jax.Array, ...]:
    """Quantizes w per 128 x 128 block of its last two axes, into w's layout and/or the transposed one.

    Args:
      w: [G, A, B] bf16, f16 or f32; A and B multiples of 64.
      dtype: float8_e4m3fn or float8_e5m2.
      pow2_scales: scales rounded up to powers of two, stored as their exponent bytes.
      as_is, transposed: which copies to write (at least one).
      config: see ``Config`` (``heuristic_config(w.dtype, as_is and transposed, "square")``).
      num_sms: CTAs of the persistent grid.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      With ``as_is`` values [G, A, B] and scales [G, ceil(A / 128), ceil(B / 128)]; with ``transposed`` values
      [G, B, A] and scales [G, ceil(B / 128), ceil(A / 128)], in that order. Scales are f32, or uint8 exponent bytes
      with ``pow2_scales``.
    """
    if not (as_is or transposed):
        raise ValueError("quantize_square_tiles needs as_is or transposed (or both)")
    groups, rows, cols = w.shape
    grid = (groups, pl.cdiv(rows, TILE), pl.cdiv(cols, TILE))
    stages = config.stages
    scale_bits = scale_bits_dtype(pow2_scales)
    copies = [c for c, wanted in (("as_is", as_is), ("transposed", transposed)) if wanted]

    def body(w_gmem, *refs):
        # refs: (values, scales) per copy, then the scratch: an FP8 buffer per copy, the ring and the rest.
        count = len(copies)
        outputs = {copy: refs[2 * i : 2 * i + 2] for i, copy in enumerate(copies)}
        out_smems = dict(zip(copies, refs[2 * count : 3 * count], strict=True))
        x_smem, amax_smem, loaded, consumed, exchanged = refs[3 * count :]
        wg = lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _producer():
            def window(index):
                group, row_tile, col_tile = index
                return w_gmem.at[group, pl.ds(row_tile * TILE, TILE), pl.ds(col_tile * TILE, TILE)]

            produce_tiles(grid, tma_windows(window, x_smem, loaded), stages, consumed)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            own = pl.ds(pl.multiple_of(wg * _ROWS, _ROWS), _ROWS)

            def tile_amax(half, parity):
                """The block's amax (f32 scalar) from this consumer's half of it ([64, 128] registers)."""
                amax_smem[parity, own] = jnp.max(jnp.abs(half), axis=1).astype(jnp.float32)
                plgpu.barrier_arrive(exchanged.at[parity])
                plgpu.barrier_wait(exchanged.at[parity])
                return jnp.max(plgpu.load(amax_smem.at[parity], layout=_COLUMN_VECTOR))

            def quantize(info):
                group, row_tile, col_tile = info.index
                step = info.local_index
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(loaded.at[slot])
                halves = {}
                if as_is:
                    halves["as_is"] = plgpu.load(x_smem.at[slot, own, :], layout=_LAYOUT)
                if transposed:
                    halves["transposed"] = plgpu.load(x_smem.at[slot, :, own].T, layout=_LAYOUT)
                # The tile is in registers; with the reads ordered before the async proxy's next write to the slot
                # (commit_smem's fence), the producer may refill it.
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed.at[slot])

                scale = reference.scales_from_amax(tile_amax(halves[copies[0]], lax.rem(step, 2)), dtype, pow2_scales)
                reciprocal = reference.reciprocals(scale)
                stored_scale = exponent_bytes(scale) if pow2_scales else scale
                buffer = lax.rem(step, 2)
                # The buffer's previous store (two tiles back) has finished reading it.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                for copy, half in halves.items():
                    out_smems[copy][wg, buffer] = reference.scaled_values(half.astype(jnp.float32), reciprocal, dtype)
                plgpu.commit_smem()
                destinations = {
                    "as_is": (pl.ds(row_tile * TILE + wg * _ROWS, _ROWS), pl.ds(col_tile * TILE, TILE)),
                    "transposed": (pl.ds(col_tile * TILE + wg * _ROWS, _ROWS), pl.ds(row_tile * TILE, TILE)),
                }
                for copy in halves:
                    values_gmem, _ = outputs[copy]
                    window = values_gmem.at[group, *destinations[copy]]
                    plgpu.copy_smem_to_gmem(out_smems[copy].at[wg, buffer], window, commit_group=False)
                plgpu.commit_smem_to_gmem_group()

                @pl.when(wg == 0)
                def _():
                    if as_is:
                        outputs["as_is"][1][group, row_tile, col_tile] = stored_scale
                    if transposed:
                        outputs["transposed"][1][group, col_tile, row_tile] = stored_scale

            plgpu.nd_loop(grid, collective_axes="sm")(quantize)
            plgpu.wait_smem_to_gmem(0)

    shapes = {"as_is": (rows, cols), "transposed": (cols, rows)}
    out_types, out_buffers = [], []
    for copy in copies:
        copy_rows, copy_cols = shapes[copy]
        out_types += [
            jax.ShapeDtypeStruct((groups, copy_rows, copy_cols), dtype),
            jax.ShapeDtypeStruct((groups, pl.cdiv(copy_rows, TILE), pl.cdiv(copy_cols, TILE)), scale_bits),
        ]
        transforms = swizzled(dtype, shapes[copy])
        out_buffers.append(plgpu.SMEM((CONSUMERS, 2, _ROWS, TILE), dtype, transforms=transforms))
    kernel = persistent_kernel(
        body,
        out_type=tuple(out_types),
        scratch_types=[
            *out_buffers,
            plgpu.SMEM((stages, TILE, TILE), w.dtype, transforms=swizzled(w.dtype, (rows, cols))),
            plgpu.SMEM((2, TILE), jnp.float32),  # amax: each consumer's row maxima, by step parity
            *ring_barriers(stages, loads=1),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=2),  # exchanged: both halves' maxima are in amax
        ],
        kernel_name="moe_quantize_square_blocks",
        semantics=lowering_semantics(w.dtype, transposed_reads=transposed),
        num_sms=num_sms,
        interpret=interpret,
    )
    return tuple(kernel(w))
