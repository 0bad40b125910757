"""``fresh_product(a, b)``: a . b into a fresh wgmma accumulator, whose first wgmma instruction ignores the
accumulator's registers (PTX's scale-d = 0), as a Pallas primitive for the FP8 kernels' steps.

Every step of the FP8 kernels multiplies one 128-wide K block into a fresh accumulator and promotes it (sm90_fp8.py,
sm90_fp8_wgrad.py). Pallas's form of that is an ``ACC`` set to zero in registers, which every wgmma instruction then
adds to: Mosaic GPU always passes scale-d = 1. Here the accumulator's registers are left undefined and the first
instruction is told to ignore them: the same values, and a faster FP8 forward kernel on an H200 at the long
contractions (deepseek-v3, gpt-oss-120b; measured in docs/kernels/grouped_matmul.md, "FP8").

The lowering runs Pallas's own wgmma lowering (its operand checks and descriptors) while the wgmma module's ``llvm``
is a stand-in that, in the lowering thread only, rewrites the scale-d operand of the first wgmma instruction that
Mosaic GPU emits to 0. It raises where it finds no instruction to rewrite, so a Mosaic GPU that emits wgmma
differently fails at lowering, never silently. Under the interpreter (which runs no lowering) the product is the
zeroed ``ACC``'s.
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
    return ref, None


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
    with _REWRITER.rewriting():
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
    gpu_primitives._wgmma_wait_lowering(ctx, n=0)
    return acc.value


def _scale_d_index(asm: str, constraints: str) -> int:
    """The position among a Mosaic GPU wgmma asm's operands (its inputs) of its scale-d immediate."""
    match = _SCALE_D.search(asm)
    kinds = constraints.split(",")
    if match is None or kinds[int(match.group(1))] != "n":
        raise NotImplementedError(f"fresh_product: a wgmma asm without a literal scale-d operand: {asm!r}")
    outputs = sum(kind.startswith("=") for kind in kinds)
    return int(match.group(1)) - outputs


class _FirstWgmmaRewriter:
    """Stands in for the wgmma module's ``llvm`` while any thread lowers a fresh product: passes every call through,
    except that in a thread inside ``rewriting()`` the first wgmma instruction gets scale-d = 0. Installed by the
    first such thread and removed by the last (a lock counts them), so other threads' wgmma pass through unchanged."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._real = None
        self._thread = threading.local()

    def __getattr__(self, name):
        return getattr(llvm, name)

    @contextlib.contextmanager
    def rewriting(self):
        with self._lock:
            if self._users == 0:
                self._real = _WGMMA_MODULE.llvm
                _WGMMA_MODULE.llvm = self
            self._users += 1
        self._thread.pending = True
        try:
            yield
        finally:
            rewritten = not self._thread.pending
            self._thread.pending = False
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    _WGMMA_MODULE.llvm = self._real
        if not rewritten:
            raise NotImplementedError("fresh_product: Mosaic GPU's wgmma lowering emitted no wgmma to rewrite")

    def inline_asm(self, result, operands, asm, constraints, **kwargs):
        if getattr(self._thread, "pending", False) and "wgmma.mma_async" in asm:
            operands = list(operands)
            i32 = ir.IntegerType.get_signless(32)
            operands[_scale_d_index(asm, constraints)] = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result
            self._thread.pending = False
        return llvm.inline_asm(result, operands, asm, constraints, **kwargs)


_REWRITER = _FirstWgmmaRewriter()
