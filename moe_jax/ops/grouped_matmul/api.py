"""``moe_jax.grouped_matmul``: a drop-in for ``jax.lax.ragged_dot`` with a gated-activation epilogue.

backend="pallas" runs the sm90 Mosaic GPU kernels (forward, dgrad, wgrad) behind a ``custom_vjp``. The GLU and the
row scale run in the forward kernel's epilogue on the f32 accumulator (the GLU on packed gate/up weights, packing.py);
this op's backward differentiates that epilogue in XLA from the pre-activation the forward kept, then runs the dgrad
and wgrad kernels. The fused GLU backward lives in ``moe_jax.ops.glu_mlp``, where the down projection's dgrad gives it
an epilogue to run in. The kernel runners below (``run_rows_kernel``, ``run_wgrad_kernel``, ``gemm_grads``) serve both.

With ``quantization="fp8_block"`` the "pallas" entry runs the FP8 kernel (block-scaled e4m3 operands, the same
epilogues) for the forward and, where K is a multiple of 64, the dgrad; the wgrad runs the FP8 wgrad kernel on
copies of x and dy quantized in row blocks per group (token_blocks.py). With "mxfp8" it runs the recipe's
dequantized products, which bf16 holds exactly (but for blocks of magnitudes below about 2^-109), on the bf16
kernels (``launch.BF16_KERNEL_GEMMS``). "auto" takes them where they run, as for bf16.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax._core import backend as dispatch
from moe_jax._core import checks
from moe_jax.ops.grouped_matmul import reference, reference_fp8, token_blocks
from moe_jax.ops.grouped_matmul.glu import ACTIVATIONS, glu
from moe_jax.ops.grouped_matmul.launch import (
    BF16_KERNEL_GEMMS,
    FP8_KERNEL_QUANTIZATION,
    GROUPED_MATMUL_NAMES,
    ArgNames,
    bf16_gemms_unsupported,
    fp8_dgrad_runs,
    fp8_kernel_unsupported,
    fp8_wgrad_unsupported,
    gemm_grads,
    kernel_unsupported,
    quantize_kernel_rows,
    run_forward_kernel,
    run_fp8_forward_kernel,
    run_fp8_wgrad_kernel,
    run_rows_kernel,
)
from moe_jax.ops.grouped_matmul.packing import (
    PACK_BLOCK,
    PackedGateUp,
    gate_up_block,
    pack_gate_up,
    split_gate_up,
    stored_array,
)
from moe_jax.ops.grouped_matmul.reference_fp8 import QUANTIZATIONS, RECIPES
from moe_jax.ops.quant import api as quant
from moe_jax.ops.quant.qwix_interop import from_qarray, is_qarray
from moe_jax.ops.quant.reference import FP8_DTYPES, BlockScaled, QuantizedMaster

OUTPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_grouped_matmul_args(
    lhs,
    rhs,
    group_sizes,
    *,
    activation,
    row_scale,
    preferred_element_type,
    transpose_rhs,
    quantization=None,
    names: ArgNames = GROUPED_MATMUL_NAMES,
) -> tuple[int, int, int, int]:
    """Validates the arguments of ``grouped_matmul`` (or of an op built on it, whose argument ``names`` the messages
    use); returns (M, K, N, G). What the kernels take is ``IMPLEMENTATIONS``' business, not this check's."""
    lhs_name, rhs_name, k, n = names.lhs, names.rhs, names.k, names.n
    checks.check_choice("quantization", quantization, (None, *QUANTIZATIONS))
    num_rows, contraction = checks.check_rank(lhs_name, lhs, 2, f"[M, {k}]")
    if isinstance(rhs, PackedGateUp):
        if activation is None:
            raise ValueError(f"{rhs_name} is a PackedGateUp ([gate | up] weights, packed): pass its activation=")
        if rhs.transposed != transpose_rhs:
            raise ValueError(f"{rhs_name} is a PackedGateUp with transposed={rhs.transposed}: transpose_rhs must match")
    rhs_layout = f"[G, {n}, {k}]" if transpose_rhs else f"[G, {k}, {n}]"
    num_groups, *rhs_dims = checks.check_rank(rhs_name, rhs, 3, rhs_layout)
    rhs_contraction, num_cols = reversed(rhs_dims) if transpose_rhs else rhs_dims
    if rhs_contraction != contraction:
        raise ValueError(
            f"{rhs_name} must have shape {rhs_layout} with {k}={contraction} (from {lhs_name} [M, {k}]), got shape "
            f"{rhs.shape}"
        )
    checks.check_rank("group_sizes", group_sizes, 1, "[G]")
    checks.check_int32("group_sizes", group_sizes)
    checks.check_dim("group_sizes", group_sizes.shape[0], num_groups, f"length (G, {rhs_name}.shape[0])")
    weights = stored_array(rhs)
    _check_operand_types(lhs, weights, quantization, transpose_rhs, names)
    if activation is not None:
        checks.check_choice("activation", activation, (None, *ACTIVATIONS))
        if num_cols % 2:
            raise ValueError(
                f"{rhs_name}: with activation={activation!r} {n} holds [gate | up] and must be even, got {num_cols}"
            )
    if activation is not None and isinstance(rhs, QuantizedMaster):
        raise ValueError(
            f"{rhs_name} is a QuantizedMaster of unpacked [gate | up] weights: the GLU kernels read them packed, "
            "make it from pack_gate_up(...)"
        )
    if isinstance(rhs, PackedGateUp) and rhs.block != gate_up_block(num_cols // 2):
        raise ValueError(
            f"{rhs_name}.block must be gate_up_block(F) = {gate_up_block(num_cols // 2)} for F = {num_cols // 2} "
            f"(what pack_gate_up produces), got {rhs.block}"
        )
    if row_scale is not None:
        checks.check_rank("row_scale", row_scale, 1, "[M]")
        checks.check_dim("row_scale", row_scale.shape[0], num_rows, f"length (M, {lhs_name}.shape[0])")
        checks.check_float("row_scale", row_scale)
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) not in map(jnp.dtype, OUTPUT_DTYPES):
        raise TypeError(
            f"preferred_element_type must be one of float32, bfloat16, float16 or None, got {preferred_element_type}"
        )
    return num_rows, contraction, num_cols, num_groups


def _check_operand_types(lhs, weights, quantization, transpose_rhs: bool, names: ArgNames) -> None:
    """Float operands of one dtype; with ``quantization`` each may instead be a BlockScaled of the recipe's blocks."""
    operands = ((names.lhs, lhs), (names.rhs, weights))
    if isinstance(weights, QuantizedMaster):
        check_quantized_master(names.rhs, weights, quantization, transpose_rhs)
    if quantization is None:
        for name, operand in operands:
            if isinstance(operand, BlockScaled):
                raise TypeError(f"{name} is a BlockScaled (FP8): pass quantization= ({QUANTIZATIONS}) to match it")
    else:
        recipe = RECIPES[quantization]
        blocks = (recipe.lhs_block, recipe.rhs_block(transpose_rhs))
        for (name, operand), block_shape in zip(operands, blocks, strict=True):
            if isinstance(operand, BlockScaled):
                _check_block_scaled(name, operand, block_shape, recipe, quantization)
        operands = tuple((name, operand) for name, operand in operands if not isinstance(operand, BlockScaled))
    for name, operand in operands:
        checks.check_float(name, operand)
    if len(operands) == 2 and lhs.dtype != weights.dtype:
        raise TypeError(f"{names.lhs} and {names.rhs} must have the same dtype, got {lhs.dtype} and {weights.dtype}")


