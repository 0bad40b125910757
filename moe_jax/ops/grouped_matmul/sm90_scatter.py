"""Scatter-add of one consumer's epilogue chunk into token rows: the combine fused into the down projection.

Each stored row r of the chunk is added to ``out[token[r]]`` with ``red.global.add.noftz.v4.bf16x2`` (16 bytes per
thread and instruction; a token's k rows meet in L2 in whatever order their tiles finish). Thread t of the
warpgroup handles 16-byte column chunk t % 8 of rows t // 8 + 16 i, reading the chunk from the 128-byte-swizzled
shared-memory buffer the TMA stores use.
"""

import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe

CHUNK_BYTES = 16
SWIZZLE_BYTES = 128


def add_rows(tokens_smem, chunk_smem, out_gmem) -> None:
    """out_gmem[tokens[r]] += chunk[r] for each row r of ``chunk_smem`` [R, 64] (bf16) whose token is >= 0.

    tokens_smem: [R] int32 in shared memory; out_gmem: a [T, 64] column slice of the output.
    """
    rows, cols = chunk_smem.shape
    itemsize = jnp.dtype(chunk_smem.dtype).itemsize
    if cols * itemsize != SWIZZLE_BYTES or chunk_smem.dtype != jnp.bfloat16:
        raise ValueError(f"the scatter-add takes bf16 chunks of {SWIZZLE_BYTES // itemsize} columns, got {chunk_smem}")
    _add(tokens_smem, chunk_smem, out_gmem)


def _add_impl(ctx, tokens_ref, chunk_ref, out_ref):
    del ctx
    i32, i64, index = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.IndexType.get()
    c = mgpu_utils.c
    rows = ir.MemRefType(tokens_ref.type).shape[0]
    out_type = ir.MemRefType(out_ref.type)
    strides, _ = out_type.get_strides_and_offset()
    row_stride = strides[0]
    element = out_type.element_type
    chunk_elems = CHUNK_BYTES // 2
    chunks_per_row = SWIZZLE_BYTES // CHUNK_BYTES
    thread = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), c(pipe.THREADS, i32))
    chunk = arith.remui(thread, c(chunks_per_row, i32))
    lane_row = arith.divui(thread, c(chunks_per_row, i32))
    gmem_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(out_ref))
    smem_base = mgpu_utils.memref_ptr(chunk_ref)
    v4 = ir.VectorType.get((4,), i32)
    rows_per_pass = pipe.THREADS // chunks_per_row
    for i in range(rows // rows_per_pass):
        row = arith.addi(lane_row, c(i * rows_per_pass, i32))
        token = memref.load(tokens_ref, [arith.index_cast(index, row)])
        # The 128-byte swizzle: chunk j of row r lives at chunk j ^ (r % 8) of that row.
        swizzled = arith.xori(chunk, arith.remui(row, c(8, i32)))
        smem_offset = arith.addi(arith.muli(row, c(SWIZZLE_BYTES // 2, i32)), arith.muli(swizzled, c(chunk_elems, i32)))
        values = llvm.load(v4, mgpu_utils.getelementptr(smem_base, [smem_offset], element), alignment=16)
        regs = [llvm.extractelement(values, c(j, i32)) for j in range(4)]
        gmem_offset = arith.addi(
            arith.muli(arith.extsi(i64, token), c(row_stride, i64)),
            arith.extui(i64, arith.muli(chunk, c(chunk_elems, i32))),
        )
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [mgpu_utils.getelementptr(gmem_base, [gmem_offset], element), *regs, token],
            "{ .reg .pred p; setp.ge.s32 p, $5, 0; "
            "@p red.global.relaxed.gpu.add.noftz.v4.bf16x2 [$0], {$1, $2, $3, $4}; }",
            "l,r,r,r,r,r",
            has_side_effects=True,
        )


_add = plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(), plgpu.RefType(pipe.swizzled(64, jnp.bfloat16, 1)), plgpu.RefType())
)(_add_impl)
