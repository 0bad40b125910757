"""The warp-specialised TMA -> wgmma pipeline shared by every sm90 grouped-matmul kernel.

One CTA per SM runs ``num_compute_wgs`` consumer warpgroups and one producer warpgroup over a persistent list of
output tiles. Both sides count pipeline steps globally over the CTA's tiles (the loop carry), so buffer
``step % stages`` and the barrier phases line up across tile boundaries:

    producer: for each step: [wait consumed[slot] once the slot was used]  TMA x, w -> slot  (arrive produced[slot])
    consumer: for each step: wait produced[slot]  wgmma (async)  wait until <= 1 wgmma in flight
                             release the previous step's slot (arrive consumed[slot - 1])
                             [overlapped epilogue: store chunk i of the previous tile after step i]
              end of tile:   wait for the last wgmma, release its slot, epilogue (or keep its values for the next tile)

The producer therefore runs up to ``stages`` steps ahead, into the next tile while the consumers are in their
epilogue. Every consumer arrives on every step (also one that skips its MMA), so the barrier phases each thread
tracks stay in step.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir.dialects import nvvm
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul.config import OVERLAP_REGISTERS

PRODUCER_REGISTERS = 40  # the producer warpgroup only computes addresses
THREADS = 128  # per warpgroup
# Rows of the boxes a partial tile's store loops over before its last rows go one at a time (store_rows).
_PARTIAL_BOX_ROWS = 8


def overlaps_epilogue(config, kept_bytes: int) -> bool:
    """Whether ``config.overlap_epilogue`` applies to a consumer keeping ``kept_bytes`` of outputs across tiles: they
    must fit in OVERLAP_REGISTERS (4-byte) registers per thread next to the accumulator."""
    return config.overlap_epilogue and kept_bytes <= OVERLAP_REGISTERS * 4 * THREADS


def swizzled(minor: int, dtype, tile_rows: int = 8) -> tuple:
    """Tiling + swizzle transforms for a shared-memory tile whose last axis has ``minor`` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((tile_rows, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def compute_registers(num_compute_wgs: int) -> int:
    """Registers per thread left to each consumer once the producer shrank to PRODUCER_REGISTERS (64k per SM)."""
    return min(256, (512 - PRODUCER_REGISTERS) // num_compute_wgs) // 8 * 8


def consumed_barriers(num_wgs: int, stages: int):
    """The "consumed" barrier of every pipeline buffer: all consumers released it."""
    return plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages)


@plgpu.inline_mgpu()
def fence_async_shared(ctx) -> None:
    """``fence.proxy.async.shared::cta`` alone: orders this thread's generic-proxy accesses of shared memory against
    async-proxy ones (TMA, wgmma), without the warpgroup barrier that ``plgpu.commit_smem`` adds to it."""
    del ctx
    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def release_after_reads(consumed, *, interpret) -> None:
    """Consumer: releases a ring slot part of which (its scales) this thread read with generic loads.

    The producer's next TMA write into the slot is an async-proxy access, ordered after those reads only by a proxy
    fence before the release. Every thread arrives on the "consumed" barrier for itself (Pallas counts a
    warpgroup's arrival as its 128 threads'), so each thread's own fence suffices and no warpgroup barrier is
    needed. The interpreter runs no inline PTX: there ``commit_smem`` (the fence and a warpgroup barrier), which it
    models, stands in.
    """
    if interpret is None:
        fence_async_shared()
    else:
        plgpu.commit_smem()
    plgpu.barrier_arrive(consumed)


def produce(first_step, num_steps, stages: int, consumed, load) -> None:
    """Producer side of one tile: ``load(k, slot)`` issues the TMA copies of step k into buffer ``slot``."""

    @pl.loop(0, num_steps)
    def _step(k):
        step = first_step + k
        slot = lax.rem(step, stages)

        # The buffer was filled `stages` steps ago (maybe for an earlier tile): wait until it is released.
        @pl.when(step >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        load(k, slot)


def drain(total_steps, stages: int, consumed) -> None:
    """Producer, after its last tile: observe the release of the last buffers, so every barrier ends settled."""

    @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
    def _step(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])


def consume(first_step, num_steps, stages: int, produced, consumed, issue, overlapped=()) -> None:
    """Consumer side of one tile: ``issue(k, slot)`` issues the (async) wgmma of step k on buffer ``slot``.

    ``overlapped``: callables; the i-th runs right after step i is issued (in iteration i of a step loop that runs
    at least ``len(overlapped)`` times, skipping the steps past ``num_steps``), so its work (a piece of the previous
    tile's epilogue) runs while the tensor cores compute. One loop emits the step once: peeling the first steps, one
    copy each plus the loop's, would make the overlapping kernels' code up to 2.3x longer (the bf16 wgrad's) and
    their tracing, lowering and compile longer with it (docs/kernels/grouped_matmul.md, "The overlapped epilogue").
    """

    def step(k):
        step = first_step + k
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(produced.at[slot])
        issue(k, slot)
        # One wgmma group stays in flight; the one before it is done reading its buffer.
        plgpu.wgmma_wait(1)

        @pl.when(k > 0)
        def _release_previous():
            plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])

    if not overlapped:
        pl.loop(0, num_steps)(step)
    else:

        @pl.loop(0, jnp.maximum(num_steps, len(overlapped)))
        def _iteration(k):
            pl.when(k < num_steps)(functools.partial(step, k))
            for i, work in enumerate(overlapped):
                pl.when(k == i)(work)

    @pl.when(num_steps > 0)
    def _last():
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(consumed.at[lax.rem(first_step + num_steps - 1, stages)])


