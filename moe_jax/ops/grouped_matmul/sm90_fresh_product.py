"""``fresh_product(a, b)``: a . b into a fresh wgmma accumulator, whose first wgmma instruction ignores the
accumulator's registers (PTX's scale-d = 0), as a Pallas primitive for the FP8 kernels' steps.

Every step of the FP8 kernels multiplies one 128-wide K block into a fresh accumulator and promotes it (sm90_fp8.py,
sm90_fp8_wgrad.py). Pallas's form of that is an ``ACC`` zeroed in registers, which every wgmma instruction then adds
to: Mosaic GPU always passes scale-d = 1. ptxas drops those zeros where the wgmma is issued unconditionally, but
under a branch (the forward's consumers skip the MMAs of rows they do not store) it zeroes the accumulator's 64-96
registers a thread every step, which cost the deepseek-v3 forward's 7168-deep steps 9 % on an H200 (docs/kernels/
grouped_matmul.md, "FP8"). Here the accumulator's registers are left undefined and the first instruction is told to
ignore them.

The lowering runs Pallas's own wgmma lowering (its operand checks and descriptors) and, for that call and in this
thread only, rewrites the scale-d operand of the first wgmma instruction that Mosaic GPU emits to 0. It raises where
it finds no instruction to rewrite, so a Mosaic GPU that emits wgmma differently fails at lowering, never silently.
Under the interpreter (which runs no lowering) the product is the zeroed ``ACC``'s: the same values.
"""

import contextlib
import importlib
import re
import threading

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax._src.pallas import core as pallas_core
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

# The module whose ``llvm.inline_asm`` emits the wgmma instructions (the package re-exports a function of that name).
_WGMMA_MODULE = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")
# Mosaic GPU's wgmma asm sets its predicate from the scale-d operand: "setp.ne.b32 p, $<operand>, 0".
_SCALE_D = re.compile(r"setp\.ne\.b32 p, \$(\d+), 0;")
_ROWS = 64  # wgmma's M


def fresh_product(a, b, *, interpret) -> jax.Array:
    """a . b [64, N] f32 in the WGMMA layout, waited for: a [64, K] and b [K, N] shared-memory refs (b possibly
    ``.transpose((1, 0))``), as ``plgpu.wgmma`` takes them; 64 rows, one wgmma row group, whose first instruction is
    the one that ignores the accumulator. ``interpret``: the kernel's interpreter params (None on the GPU)."""
    shape = (a.shape[0], b.shape[1])
    if shape[0] != _ROWS:
        raise ValueError(f"fresh_product multiplies {_ROWS} rows (one wgmma row group), got a of shape {a.shape}")
    if interpret is not None:

        def product(acc):
            plgpu.wgmma(acc, a, b)
            return plgpu.wgmma_accumulator_load(acc, wait_n=0)

        return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
    a, a_transforms = _ref_and_transforms(a)
    b, b_transforms = _ref_and_transforms(b)
    a_leaves, a_tree = jax.tree.flatten(a_transforms)
    b_leaves, b_tree = jax.tree.flatten(b_transforms)
    return _fresh_product_p.bind(
        a, b, *a_leaves, *b_leaves, a_transforms_tree=a_tree, b_transforms_tree=b_tree, shape=shape
    )


def _ref_and_transforms(ref):
    if isinstance(ref, pallas_core.TransformedRef):
        return ref.ref, ref.transforms
    return ref, ()


_fresh_product_p = jax_core.Primitive("moe_fresh_wgmma_product")


@_fresh_product_p.def_effectful_abstract_eval
def _fresh_product_abstract_eval(*args, shape, **params):
    del args, params
    effects = {gpu_core._wgmma_pipeline_effect, state_types.ReadEffect(0), state_types.ReadEffect(1)}
    return jax_core.ShapedArray(shape, jnp.float32), effects


@mgpu_lowering.register_lowering_rule(_fresh_product_p, mgpu.LoweringSemantics.Lane)
def _fresh_product_lowering(ctx, a, b, *leaves, a_transforms_tree, b_transforms_tree, shape):
    f32 = ir.F32Type.get()
    # Registers the first instruction ignores: left undefined, so nothing sets them.
    undefined = mgpu.FragmentedArray.splat(llvm.mlir_undef(f32), shape, mgpu.WGMMA_LAYOUT)
    acc = mgpu.WGMMAAccumulator.from_registers(undefined)
    acc_aval = gpu_core.WGMMAAbstractAccumulatorRef(jax_core.ShapedArray(shape, jnp.float32))
    with _first_wgmma_ignores_accumulator():
        acc = gpu_primitives._wgmma_lowering(
            ctx.replace(avals_in=(acc_aval, *ctx.avals_in)),
            acc,
            a,
            b,
            *leaves,
            acc_transforms_tree=None,
            a_transforms_tree=a_transforms_tree,
            b_transforms_tree=b_transforms_tree,
        )
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "wgmma.wait_group.sync.aligned 0;", "", has_side_effects=True)
    return acc.value


class _ScaleDRewriter:
    """Stands in for the wgmma module's ``llvm``: passes every call through, except that the first wgmma
    instruction emitted by ``owner`` gets scale-d = 0."""

    def __init__(self, owner: int):
        self.owner = owner
        self.rewritten = 0

    def __getattr__(self, name):
        return getattr(llvm, name)

    def inline_asm(self, result, operands, asm, constraints, **kwargs):
        if self.rewritten or threading.get_ident() != self.owner or "wgmma.mma_async" not in asm:
            return llvm.inline_asm(result, operands, asm, constraints, **kwargs)
        match = _SCALE_D.search(asm)
        kinds = constraints.split(",")
        outputs = sum(kind.startswith("=") for kind in kinds)
        if match is None or kinds[int(match.group(1))] != "n":
            raise NotImplementedError(f"fresh_product: a wgmma asm without a literal scale-d operand: {asm!r}")
        operands = list(operands)
        i32 = ir.IntegerType.get_signless(32)
        operands[int(match.group(1)) - outputs] = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result
        self.rewritten += 1
        return llvm.inline_asm(result, operands, asm, constraints, **kwargs)


@contextlib.contextmanager
def _first_wgmma_ignores_accumulator():
    rewriter = _ScaleDRewriter(threading.get_ident())
    real = _WGMMA_MODULE.llvm
    _WGMMA_MODULE.llvm = rewriter
    try:
        yield
    finally:
        _WGMMA_MODULE.llvm = real
    if not rewriter.rewritten:
        raise NotImplementedError("fresh_product: Mosaic GPU's wgmma lowering emitted no wgmma instruction to rewrite")
