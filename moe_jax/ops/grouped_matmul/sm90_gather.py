"""Gathered lhs rows for the sm90 row kernel: the tile's x rows are ``x[row_tokens[r]]`` (no permuted copy of x).

Hopper's TMA has no row gather (Blackwell's has), so on the GPU the producer warpgroup's 128 threads copy the rows
with cp.async, 16 bytes per thread and instruction, writing the 128-byte swizzle of the wgmma operand themselves:

    thread t: column chunk t % 8 (16 bytes) of rows t // 8 + 16 i, i < block_m / 16, for each 64-column tile

so that one warp instruction moves four whole 128-byte row segments (coalesced). A cp.async completes on its own
schedule; a thread knows its copies landed only after ``cp.async.wait_group``. The producer therefore signals a
stage LAG steps late: after issuing step s it waits until at most LAG of its commit groups are pending, fences the
generic-proxy writes against the tensor cores' async-proxy reads, and arrives on step s - LAG's barrier (the other
arrival on that barrier is the weights' TMA). LAG <= stages - 2 keeps the pipeline deadlock-free: a consumer waiting
for step j has released every step up to j - 2, so the producer can fill step j + LAG.

Under the Mosaic GPU interpreter (CPU tests) the same rows arrive as one TMA copy per row into an untiled buffer,
each counting as one arrival on the stage's barrier: the schedule, the indices and the barrier protocol of the
kernel are what those tests check; the cp.async instructions only run on the GPU (tests/gpu).
"""

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe

CHUNK_BYTES = 16  # one cp.async
SWIZZLE_BYTES = 128  # the wgmma operand's swizzle: 8 rows x 128 bytes per swizzle atom


def lag(stages: int) -> int:
    """Steps between issuing a stage's cp.async copies and signalling it (see the module docstring)."""
    return max(stages - 2, 0)


def smem_transforms(block_k: int, dtype, interpret) -> tuple:
    """The x buffer's transforms: the wgmma swizzle, or none under the interpreter (its per-row copies need rows)."""
    return () if interpret is not None else pipe.swizzled(block_k, dtype)


def produced_arrivals(block_m: int, interpret) -> int:
    """Arrivals on a stage's barrier: the weights' TMA, plus the producer warpgroup (GPU) or one per row copy."""
    return 1 + (block_m if interpret is not None else 1)


def load_rows(x_gmem, row_tokens_gmem, row0, k0, dst_smem, barrier, *, interpret) -> None:
    """Starts copying ``x[row_tokens[row0 + r], k0 : k0 + block_k]`` into row r of ``dst_smem`` [block_m, block_k].

    On the GPU the copies join this thread's next cp.async commit group (committed here); ``signal`` later tells
    ``barrier``. Under the interpreter each row copy arrives on ``barrier`` itself.
    """
    block_m, block_k = dst_smem.shape
    if interpret is not None:

        @pl.loop(0, block_m)
        def _row(r):
            token = row_tokens_gmem[row0 + r]
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(token, 1), pl.ds(k0, block_k)], dst_smem.at[pl.ds(r, 1)], barrier)

        return
    _cp_async_rows(
        x_gmem.at[:, pl.ds(k0, block_k)], row_tokens_gmem.at[pl.ds(row0, block_m)], dst_smem, x_gmem.shape[1]
    )


def signal(step, stages: int, produced, *, interpret) -> None:
    """GPU, after issuing step ``step``'s copies: once step - LAG's rows landed, arrive on its barrier."""
    if interpret is not None:
        return
    lagged = lag(stages)
    _wait_own_copies(lagged)

    @pl.when(step >= lagged)
    def _():
        plgpu.barrier_arrive(produced.at[lax.rem(step - lagged, stages)])


def signal_rest(total_steps, stages: int, produced, *, interpret) -> None:
    """GPU, after the last step: arrive for the steps ``signal`` has not yet (the last LAG)."""
    if interpret is not None:
        return
    lagged = lag(stages)
    _wait_own_copies(0)

    @pl.loop(jnp.maximum(total_steps - lagged, 0), total_steps)
    def _(step):
        plgpu.barrier_arrive(produced.at[lax.rem(step, stages)])


def _wait_own_copies(pending: int) -> None:
    """Waits until at most ``pending`` of this thread's cp.async groups are in flight, then makes the finished
    copies visible to the async proxy (wgmma reads shared memory through it)."""

    @plgpu.inline_mgpu()
    def _wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    _wait()


def _cp_async_rows(x_cols_gmem, tokens_gmem, dst_smem, row_stride: int) -> None:
    """cp.async of x_cols_gmem[tokens[r]] (a [T, block_k] column slice of x) into the swizzled tile dst_smem."""
    block_m, block_k = dst_smem.shape
    itemsize = jnp.dtype(dst_smem.dtype).itemsize
    chunk_elems = CHUNK_BYTES // itemsize
    tile_cols = SWIZZLE_BYTES // itemsize  # columns of one swizzle tile
    chunks_per_row = SWIZZLE_BYTES // CHUNK_BYTES  # 8 threads cover one 128-byte row segment
    rows_per_pass = pipe.THREADS // chunks_per_row
    if block_m % rows_per_pass or block_k % tile_cols:
        raise ValueError(f"gathered rows need block_m % {rows_per_pass} == 0 and block_k % {tile_cols} == 0")
    col_tiles = block_k // tile_cols

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(pipe.swizzled(block_k, dst_smem.dtype)))
    )
    def _copy(ctx, x_ref, tokens_ref, smem_ref):
        del ctx
        i32, i64, index = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.IndexType.get()
        element = ir.MemRefType(x_ref.type).element_type
        c = mgpu_utils.c
        thread = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), c(pipe.THREADS, i32))
        chunk = arith.remui(thread, c(chunks_per_row, i32))
        lane_row = arith.divui(thread, c(chunks_per_row, i32))
        row_in_atom = arith.remui(lane_row, c(8, i32))
        # The 128-byte swizzle: chunk j of row r lives at chunk j ^ (r % 8) of that row.
        swizzled_chunk = arith.xori(chunk, row_in_atom)
        smem_thread = arith.addi(
            arith.muli(arith.divui(lane_row, c(8, i32)), c(col_tiles * 8 * tile_cols, i32)),
            arith.addi(arith.muli(row_in_atom, c(tile_cols, i32)), arith.muli(swizzled_chunk, c(chunk_elems, i32))),
        )
        gmem_chunk = arith.extui(i64, arith.muli(chunk, c(chunk_elems, i32)))
        gmem_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(x_ref))
        smem_base = mgpu_utils.memref_ptr(smem_ref)
        for i in range(block_m // rows_per_pass):
            row = arith.addi(lane_row, c(i * rows_per_pass, i32))
            token = memref.load(tokens_ref, [arith.index_cast(index, row)])
            gmem_row = arith.addi(arith.muli(arith.extui(i64, token), c(row_stride, i64)), gmem_chunk)
            for t in range(col_tiles):
                smem_offset = arith.addi(
                    smem_thread, c((i * rows_per_pass // 8) * col_tiles * 8 * tile_cols + t * 8 * tile_cols, i32)
                )
                gmem_offset = arith.addi(gmem_row, c(t * tile_cols, i64))
                nvvm.cp_async_shared_global(
                    mgpu_utils.getelementptr(smem_base, [smem_offset], element),
                    mgpu_utils.getelementptr(gmem_base, [gmem_offset], element),
                    CHUNK_BYTES,
                    nvvm.LoadCacheModifierKind.CG,
                )
        nvvm.cp_async_commit_group()

    _copy(x_cols_gmem, tokens_gmem, dst_smem)