def consume_tiles(work, tile, stores, empty, overlap: bool) -> None:
    """A consumer's persistent loop over the CTA's tiles, with the epilogue stored between tiles or overlapped.

    Args:
      work: the nd_loop shape of the CTA's tiles.
      tile: ``(info, first_step, overlapped) -> (steps, outputs)``: runs the tile's steps (``consume``, passing it
        ``overlapped``: the previous tile's stores, a list the tile may extend) and returns what its epilogue stores.
      stores: ``outputs -> callables`` that store them, in order.
      empty: outputs of the right types: the loop carry before the first tile (with ``overlap``), never stored.
      overlap: the outputs ride the loop carry and their stores run during the next tile's first steps (the last
        tile's after the loop); otherwise each tile stores its own when its steps are done.
    """

    def kept_stores(kept):
        """The stores of the carried outputs; those of ``empty`` (``pending == 0``) do nothing."""
        outputs, pending = kept
        return [functools.partial(pl.when(pending != 0), store) for store in stores(outputs)]

    def body(info, carry):
        first_step, previous = carry
        steps, outputs = tile(info, first_step, kept_stores(previous) if overlap else [])
        if overlap:
            return first_step + steps, (outputs, jnp.int32(1))
        for store in stores(outputs):
            store()
        return first_step + steps, None

    init = (jnp.int32(0), (empty, jnp.int32(0)) if overlap else None)
    _, last = plgpu.nd_loop(work, collective_axes="sm", init_carry=init)(body)
    if overlap:
        for store in kept_stores(last):
            store()


def store_rows(src_smem, index, dst_gmem, row0, start, rows, col) -> None:
    """TMA-stores rows [start, start + rows) of ``src_smem.at[*index]`` [R, C] to ``dst_gmem`` rows row0 + start...

    TMA boxes have static shapes, so a partial tile goes out as a loop of 8-row boxes and then a loop of 1-row boxes
    for the rest (hence the 1-row tiling of the buffer). Two loops instead of one branch per power of two keep the
    kernels' code short: the partial store is most of an epilogue's branches, each traced, lowered and compiled for
    every chunk (docs/kernels/grouped_matmul.md). The copies join the caller's bulk-async group.
    """
    *_, full, cols = src_smem.shape

    def copy(offset, size):
        plgpu.copy_smem_to_gmem(
            src_smem.at[*index, pl.ds(offset, size)],
            dst_gmem.at[pl.ds(row0 + offset, size), pl.ds(col, cols)],
            commit_group=False,
        )

    @pl.when(rows == full)
    def _full():
        copy(0, full)

    @pl.when((rows > 0) & (rows < full))
    def _partial():
        boxes = rows // _PARTIAL_BOX_ROWS
        pl.loop(0, boxes)(lambda box: copy(start + box * _PARTIAL_BOX_ROWS, _PARTIAL_BOX_ROWS))
        first = start + boxes * _PARTIAL_BOX_ROWS
        pl.loop(0, rows - boxes * _PARTIAL_BOX_ROWS)(lambda row: copy(first + row, 1))


def epilogue_smem(num_compute_wgs: int, rows: int, epilogue_n: int, dtype):
    """Each consumer's double buffer for the epilogue: [wgs, 2, rows, epilogue_n], 1-row tiled (see store_rows)."""
    return plgpu.SMEM((num_compute_wgs, 2, rows, epilogue_n), dtype, transforms=swizzled(epilogue_n, dtype, 1))


def store_chunk(c: int, value, out_smem, wg, dst_gmem, row0, start, rows, col, num_cols) -> None:
    """Store number c (static) of one consumer's tile epilogue: TMA-stores a register chunk through buffer c % 2.

    ``value`` [R, epilogue_n] in the buffer's dtype, or a function computing it: rows [start, start + rows) of it go
    to dst_gmem[row0 + start.., col..]. A function runs inside the store's branch, so its arithmetic is emitted next
    to the store and skipped where nothing is stored. A chunk at or past num_cols touches nothing (its bulk group is
    empty); callers number their stores so that none of those comes before a stored one of the same tile.
    """
    # Chunk c reuses the buffer of chunk c - 2; chunk 0 first waits for the previous tile's stores.
    # (The interpreter counts copies, not bulk groups: an empty group between two stores of one buffer would
    # look like a race to it, hence the numbering rule above.)
    if c == 0:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    elif c >= 2:
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)

    @pl.when(col < num_cols)
    def _store():
        out_smem[wg, c % 2] = value() if callable(value) else value
        plgpu.commit_smem()
        store_rows(out_smem, (wg, c % 2), dst_gmem, row0, start, rows, col)

    plgpu.commit_smem_to_gmem_group()


def column_chunks(value, width: int) -> tuple:
    """[R, C] registers -> C / width arrays [R, width], in column order."""
    return tuple(value[:, c : c + width] for c in range(0, value.shape[1], width))


def empty_chunks(count: int, rows: int, width: int, dtype) -> tuple:
    """``count`` zero [rows, width] arrays in the wgmma accumulator's layout (a loop carry's initial value)."""
    return tuple(plgpu.layout_cast(jnp.zeros((rows, width), dtype), plgpu.Layout.WGMMA) for _ in range(count))
