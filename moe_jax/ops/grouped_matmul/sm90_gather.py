"""Gathered lhs rows for the sm90 row kernel: the tile's x rows are ``x[row_tokens[r]]`` (no permuted copy of x).

Hopper's TMA has no row gather (Blackwell's has), so on the GPU the producer warpgroup's 128 threads copy the rows
with cp.async, 16 bytes per thread and instruction, writing the 128-byte swizzle of the wgmma operand themselves:

    thread t: column chunk t % 8 (16 bytes) of rows t // 8 + 16 i, i < block_m / 16, for each 64-column tile

so that one warp instruction moves four whole 128-byte row segments (coalesced). A cp.async completes on its own
schedule, so each thread then issues ``cp.async.mbarrier.arrive`` on the stage's barrier (a pending arrival that the
hardware settles once the thread's copies landed) and arrives on it as usual: the stage completes when the weights'
TMA bytes, the 128 arrivals and every thread's copies are in, and the producer never waits for its own copies. The
copies write shared memory through the generic proxy and wgmma reads it through the async proxy, so a consumer
fences the two (``fence.proxy.async``) after its wait, before its wgmma.

Under the Mosaic GPU interpreter (CPU tests) the same rows arrive as one TMA copy per row into an untiled buffer,
each counting as one arrival on the stage's barrier: the schedule, the indices and the barrier protocol of the
kernel are what those tests check; the cp.async instructions only run on the GPU (tests/gpu).
"""

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, nvvm
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.state import primitives as state_primitives
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe

CHUNK_BYTES = 16  # one cp.async
SWIZZLE_BYTES = 128  # the wgmma operand's swizzle: 8 rows x 128 bytes per swizzle atom


def smem_transforms(block_k: int, dtype, interpret) -> tuple:
    """The x buffer's transforms: the wgmma swizzle, or none under the interpreter (its per-row copies need rows)."""
    return () if interpret is not None else pipe.swizzled(block_k, dtype)


def produced_arrivals(block_m: int, interpret) -> int:
    """Arrivals on a stage's barrier: the weights' TMA, plus the producer warpgroup (GPU) or one per row copy."""
    return 1 + (block_m if interpret is not None else 1)


def load_rows(x_gmem, row_tokens_gmem, row0, k0, dst_smem, barrier, *, interpret) -> None:
    """Copies ``x[row_tokens[row0 + r], k0 : k0 + block_k]`` into row r of ``dst_smem`` [block_m, block_k] and makes
    ``barrier`` (the stage's, which the weights' TMA also arrives on) wait for the copies."""
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
    _arrive_when_copied(barrier)
    plgpu.barrier_arrive(barrier)


def acquire_rows(*, interpret) -> None:
    """Consumer, after waiting for a stage: orders the producer's cp.async writes before this thread's wgmma reads."""
    if interpret is None:
        pipe.fence_async_shared()


# cp.async.mbarrier.arrive as a Pallas primitive: inline_mgpu cannot take a barrier, so this mirrors
# plgpu.barrier_arrive (its ref and transforms) with the one instruction of Mosaic GPU's own cp.async path.
_arrive_when_copied_p = jax_core.Primitive("cp_async_mbarrier_arrive")
_arrive_when_copied_p.multiple_results = True


def _arrive_when_copied(barrier) -> None:
    """Adds a pending arrival on ``barrier`` that completes when this thread's cp.async copies so far have landed."""
    barrier, transforms = state_primitives.get_ref_and_transforms(barrier, None, "cp_async_mbarrier_arrive")
    flat_transforms, transforms_treedef = jax.tree.flatten(transforms)
    _arrive_when_copied_p.bind(barrier, *flat_transforms, transforms_treedef=transforms_treedef)


@_arrive_when_copied_p.def_effectful_abstract_eval
def _arrive_when_copied_abstract_eval(barrier, *args, **params):
    del barrier, args, params
    return (), {gpu_core._memory_effect}


@mgpu_lowering.register_lowering_rule(_arrive_when_copied_p, mgpu.LoweringSemantics.Lane)
@mgpu_lowering.register_lowering_rule(_arrive_when_copied_p, mgpu.LoweringSemantics.Warpgroup)
def _arrive_when_copied_lowering(ctx, barrier, *flat_transforms, transforms_treedef):
    transforms = transforms_treedef.unflatten(flat_transforms)
    index = gpu_primitives._get_barrier_base_index(ctx.avals_in[0], transforms)
    if index is not None:
        barrier = barrier[index]
    nvvm.cp_async_mbarrier_arrive(barrier.get_ptr())
    return ()


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
        # Addresses step over integers of the element's width: LLVM has no FP8 type to index by.
        element = ir.IntegerType.get_signless(8 * itemsize)
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

    _copy(x_cols_gmem, tokens_gmem, dst_smem)