def check_quantized_master(name: str, weights: QuantizedMaster, quantization, transpose_rhs: bool) -> None:
    """A QuantizedMaster holds fp8_block's kernel copies of weights stored as the call says (``quantization``,
    ``transpose_rhs``)."""
    if quantization != FP8_KERNEL_QUANTIZATION:
        raise ValueError(
            f"{name} is a QuantizedMaster (FP8 copies of the {FP8_KERNEL_QUANTIZATION!r} recipe): pass "
            f"quantization={FP8_KERNEL_QUANTIZATION!r}, got {quantization!r}"
        )
    if weights.transpose_rhs != transpose_rhs:
        raise ValueError(
            f"{name} is a QuantizedMaster made with transpose_rhs={weights.transpose_rhs}: the call's transpose_rhs "
            "must match"
        )


def master_weights(weights):
    """Weights with any QuantizedMaster (also inside a PackedGateUp) replaced by its master: what an implementation
    that quantizes the weights itself takes (the same copies, as quantization is deterministic)."""
    array = stored_array(weights)
    if not isinstance(array, QuantizedMaster):
        return weights
    return dataclasses.replace(weights, array=array.master) if isinstance(weights, PackedGateUp) else array.master


def weight_gradient(weights, d_master: jax.Array):
    """The cotangent of ``weights`` (high precision or a QuantizedMaster) from the gradient of its values: a
    QuantizedMaster's goes to its master, straight through its copies."""
    if isinstance(weights, QuantizedMaster):
        return QuantizedMaster(d_master, None, None, weights.transpose_rhs)
    return d_master


def _check_block_scaled(name: str, operand: BlockScaled, block_shape, recipe, quantization: str) -> None:
    if operand.block_shape != block_shape:
        raise ValueError(
            f"{name} is a BlockScaled of block_shape {operand.block_shape}; quantization={quantization!r} takes "
            f"{block_shape} for it"
        )
    if jnp.dtype(operand.dtype) not in map(jnp.dtype, FP8_DTYPES):
        raise TypeError(f"{name}.values must be float8_e4m3fn or float8_e5m2, got {jnp.dtype(operand.dtype).name}")
    if jnp.dtype(operand.scales.dtype) != recipe.scale_dtype:
        raise TypeError(
            f"{name}.scales must be {recipe.scale_dtype.name} for quantization={quantization!r}, got "
            f"{jnp.dtype(operand.scales.dtype).name}"
        )
    blocks = tuple(math.ceil(size / block) for size, block in zip(operand.shape, block_shape, strict=True))
    if tuple(operand.scales.shape) != blocks:
        raise ValueError(f"{name}.scales must have shape {blocks} (one per block), got {tuple(operand.scales.shape)}")


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | PackedGateUp,
    group_sizes: jax.Array,
    *,
    activation: str | None = None,
    row_scale: jax.Array | None = None,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    quantization: str | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Ragged grouped matmul: rows ``[offset_g, offset_g + group_sizes[g])`` of ``lhs`` multiply ``rhs[g]``.

    Args:
      lhs: [M, K] rows sorted by group (with ``quantization``, also a ``BlockScaled``, or a qwix ``QArray`` of the
        same blocks: ``quant.qwix_interop.from_qarray``).
      rhs: [G, K, N] weights, or [G, N, K] (K-major) with ``transpose_rhs=True``; same dtype as lhs. With an
        activation it may also be a ``PackedGateUp`` (``pack_gate_up(rhs)``): the same [gate | up] weights with their
        columns interleaved so that one kernel tile holds matching gate and up columns. The type says the layout,
        so there is no ambiguity; a plain array is always read as [gate | up] and, on the Pallas path, packed on
        every call (one weight copy): store weights packed.
      group_sizes: [G] int32 rows per group; rows at or past ``sum(group_sizes)`` give zeros. Negative sizes count
        as 0 and rows past M are dropped (both backends).
      activation: None, or "swiglu" / "geglu" / "gpt_oss": N holds ``[gate | up]`` (F = N/2 each) and the result is
        [M, F] (g: gate, u: up): swiglu ``silu(g) * u``; geglu ``gelu(g) * u`` (tanh form, ``jax.nn.gelu``'s default);
        gpt_oss ``(u' + 1) * g' * sigmoid(1.702 * g')`` with ``g' = min(g, 7)`` and ``u' = clip(u, -7, 7)``.
      row_scale: optional [M] float multiplying each output row (routing weights folded into the down projection).
      preferred_element_type: output dtype (default: lhs.dtype; with ``quantization`` the high-precision inputs'
        dtype, bf16 when both are BlockScaled); accumulation is always f32.
      transpose_rhs: rhs is laid out [G, N, K].
      quantization: None, "fp8_block" or "mxfp8": multiply block-scaled float8_e4m3fn operands, accumulating the
        product of their dequantized values in f32. "fp8_block": lhs in 1 x 128 blocks along K, rhs in 128 x 128
        blocks over (K, N); "mxfp8": 1 x 32 blocks along K for both, power-of-two (e8m0) scales. The op quantizes
        high-precision operands (with an activation the weights in the packed gate/up layout, so a plain [gate | up]
        array and its PackedGateUp agree) and takes ``BlockScaled`` ones (``quantize_blockwise``,
        ``quantize_weights``) as they are, with the recipe's block_shape. Gradients reach high-precision operands
        straight through the quantization, their own GEMMs quantized too; BlockScaled operands get none
        (reference_fp8.py has the whole recipe). With "fp8_block" rhs may also be a ``QuantizedMaster``
        (``quantize_master``: the weights with the kernels' copies made once, for many calls): the kernels read the
        copies, and its master gets the gradient that high-precision weights would.
      backend: "auto", "xla" or "pallas". "pallas" (the default on an H100/H200 under "auto") needs bf16/f16 inputs,
        K, N multiples of 64 and, with an activation, F a multiple of 64; "auto" falls back to "xla" where those do
        not hold. With an activation or a row scale the kernel applies them in its epilogue (f32) and writes only
        the result; under differentiation it also keeps the pre-activation [M, N] for the backward. Quantized
        calls run the FP8 kernel under "auto" and "pallas" (fp8_block; N a multiple of 64, e4m3 operands, GLU
        weights packed) for the forward and, with K a multiple of 64, the dgrad, and the FP8 wgrad kernel for the wgrad
        (XLA for an rhs of another float dtype than f32 / bf16 / f16). The forward reads the
        weights [G, N, K] and the dgrad [G, K, N]: high-precision weights are quantized into both layouts in one
        pass (``quantize_square_blocks``), BlockScaled ones transposed where their layout is not the GEMM's.
        "mxfp8" calls run their three GEMMs on the bf16 kernels (K, N multiples of 64), on the dequantized operands,
        which bf16 holds exactly but for blocks of magnitudes below about 2^-109
        (``reference_fp8.Recipe.exact_in_bf16``), with the epilogue in XLA.

    Returns:
      [M, N], or [M, N/2] with an activation.
    """
    lhs, rhs = (from_qarray(x, name=name) if is_qarray(x) else x for x, name in ((lhs, "lhs"), (rhs, "rhs")))
    _, contraction, num_cols, _ = check_grouped_matmul_args(
        lhs,
        rhs,
        group_sizes,
        activation=activation,
        row_scale=row_scale,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
        quantization=quantization,
    )
    call = _gemm_call(lhs, rhs, contraction, num_cols, activation, quantization, preferred_element_type)
    group_sizes = group_sizes.astype(jnp.int32)
    implementation = dispatch.select("grouped_matmul", backend, IMPLEMENTATIONS, call)
    recipe_gemms = quantized_gemms(implementation.name, quantization) if quantization is not None else None
    if recipe_gemms is not None:
        return reference_fp8.grouped_matmul(
            lhs,
            master_weights(rhs),
            group_sizes,
            quantization=quantization,
            activation=activation,
            row_scale=row_scale,
            preferred_element_type=preferred_element_type,
            transpose_rhs=transpose_rhs,
            gemms=recipe_gemms,
        )
    if quantization is not None:
        out_dtype = reference_fp8.output_dtype(lhs, rhs, preferred_element_type)
        weights, _ = reference_fp8.stored_weights(rhs, activation, transpose_rhs)
        scale = None if row_scale is None else row_scale.astype(jnp.float32)
        args = (activation, out_dtype, transpose_rhs, quantization)
        return _pallas_fp8_matmul(lhs, weights, jnp.maximum(group_sizes, 0), scale, *args)
    if implementation.name == "xla":
        return reference.grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            activation=activation,
            row_scale=row_scale,
            preferred_element_type=preferred_element_type,
            transpose_rhs=transpose_rhs,
        )
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if activation is None and row_scale is None:
        return _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs)
    if activation is not None and not isinstance(rhs, PackedGateUp):
        rhs = pack_gate_up(rhs, transposed=transpose_rhs)
    weights = stored_array(rhs)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)
    return _pallas_epilogue_matmul(lhs, weights, group_sizes, scale, activation, out_dtype, transpose_rhs)


@dataclasses.dataclass(frozen=True)
class _GemmCall:
    """What the grouped-matmul implementations decide on."""

    dtype: jnp.dtype
    contraction: int
    num_cols: int
    activation: str | None
    quantization: str | None = None
    # Quantized calls: the value dtypes of the BlockScaled operands, whether an activation comes with BlockScaled
    # [gate | up] weights, the output dtype.
    fp8_dtypes: tuple = ()
    unpacked_glu_weights: bool = False
    out_dtype: jnp.dtype | None = None


def _gemm_call(lhs, rhs, contraction: int, num_cols: int, activation, quantization, preferred_element_type=None):
    if quantization is None:
        return _GemmCall(lhs.dtype, contraction, num_cols, activation)
    weights = stored_array(rhs)
    fp8_dtypes = tuple(jnp.dtype(x.dtype) for x in (lhs, weights) if isinstance(x, BlockScaled))
    unpacked = activation is not None and isinstance(rhs, BlockScaled)
    out_dtype = reference_fp8.output_dtype(lhs, rhs, preferred_element_type)
    return _GemmCall(lhs.dtype, contraction, num_cols, activation, quantization, fp8_dtypes, unpacked, out_dtype)


def _kernel_unsupported(call: _GemmCall) -> str | None:
    if call.quantization is not None and RECIPES[call.quantization].exact_in_bf16:
        return bf16_gemms_unsupported(call.contraction, call.num_cols)
    if call.quantization is not None:
        args = (call.contraction, call.num_cols, call.activation, call.fp8_dtypes, call.unpacked_glu_weights)
        return fp8_kernel_unsupported(call.quantization, *args, out_dtype=call.out_dtype)
    shaped = jax.ShapeDtypeStruct((0, call.contraction), call.dtype)
    return kernel_unsupported(shaped, call.contraction, call.num_cols, call.activation)


def quantized_gemms(implementation: str, quantization: str) -> reference_fp8.Gemms | None:
    """The GEMMs that multiply a quantized call's dequantized operands under ``implementation``, which then runs the
    recipe as reference_fp8.py writes it: XLA's ``ragged_dot`` ("xla"), the bf16 kernels for a recipe whose
    dequantized values bf16 holds (``Recipe.exact_in_bf16``); None where the FP8 kernels run the call instead."""
    if implementation == "xla":
        return reference_fp8.XLA_GEMMS
    return BF16_KERNEL_GEMMS if RECIPES[quantization].exact_in_bf16 else None


def quantized_kernels_unsupported(dtype, gemms, quantization: str) -> str | None:
    """Why the quantized kernels (the FP8 kernels for fp8_block, the bf16 ones for mxfp8) cannot run one of ``gemms``
    on a high-precision lhs of ``dtype`` (None: they run all).

    Args:
      gemms: (contraction, output columns, activation or None, rhs) per GEMM, rhs as the op takes it (high precision,
        ``BlockScaled`` or a ``PackedGateUp``; arrays or ``jax.ShapeDtypeStruct`` leaves).
    """
    for contraction, num_cols, activation, rhs in gemms:
        lhs = jax.ShapeDtypeStruct((0, contraction), dtype)
        problem = _kernel_unsupported(_gemm_call(lhs, rhs, contraction, num_cols, activation, quantization, dtype))
        if problem is not None:
            return problem
    return None


IMPLEMENTATIONS = (dispatch.Implementation("pallas", _kernel_unsupported), dispatch.XLA)


def quantize_weights(
    rhs: jax.Array | PackedGateUp, quantization: str = "fp8_block", *, transpose_rhs: bool = False
) -> BlockScaled | PackedGateUp:
    """Weights quantized once, as ``grouped_matmul(..., quantization=quantization)`` quantizes them on every call.

    Args:
      rhs: [G, K, N], or [G, N, K] with ``transpose_rhs``, high precision; or a PackedGateUp of such an array (the
        form that keeps an activation's weights in the layout the GLU kernel reads).
      quantization: "fp8_block" (128 x 128 blocks over (K, N)) or "mxfp8" (1 x 32 along K, e8m0 scales).
      transpose_rhs: rhs is laid out [G, N, K] (the FP8 kernel's layout: no transposed copy per call).

    Returns:
      A BlockScaled of rhs's shape, or a PackedGateUp holding one.
    """
    checks.check_choice("quantization", quantization, QUANTIZATIONS)
    recipe = RECIPES[quantization]
    weights = stored_array(rhs)
    checks.check_rank("rhs", weights, 3, "[G, N, K]" if transpose_rhs else "[G, K, N]")
    checks.check_float("rhs", weights)
    quantized = reference_fp8.quantize(weights, recipe.rhs_block(transpose_rhs), recipe)
    return dataclasses.replace(rhs, array=quantized) if isinstance(rhs, PackedGateUp) else quantized


def quantize_master(rhs: jax.Array | PackedGateUp, *, transpose_rhs: bool = False) -> QuantizedMaster | PackedGateUp:
    """High-precision weights with the FP8 kernels' copies made once, for the calls of a training step to share.

    ``grouped_matmul``, ``glu_mlp``, ``moe_ffn`` and ``moe_jax.nn.MoE`` with ``quantization="fp8_block"`` quantize
    high-precision weights on every call, into the forward's and the dgrad's layouts (one pass over them). A step
    that runs a layer on several micro-batches can do that once instead: pass the result where the weights go. The
    kernels read its copies, the gradient reaches the master straight through (the same values as for the master
    itself, which the XLA path and expert parallelism quantize per call). The copies are constants: made
    inside a differentiated function, they carry no gradient of their own.

    Args:
      rhs: [G, K, N], or [G, N, K] with ``transpose_rhs``, high precision; or a PackedGateUp of such an array.
      transpose_rhs: rhs is laid out [G, N, K].

    Returns:
      A QuantizedMaster of rhs (of its array, inside the same PackedGateUp).
    """
    weights = stored_array(rhs)
    checks.check_rank("rhs", weights, 3, "[G, N, K]" if transpose_rhs else "[G, K, N]")
    checks.check_float("rhs", weights)
    recipe = RECIPES[FP8_KERNEL_QUANTIZATION]
    # The copies are constants (the quantizer kernel has no derivative): the gradient reaches the master through the
    # ops that take it, so this can also run inside a differentiated function.
    forward, dgrad = kernel_weights(lax.stop_gradient(weights), recipe, transpose_rhs, with_dgrad=True)
    master = QuantizedMaster(weights, forward, dgrad, transpose_rhs)
    return dataclasses.replace(rhs, array=master) if isinstance(rhs, PackedGateUp) else master


# ------------------------------------------------------------------------------------------- Pallas path + custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs):
    """lhs [M, K] · rhs[g] ([G, K, N], or [G, N, K] with ``transpose_rhs``) -> [M, N] in ``out_dtype``."""
    return run_rows_kernel("fwd", lhs, rhs, group_sizes, w_transposed=transpose_rhs, out_dtype=out_dtype)


def _pallas_fwd(lhs, rhs, group_sizes, out_dtype, transpose_rhs):
    return _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs), (lhs, rhs, group_sizes)


def _pallas_bwd(out_dtype, transpose_rhs, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    return *gemm_grads(lhs, rhs, group_sizes, d_out, transpose_rhs=transpose_rhs), None


_pallas_grouped_matmul.defvjp(_pallas_fwd, _pallas_bwd)


# ------------------------------------------------------------------- Pallas path with the GLU / row scale fused


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _pallas_epilogue_matmul(lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs):
    """lhs [M, K] · rhs[g] with the epilogue fused: [M, N/2] with an activation (rhs packed), else [M, N]."""
    return run_forward_kernel(lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs, keep=False)


def _epilogue_fwd(lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs):
    args = (lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs)
    out, pre = run_forward_kernel(*args, keep=True)
    return out, (lhs, rhs, group_sizes, row_scale, pre)


def _epilogue_bwd(activation, out_dtype, transpose_rhs, residuals, d_out):
    """The epilogue's VJP in XLA on the kept pre-activation [M, N], then the dgrad and wgrad kernels."""
    lhs, rhs, group_sizes, row_scale, pre = residuals
    d_pre, d_row_scale = _epilogue_vjp(pre, row_scale, activation, d_out)
    d_lhs, d_rhs = gemm_grads(lhs, rhs, group_sizes, d_pre, transpose_rhs=transpose_rhs)
    return d_lhs, d_rhs, None, d_row_scale


def _epilogue_vjp(pre, row_scale, activation, d_out):
    """(d pre [M, N] f32, d row_scale) of the forward epilogue (GLU over packed columns, row scale) at ``pre``."""

    def epilogue(acc, scale):
        if activation is not None:
            acc = glu(*split_gate_up(acc, PACK_BLOCK), activation)
        return acc if scale is None else acc * scale[:, None]

    _, pullback = jax.vjp(epilogue, pre.astype(jnp.float32), row_scale)
    return pullback(d_out.astype(jnp.float32))


_pallas_epilogue_matmul.defvjp(_epilogue_fwd, _epilogue_bwd)


# ------------------------------------------------------------------------------------- FP8 Pallas path + custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _pallas_fp8_matmul(lhs, weights, group_sizes, row_scale, activation, out_dtype, transpose_rhs, quantization):
    """The FP8 kernel's forward with its epilogue: lhs [M, K] and the stored weights (packed with an activation;
    [G, K, N] or [G, N, K]) high precision or BlockScaled, group_sizes non-negative -> [M, N] or [M, N/2]."""
    args = (activation, out_dtype, transpose_rhs, quantization)
    return _pallas_fp8_fwd(lhs, weights, group_sizes, row_scale, *args, keep=False)[0]


def _pallas_fp8_fwd(lhs, weights, group_sizes, row_scale, activation, out_dtype, transpose_rhs, quantization, *, keep):
    recipe = RECIPES[quantization]
    x = lhs if isinstance(lhs, BlockScaled) else quantize_kernel_rows(lhs)
    # With keep this is a VJP's forward: where its backward runs a dgrad (lhs high precision), the weights' pass also
    # writes the dgrad's copy.
    w_nk, w_kn = kernel_weights(weights, recipe, transpose_rhs, with_dgrad=keep and not isinstance(lhs, BlockScaled))
    # The backward needs the pre-activation only where an epilogue lies between it and the output.
    keep = keep and (activation is not None or row_scale is not None)
    outs = run_fp8_forward_kernel(x, w_nk, group_sizes, row_scale, activation, out_dtype, keep=keep)
    out, pre = outs if keep else (outs, None)
    return out, (lhs, weights, w_kn, group_sizes, row_scale, pre)


def kernel_weights(weights, recipe, transpose_rhs: bool, *, with_dgrad: bool):
    """(w [G, N, K] for the forward, w [G, K, N] for the dgrad or None) in fp8_block's 128 x 128 blocks.

    FP8 wgmma operands are K-major, so the forward reads the weights [G, N, K] and the dgrad, contracting over N,
    [G, K, N]; fp8_block's dgrad multiplies by the forward's quantized weights (square blocks). High-precision weights
    are quantized into both layouts in one pass (``quantize_square_blocks``: once per call, the forward and the
    backward sharing the copies); BlockScaled ones are transposed as needed; a QuantizedMaster holds both.
    """
    if isinstance(weights, QuantizedMaster):
        return weights.forward, weights.dgrad if with_dgrad else None
    forward, dgrad = ("as_is", "transposed") if transpose_rhs else ("transposed", "as_is")
    copies = (forward, dgrad) if with_dgrad else (forward,)
    if isinstance(weights, BlockScaled):
        made = {"as_is": weights, "transposed": quant.swap_last_axes(weights)}
        made = tuple(made[copy] for copy in copies)
    else:
        made = quant.quantize_square_blocks(weights, recipe.block, copies=copies, pow2_scales=recipe.pow2_scales)
    return made[0], made[1] if with_dgrad else None


def _pallas_fp8_bwd(activation, out_dtype, transpose_rhs, quantization, residuals, d_out):
    """The epilogue's VJP in XLA on the kept pre-activation, then the recipe's quantized dgrad (``fp8_dgrad``) and
    wgrad (``fp8_wgrad``); no gradient for a BlockScaled operand."""
    lhs, weights, w_kn, group_sizes, row_scale, pre = residuals
    d_pre, d_row_scale = (d_out, None) if pre is None else _epilogue_vjp(pre, row_scale, activation, d_out)
    recipe = RECIPES[quantization]
    d_lhs = d_weights = None
    if not isinstance(lhs, BlockScaled):
        d_lhs = fp8_dgrad(d_pre, w_kn, group_sizes, recipe, transpose_rhs, lhs.dtype)
    if not isinstance(weights, BlockScaled):
        d_master = fp8_wgrad(lhs, group_sizes, d_pre, quantization, transpose_rhs, weights.dtype)
        d_weights = weight_gradient(weights, d_master)
    return d_lhs, d_weights, None, d_row_scale


def fp8_backward_operands(d_pre, lhs_cols: int, w_kn: BlockScaled, group_sizes, out_dtype, w_dtype) -> tuple:
    """d_pre [M, N] as ``fp8_dgrad`` and ``fp8_wgrad`` (transpose_rhs=False, lhs [M, lhs_cols]) take it: where both
    run their kernels, its 1 x 128 rows and its token blocks from one quantizer pass
    (token_blocks.quantize_token_blocks_and_rows), which each GEMM would otherwise make on its own; else d_pre for
    both."""
    recipe = RECIPES[FP8_KERNEL_QUANTIZATION]
    wgrad_refusal = fp8_wgrad_unsupported(FP8_KERNEL_QUANTIZATION, lhs_cols, d_pre.shape[1], w_dtype)
    if not fp8_dgrad_runs(w_kn.shape[1], out_dtype) or wgrad_refusal is not None:
        return d_pre, d_pre
    blocks, rows = token_blocks.quantize_token_blocks_and_rows(d_pre, group_sizes, recipe)
    return rows, blocks


def fp8_dgrad(d_pre, w_kn: BlockScaled, group_sizes, recipe, transpose_rhs: bool, out_dtype) -> jax.Array:
    """d lhs [M, K] = dy . w[g]^T, dy = d_pre [M, N] quantized along N: the FP8 kernel with N as its contraction,
    reading the forward's quantized weights as [G, K, N] (``w_kn``: K-major for this GEMM), where it runs; else in
    XLA. d_pre may come quantized already (``fp8_backward_operands``), where the kernel runs."""
    if isinstance(d_pre, BlockScaled):
        return run_fp8_forward_kernel(d_pre, w_kn, group_sizes, None, None, out_dtype, keep=False)
    if not fp8_dgrad_runs(w_kn.shape[1], out_dtype):
        stored = quant.swap_last_axes(w_kn) if transpose_rhs else w_kn  # the weights' own layout, as XLA's path takes
        return reference_fp8.quantized_dgrad(stored, group_sizes, d_pre, recipe, transpose_rhs, out_dtype)
    return run_fp8_forward_kernel(quantize_kernel_rows(d_pre), w_kn, group_sizes, None, None, out_dtype, keep=False)


def fp8_wgrad(
    lhs,
    group_sizes,
    d_pre,
    quantization: str,
    transpose_rhs: bool,
    out_dtype,
    *,
    row_tokens=None,
    d_pre_row_tokens=None,
) -> jax.Array:
    """d rhs [G, K, N] (or [G, N, K]) = x_g^T . dy_g, lhs and d_pre [M, N] quantized in row blocks per group: the FP8
    wgrad kernel where it runs (``fp8_wgrad_unsupported``), else in XLA. With ``row_tokens`` [M] int32 lhs is
    [T, K] tokens and row r is ``lhs[row_tokens[r]]``; with ``d_pre_row_tokens`` likewise d_pre [T, N]: the kernel
    path gathers the rows in the operand's quantizer. d_pre may come as TokenBlocks already
    (``fp8_backward_operands``), where the kernel runs."""
    recipe = RECIPES[quantization]
    if isinstance(d_pre, token_blocks.TokenBlocks):
        return run_fp8_wgrad_kernel(
            reference_fp8.high_precision(lhs), d_pre, group_sizes, out_dtype=out_dtype, x_row_tokens=row_tokens
        )
    if fp8_wgrad_unsupported(quantization, lhs.shape[1], d_pre.shape[1], out_dtype) is not None:
        rows = lhs if row_tokens is None else reference_fp8.high_precision(lhs)[row_tokens]
        d_rows = d_pre if d_pre_row_tokens is None else d_pre[d_pre_row_tokens]
        return reference_fp8.quantized_wgrad(rows, group_sizes, d_rows, recipe, transpose_rhs, out_dtype)
    x = reference_fp8.high_precision(lhs)
    run = functools.partial(run_fp8_wgrad_kernel, group_sizes=group_sizes, out_dtype=out_dtype)
    if transpose_rhs:  # [G, N, K] weights get their gradient in the same layout: dy_g^T . x_g.
        return run(d_pre, x, x_row_tokens=d_pre_row_tokens, y_row_tokens=row_tokens)
    return run(x, d_pre, x_row_tokens=row_tokens, y_row_tokens=d_pre_row_tokens)


_pallas_fp8_matmul.defvjp(functools.partial(_pallas_fp8_fwd, keep=True), _pallas_fp8_bwd)
