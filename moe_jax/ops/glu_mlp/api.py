"""``moe_jax.glu_mlp``: the routed experts' gated MLP ``(act(x W_gate) * x W_up) W_down``, scaled per row, as one op.

As two ``grouped_matmul`` calls the forward is already fused (GLU in the gate_up epilogue, row scale in the down
epilogue); what one op adds is the backward. Its ``custom_vjp`` (the kernel implementations) runs

    forward   h, gu = gate_up kernel (x, W_gu)          GLU epilogue; gu = the packed pre-activation [M, 2F], kept
              y     = down kernel (h, W_d)              row-scale epilogue
    backward  d_gu, h*s, d_s = glu_dgrad kernel (dy, W_d^T; gu, s)   the GLU backward in the dgrad epilogue:
                             e = dy W_d^T, d_h = s e, (d_gate, d_up) = GLU'(gu) d_h, d_s = sum_f h e (partials)
              d W_d  = wgrad (h*s, dy)
              d x    = dgrad (d_gu, W_gu^T);  d W_gu = wgrad (x, d_gu)        both in the packed layout

so no elementwise pass over [M, 2F] runs outside a GEMM epilogue, and h is never kept: the epilogue recomputes it
from gu. What the backward keeps is x and gu (M * 2F * 2 bytes in bf16). Recomputing gu in the backward instead
(``_glu_mlp(..., recompute_gate_up=True)``) costs one more GEMM, two thirds of the forward's FLOPs, to save those
bytes; keeping gu measured faster at every named shape (docs/kernels/grouped_matmul.md).

With ``quantization`` ("fp8_block" / "mxfp8") the GEMMs run on block-scaled FP8 operands, with the same structure
on the FP8 kernels (fp8_block, "auto" / "pallas"):

    forward   gate_up: x quantized 1 x 128; FP8 kernel, GLU epilogue, keeps gu    down: h quantized; FP8 kernel
              gu kept in FP8, 1 x 128 along its packed columns (64 gate and their 64 up columns a block: one
              block a row of a gate_up tile, quantized in its epilogue)
    backward  dy quantized 1 x 128; glu_dgrad FP8 kernel on the FP8 gu (dequantized and the GLU backward run in its
              epilogue)
              d W_d = FP8 wgrad (h*s, dy);  d x = FP8 dgrad (d_gu quantized, W_gu^T);  d W_gu = FP8 wgrad (x, d_gu)

Each weight is quantized once per call into both of its layouts (the forward's and the dgrad's, the same 128 x 128
blocks), the forward and the backward sharing them; gradients reach the high-precision weights straight through,
and BlockScaled weights get none. reference.py defines this recipe (where it quantizes what) and is the "xla"
implementation. h is written in x's dtype and quantized by its own pass (not in the gate_up epilogue: a 1 x 128
block of h spans two of the FP8 kernel's 64-hidden-column tiles). Keeping gu in FP8, as DeepSeek-V3 caches its
SwiGLU inputs, halves the largest array the backward keeps (M * 2F bytes and an f32 scale per 128); the gate_up
kernel writes it from its accumulators (``launch.run_fp8_forward_kernel``'s ``keep_blocks``: the bits a quantize
pass over a bf16 copy would write), and the GLU-backward kernel reads the FP8 rows and their scales and dequantizes
them in f32 in its epilogue (half the bytes it read in x's dtype, and no dequantized copy written).

"mxfp8" has no FP8 kernel: under "pallas" it runs reference.py's recipe with every GEMM on the bf16 kernels
(``launch.BF16_KERNEL_GEMMS``: its dequantized operands are bf16 numbers, ``reference_fp8.Recipe.exact_in_bf16``),
the routed rows permuted first in high precision and each quantized, the rows' sum (``combine``) after it.

``routed_glu_mlp`` (what ``moe_ffn`` calls) takes the tokens [T, D] and the routing's sort indices instead of sorted
rows. Its implementations, in order: "pallas_gather" (the gate_up kernel gathers its rows from the tokens, so the
[T * k, D] permuted copy is never written and the backward keeps the tokens; preferred up to ``GATHER_MAX_D_FF``),
"pallas_sorted" (permute first, then the sorted-rows kernels) and "xla". With "fp8_block" both kernel paths
quantize each token once; "pallas_gather" then gathers the FP8 rows (D a multiple of 128: a step of a row is one
128-byte copy), "pallas_sorted" permutes them. With ``combine`` it also sums each token's rows; on the FP8
kernels inside their VJP, whose backward then takes dy per token: quantized once per token, its FP8 rows gathered
by the GLU-backward kernel ("pallas_gather") or permuted as x's ("pallas_sorted"), and gathered by the down wgrad's
quantizer (no [T * k, D] bf16 copy of dy is written or quantized).
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

from moe_jax._core import backend as dispatch
from moe_jax._core import checks
from moe_jax.ops.glu_mlp import reference
from moe_jax.ops.grouped_matmul import api as grouped_matmul_api
from moe_jax.ops.grouped_matmul import reference_fp8
from moe_jax.ops.grouped_matmul.api import check_grouped_matmul_args
from moe_jax.ops.grouped_matmul.config import FP8_BLOCK
from moe_jax.ops.grouped_matmul.glu import ACTIVATIONS, glu, glu_grad
from moe_jax.ops.grouped_matmul.launch import (
    FP8_KERNEL_QUANTIZATION,
    KERNEL_DTYPES,
    ArgNames,
    gemm_grads,
    kernel_unsupported,
    quantize_kernel_rows,
    rows_in_groups,
    run_forward_kernel,
    run_fp8_forward_kernel,
    run_glu_dgrad,
    run_wgrad_kernel,
)
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, join_gate_up, pack_gate_up, split_gate_up
from moe_jax.ops.permute import api as permute_api
from moe_jax.ops.quant.reference import BlockScaled

# The two GEMMs' operands and dimensions as glu_mlp's caller knows them; the down projection's lhs is the hidden
# activation, which has x's dtype.
GATE_UP_NAMES = ArgNames(op="glu_mlp", lhs="x", rhs="w_gate_up", k="D", n="2F")
DOWN_NAMES = ArgNames(op="glu_mlp", lhs="x (the hidden activations' dtype)", rhs="w_down", k="F", n="D")

# The gather inside the gate_up kernel saves the permute, whose share of the kernel's time shrinks as 1 / F (bytes
# ~ M D against FLOPs ~ M D F), and changes what the kernel reads: cp.async rows of x [T, D] instead of TMA boxes of
# the sorted rows. At F = 768 (qwen3-30b-a3b) gathering wins and keeps the smaller x for the backward; at F = 2048
# (deepseek-v3 on an H200, bf16 and FP8), 2880 (gpt-oss-120b) and 14336 (mixtral) the gather costs the kernel more
# than the permute it saves (docs/kernels/routing.md). Widths between 768 and 2048 are unmeasured.
GATHER_MAX_D_FF = 1024


def check_glu_mlp_args(x, w_gate_up, w_down, group_sizes, *, activation, row_scale, quantization=None) -> tuple:
    """Validates ``glu_mlp``'s arguments; returns (M, D, F, G)."""
    checks.check_choice("activation", activation, ACTIVATIONS)
    if quantization is not None and isinstance(x, BlockScaled):
        raise TypeError("x: glu_mlp quantizes x itself (1 x 128 blocks per row); pass it in high precision")
    if isinstance(w_gate_up, PackedGateUp) and w_gate_up.transposed:
        raise ValueError("w_gate_up: glu_mlp takes [G, D, 2F] weights; got a transposed PackedGateUp")
    num_rows, d_model, gate_up_cols, num_groups = check_grouped_matmul_args(
        x,
        w_gate_up,
        group_sizes,
        activation=activation,
        row_scale=None,
        preferred_element_type=None,
        transpose_rhs=False,
        quantization=quantization,
        names=GATE_UP_NAMES,
    )
    d_ff = gate_up_cols // 2
    down_shape = checks.check_rank("w_down", w_down, 3, "[G, F, D]")
    if down_shape != (num_groups, d_ff, d_model):
        raise ValueError(f"w_down must have shape [G, F, D] = {(num_groups, d_ff, d_model)}, got {down_shape}")
    hidden = jax.ShapeDtypeStruct((num_rows, d_ff), x.dtype)
    check_grouped_matmul_args(
        hidden,
        w_down,
        group_sizes,
        activation=None,
        row_scale=row_scale,
        preferred_element_type=None,
        transpose_rhs=False,
        quantization=quantization,
        names=DOWN_NAMES,
    )
    return num_rows, d_model, d_ff, num_groups


@dataclasses.dataclass(frozen=True)
class MlpCall:
    """What the GLU MLP implementations decide on: the compute dtype, D, F, the activation, the quantization and,
    with one, the weights' types (``abstract_weights``: whether they come BlockScaled, in which dtype and layout)."""

    dtype: jnp.dtype
    d_model: int
    d_ff: int
    activation: str
    quantization: str | None = None
    weights: tuple = (None, None)


def abstract_weights(w_gate_up, w_down) -> tuple:
    """(w_gate_up, w_down) with ``jax.ShapeDtypeStruct`` leaves, their pytree types (BlockScaled, PackedGateUp) kept."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (w_gate_up, w_down))


def _kernels_unsupported(call: MlpCall) -> str | None:
    """Why the gate_up or the down kernels cannot run the MLP (None: both can)."""
    if call.quantization is not None:
        w_gate_up, w_down = call.weights
        gemms = ((call.d_model, 2 * call.d_ff, call.activation, w_gate_up), (call.d_ff, call.d_model, None, w_down))
        problem = grouped_matmul_api.quantized_kernels_unsupported(call.dtype, gemms, call.quantization)
        exact_in_bf16 = reference_fp8.RECIPES[call.quantization].exact_in_bf16
        if problem is None and not exact_in_bf16 and call.dtype not in map(jnp.dtype, KERNEL_DTYPES):
            # Its tiles of 32-bit pre-activations would leave the pipeline no room in shared memory.
            problem = (
                "with quantization the GLU backward kernel reads the pre-activation in x's dtype, which must be "
                f"bfloat16 or float16 for backend='pallas', got {call.dtype.name}"
            )
        return problem
    x = jax.ShapeDtypeStruct((0, call.d_model), call.dtype)
    gate_up = kernel_unsupported(x, call.d_model, 2 * call.d_ff, call.activation, GATE_UP_NAMES)
    return gate_up or kernel_unsupported(x, call.d_ff, call.d_model, None, DOWN_NAMES)


def _gather_preferred(call: MlpCall) -> bool:
    return call.d_ff <= GATHER_MAX_D_FF


def _gather_unsupported(call: MlpCall) -> str | None:
    if call.quantization is not None and reference_fp8.RECIPES[call.quantization].exact_in_bf16:
        return f"{call.quantization!r} multiplies permuted rows (the bf16 kernels on its dequantized operands)"
    if call.quantization is not None and call.d_model % FP8_BLOCK:
        # A gathered row's step is one 128-byte copy of its FP8 values; a partial last K block has none.
        return f"the FP8 kernel gathers rows in 128-column K blocks: D must be a multiple of {FP8_BLOCK}"
    return _kernels_unsupported(call)


IMPLEMENTATIONS = (dispatch.Implementation("pallas", _kernels_unsupported), dispatch.XLA)
ROUTED_IMPLEMENTATIONS = (
    dispatch.Implementation("pallas_gather", _gather_unsupported, _gather_preferred),
    dispatch.Implementation("pallas_sorted", _kernels_unsupported),
    dispatch.XLA,
)


def select_routed(backend: str, call: MlpCall) -> str:
    """The implementation of ``routed_glu_mlp`` that ``backend`` selects: "pallas_gather", "pallas_sorted" or
    "xla" (each may also be named as the backend)."""
    return dispatch.select("glu_mlp", backend, ROUTED_IMPLEMENTATIONS, call).name


def glu_mlp(
    x: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str = "swiglu",
    row_scale: jax.Array | None = None,
    zero_tail: bool = True,
    backend: str = "auto",
    recompute_gate_up: bool | None = None,
    quantization: str | None = None,
) -> jax.Array:
    """Grouped gated MLP: ``y_r = row_scale_r * (act(x_r W_gate[g]) * (x_r W_up[g])) W_down[g]`` for rows r of group g.

    Equal to ``grouped_matmul(grouped_matmul(x, w_gate_up, group_sizes, activation=activation), w_down, group_sizes,
    row_scale=row_scale)`` (the hidden activations rounded to x.dtype in between), with a fused backward. With
    ``quantization`` the forward is that composition's and the backward quantizes dy before the row scale
    (reference.py's recipe).

    Args:
      x: [M, D] rows sorted by group.
      w_gate_up: [G, D, 2F] ``[gate | up]`` weights, or a ``PackedGateUp`` of them (``pack_gate_up``: what the Pallas
        path reads; a plain array is packed on every call there).
      w_down: [G, F, D].
      group_sizes: [G] int32; rows at or past ``sum(group_sizes)`` give zeros.
      activation: "swiglu", "geglu" or "gpt_oss" (defined in ``grouped_matmul``).
      row_scale: optional [M] float (the routing weights); gets a gradient.
      zero_tail: False lets the Pallas path leave the result's rows past ``sum(group_sizes)`` unwritten (their
        values unspecified) and skip them in every kernel of the backward: for callers that never read those rows,
        e.g. ``combine(..., num_rows=sum(group_sizes))``. Gradients stay exact. With ``quantization`` the FP8
        kernels write zeros there either way.
      backend: "auto", "xla" or "pallas" ("pallas" needs bf16/f16, D and F multiples of 64; with ``quantization``
        bf16/f16/f32, D and F multiples of 128, and weights high precision or packed; with "mxfp8" any float x, D
        and F multiples of 64).
      recompute_gate_up: deprecated and ignored (results are the same either way): the backward keeps the
        pre-activation.
      quantization: None, "fp8_block" or "mxfp8": both GEMMs on block-scaled FP8 operands, as
        ``grouped_matmul(quantization=...)`` defines them (the backward: the module docstring; the FP8 kernels need
        x in bf16 or f16, mxfp8's bf16 kernels D and F multiples of 64). The weights may then also be
        ``BlockScaled`` (``quantize_weights``; w_gate_up as a PackedGateUp of one for the kernels), which get no
        gradient, or, with "fp8_block", ``QuantizedMaster`` (``quantize_master``, w_gate_up packed first), whose
        copies the kernels read and whose master gets the gradient; x stays high precision.

    Returns:
      [M, D] in x.dtype.
    """
    if recompute_gate_up is not None:
        warnings.warn(
            "glu_mlp(recompute_gate_up=...) is deprecated and has no effect: the backward keeps the pre-activation, "
            "which measured faster, and the results are identical either way",
            DeprecationWarning,
            stacklevel=2,
        )
    _, d_model, d_ff, _ = check_glu_mlp_args(
        x, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_scale, quantization=quantization
    )
    call = MlpCall(jnp.dtype(x.dtype), d_model, d_ff, activation, quantization, abstract_weights(w_gate_up, w_down))
    implementation = dispatch.select("glu_mlp", backend, IMPLEMENTATIONS, call).name
    group_sizes = group_sizes.astype(jnp.int32)
    if quantization is not None:
        return _quantized_glu_mlp(
            x, w_gate_up, w_down, group_sizes, activation, row_scale, quantization, implementation
        )
    return _glu_mlp(x, w_gate_up, w_down, group_sizes, activation, row_scale, zero_tail, implementation)


def dense_glu_mlp(
    x: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    *,
    activation: str = "swiglu",
    backend: str = "auto",
    quantization: str | None = None,
) -> jax.Array:
    """``glu_mlp``'s MLP over one group that holds every row: an always-on (shared) expert.

    Unquantized, one group is a dense MLP, and it runs as XLA matmuls whatever ``backend`` names: two forward, four
    backward, the GLU and its hand-derived gradient (``glu_grad``, the kernels' epilogue math) in XLA elementwise
    passes between them, and the backward keeping x and the pre-activation in x's dtype, as the kernels keep it.
    Unlike the kernels it rounds the matmuls' products to x's dtype before the GLU and its gradient (the kernels take
    them from the f32 accumulators): the results are glu_mlp's to that rounding. At train's gpu-moe shared expert it
    runs in 0.91x the grouped kernels' time, and a program holds no kernel of it to lower and compile
    (docs/kernels/grouped_matmul.md, "Lowering and compile time"). With ``quantization`` it is ``glu_mlp``'s (the
    FP8 kernels on "pallas" and "auto" on an H100/H200: XLA has no block-scaled FP8 matmul).

    Args:
      x: [T, D].  w_gate_up: [1, D, 2F] ``[gate | up]``, or its ``PackedGateUp``.  w_down: [1, F, D].
      activation, backend, quantization: as in ``glu_mlp``.

    Returns:
      [T, D] in x.dtype.
    """
    for name, weights, layout in (("w_gate_up", w_gate_up, "[1, D, 2F]"), ("w_down", w_down, "[1, F, D]")):
        if checks.check_rank(name, weights, 3, layout)[0] != 1:
            raise ValueError(f"{name} must hold one group, {layout}, got shape {tuple(weights.shape)}")
    all_rows = jnp.full((1,), x.shape[0], jnp.int32)
    if quantization is not None:
        options = dict(activation=activation, backend=backend, quantization=quantization)
        return glu_mlp(x, w_gate_up, w_down, all_rows, **options)
    check_glu_mlp_args(x, w_gate_up, w_down, all_rows, activation=activation, row_scale=None)
    checks.check_choice("backend", backend, dispatch.BACKENDS)
    # Plain [gate | up] halves are the packed layout with one block of F columns.
    block = w_down.shape[1]
    if isinstance(w_gate_up, PackedGateUp):
        block, w_gate_up = w_gate_up.block, w_gate_up.array
    return _dense_glu_mlp(x, w_gate_up[0], w_down[0], block, activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dense_glu_mlp(x, w_gate_up, w_down, block, activation):
    """x [T, D], w_gate_up [D, 2F] (packed in blocks of ``block`` columns), w_down [F, D] -> [T, D]."""
    return _dense_glu_mlp_fwd(x, w_gate_up, w_down, block, activation)[0]


def _gate_and_up(pre: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    return split_gate_up(pre.astype(jnp.float32), block)


def _dense_glu_mlp_fwd(x, w_gate_up, w_down, block, activation):
    pre = jnp.dot(x, w_gate_up)
    hidden = glu(*_gate_and_up(pre, block), activation).astype(x.dtype)
    return jnp.dot(hidden, w_down), (x, w_gate_up, w_down, pre)


def _dense_glu_mlp_bwd(block, activation, residuals, d_y):
    """The GLU's gradient recomputes the hidden activations from the kept pre-activation in the same pass."""
    x, w_gate_up, w_down, pre = residuals
    d_hidden = jnp.dot(d_y, w_down.T).astype(jnp.float32)
    hidden, d_gate, d_up = glu_grad(*_gate_and_up(pre, block), d_hidden, activation)
    d_pre = join_gate_up(d_gate, d_up, block).astype(x.dtype)
    return jnp.dot(d_pre, w_gate_up.T), jnp.dot(x.T, d_pre), jnp.dot(hidden.astype(x.dtype).T, d_y)


_dense_glu_mlp.defvjp(_dense_glu_mlp_fwd, _dense_glu_mlp_bwd)


def _quantized_glu_mlp(
    x,
    w_gate_up,
    w_down,
    group_sizes,
    activation,
    row_scale,
    quantization,
    implementation,
    routed=(None, None, None),
    *,
    gather: bool = False,
    combine: str | None = None,
):
    """The FP8 GLU MLP (the module docstring) on checked arguments, by ``implementation`` ("pallas" or "xla").

    ``routed``: (sort_indices, top_k, positions) with x [T, D] tokens (the kernels quantize each token once, then
    the gate_up kernel gathers its FP8 rows with ``gather``, else they are permuted first), or Nones with x [M, D]
    rows. ``combine`` (kernels only): the backend of ``permute.combine`` summing each token's rows into y [T, D],
    inside the custom VJP of the FP8 kernels (``_pallas_fp8_glu_mlp``), after the recipe on the bf16 kernels (mxfp8)."""
    sort_indices, top_k, positions = routed
    recipe_gemms = grouped_matmul_api.quantized_gemms(implementation, quantization)
    if recipe_gemms is not None:
        if sort_indices is not None:
            rows_backend = "xla" if implementation == "xla" else _rows_backend(x)
            x = permute_api.permute(x, sort_indices, top_k, positions=positions, backend=rows_backend)
        y = reference.quantized_glu_mlp(
            x,
            grouped_matmul_api.master_weights(w_gate_up),
            grouped_matmul_api.master_weights(w_down),
            group_sizes,
            activation=activation,
            quantization=quantization,
            row_scale=row_scale,
            gemms=recipe_gemms,
        )
        if combine is None:
            return y
        return permute_api.combine(y, sort_indices, top_k, positions=positions, backend=combine)
    weights, _ = reference_fp8.stored_weights(w_gate_up, activation, False)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)
    args = (x, weights, w_down, jnp.maximum(group_sizes, 0), scale, sort_indices, positions)
    return _pallas_fp8_glu_mlp(*args, top_k, activation, gather, combine)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _pallas_fp8_glu_mlp(
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, positions, top_k, activation, gather, combine
):
    """x [M, D] high precision (or [T, D] tokens whose rows sort_indices // top_k picks: gathered by the gate_up
    kernel with ``gather``, else permuted), the stored weights (packed w_gate_up [G, D, 2F], w_down [G, F, D]; high
    precision or BlockScaled), group_sizes non-negative -> [M, D] in x.dtype, on the FP8 kernels (fp8_block).

    ``combine`` (a ``permute.combine`` backend, with tokens): y [T, D], each token's k rows summed. The backward
    then takes the tokens' gradient [T, D]: each token's is quantized once (its rows' 1 x 128 blocks are its own),
    the GLU-backward kernel gathers the rows' FP8 values as the gate_up kernel does (``gather``) or reads them
    permuted as the forward's x (``_expert_ordered_rows``), and the down wgrad's quantizer gathers the rows it reads,
    so no [M, D] bf16 copy of dy is written or quantized."""
    args = (x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, positions, top_k, activation, gather, combine)
    return _fp8_glu_mlp_fwd(*args, with_backward=False)[0]


def _fp8_glu_mlp_fwd(
    x,
    w_gate_up,
    w_down,
    group_sizes,
    row_scale,
    sort_indices,
    positions,
    top_k,
    activation,
    gather,
    combine,
    *,
    with_backward: bool,
):
    """y and, ``with_backward``, the backward's residuals: then each weight's pass also writes the dgrad's layout (the
    forward's blocks, transposed) and the gate_up kernel keeps the pre-activation.

    Tokens are quantized once each (1 x 128 blocks along D lie within a row, so a row's blocks are its token's): a
    quantize pass over T rows, not T * k. The gate_up kernel then gathers each row's FP8 values from its token
    (``gather``; its scales are gathered in XLA, 1/32 of the values' bytes), or the FP8 rows and scales are permuted
    first (half the bytes of permuting x).
    """
    recipe = reference_fp8.RECIPES[FP8_KERNEL_QUANTIZATION]
    layouts = functools.partial(grouped_matmul_api.kernel_weights, recipe=recipe, with_dgrad=with_backward)
    w_gate_up_nk, w_gate_up_kn = layouts(w_gate_up, transpose_rhs=False)
    w_down_nk, w_down_kn = layouts(w_down, transpose_rhs=False)
    quantized, row_tokens = quantize_kernel_rows(x), _row_tokens(sort_indices, top_k)
    if row_tokens is not None and not gather:
        quantized = _expert_ordered_rows(quantized, sort_indices, top_k, positions, row_tokens)
    gate_up_args = (w_gate_up_nk, group_sizes, None, activation, x.dtype)
    # The pre-activation kept in FP8 (the module docstring).
    options = dict(keep=with_backward, keep_blocks=True, row_tokens=row_tokens if gather else None)
    outs = run_fp8_forward_kernel(quantized, *gate_up_args, **options)
    hidden, gate_up = outs if with_backward else (outs, None)
    y = run_fp8_forward_kernel(
        quantize_kernel_rows(hidden), w_down_nk, group_sizes, row_scale, None, x.dtype, keep=False
    )
    if combine is not None:
        y = permute_api.combine(y, sort_indices, top_k, positions=positions, backend=combine)
    weights = (w_gate_up, w_gate_up_kn, w_down, w_down_kn)
    return y, (x, weights, group_sizes, row_scale, sort_indices, positions, gate_up)


def _expert_ordered_rows(tokens: BlockScaled, sort_indices, top_k: int, positions, row_tokens) -> BlockScaled:
    """The tokens' FP8 rows [T, D] (1 x 128 blocks) in expert order [T * k, D]: the values permuted as one-byte rows,
    the scales (1/32 of their bytes) gathered in XLA by ``row_tokens`` [T * k] (each row's token)."""
    backend = _rows_backend(permute_api.kernel_rows(tokens.values))
    values = permute_api.permute(tokens.values, sort_indices, top_k, positions=positions, backend=backend)
    return BlockScaled(values, tokens.scales[row_tokens], tokens.block_shape)


def _fp8_glu_mlp_bwd(top_k, activation, gather, combine, residuals, d_y):
    """The recipe's backward (reference.py) on the kernels: the glu_dgrad kernel on FP8 operands, then the gate_up
    GEMM's FP8 dgrad and both FP8 wgrads; no gradient for BlockScaled weights. The gate_up wgrad's quantizer gathers
    the tokens' rows itself (no permuted copy of x is written), and x's gradient sums each token's rows
    (``combine``). With ``combine``, d_y is the tokens' [T, D] and row r's is d_y[sort_indices[r] // top_k]
    (``_pallas_fp8_glu_mlp``): quantized per token, its FP8 rows gathered by the GLU-backward kernel (``gather``) or
    permuted into expert order first, and gathered by the down wgrad's quantizer."""
    x, weights, group_sizes, row_scale, sort_indices, positions, gate_up = residuals
    w_gate_up, w_gate_up_kn, w_down, w_down_kn = weights
    recipe = reference_fp8.RECIPES[FP8_KERNEL_QUANTIZATION]
    d_y = d_y.astype(x.dtype)
    row_tokens = _row_tokens(sort_indices, top_k)
    d_y_tokens = row_tokens if combine is not None else None
    d_y_quantized = quantize_kernel_rows(d_y)
    if d_y_tokens is not None and not gather:
        d_y_quantized = _expert_ordered_rows(d_y_quantized, sort_indices, top_k, positions, row_tokens)
    d_gate_up, hidden_scaled, d_row_scale = run_glu_dgrad(
        d_y_quantized,
        w_down_kn,
        group_sizes,
        gate_up,
        row_scale,
        activation,
        out_dtype=x.dtype,
        row_tokens=d_y_tokens if gather else None,
    )
    d_gate_up_rows = d_gate_up_blocks = d_gate_up
    if not isinstance(w_gate_up, BlockScaled):
        d_gate_up_rows, d_gate_up_blocks = grouped_matmul_api.fp8_backward_operands(
            d_gate_up, x.shape[1], w_gate_up_kn, group_sizes, x.dtype, w_gate_up.dtype
        )
    d_rows = grouped_matmul_api.fp8_dgrad(d_gate_up_rows, w_gate_up_kn, group_sizes, recipe, False, x.dtype)
    wgrad = functools.partial(grouped_matmul_api.fp8_wgrad, quantization=FP8_KERNEL_QUANTIZATION, transpose_rhs=False)
    d_w_gate_up = d_w_down = None
    if not isinstance(w_gate_up, BlockScaled):
        d_master = wgrad(x, group_sizes, d_gate_up_blocks, out_dtype=w_gate_up.dtype, row_tokens=row_tokens)
        d_w_gate_up = grouped_matmul_api.weight_gradient(w_gate_up, d_master)
    if not isinstance(w_down, BlockScaled):
        d_master = wgrad(hidden_scaled, group_sizes, d_y, out_dtype=w_down.dtype, d_pre_row_tokens=d_y_tokens)
        d_w_down = grouped_matmul_api.weight_gradient(w_down, d_master)
    d_x = d_rows
    if sort_indices is not None:
        d_x = permute_api.combine(d_rows, sort_indices, top_k, positions=positions, backend=_rows_backend(x))
    return d_x, d_w_gate_up, d_w_down, None, d_row_scale, None, None


_pallas_fp8_glu_mlp.defvjp(functools.partial(_fp8_glu_mlp_fwd, with_backward=True), _fp8_glu_mlp_bwd)


def _glu_mlp(
    x, w_gate_up, w_down, group_sizes, activation, row_scale, zero_tail, implementation, *, recompute_gate_up=False
):
    """``glu_mlp`` on checked arguments by ``implementation`` ("pallas" or "xla"); ``recompute_gate_up`` (kernels
    only) recomputes the pre-activation in the backward instead of keeping it (the same results)."""
    if implementation == "xla":
        return reference.glu_mlp(x, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_scale)
    return _run_pallas(
        x, None, None, w_gate_up, w_down, group_sizes, row_scale, activation, recompute_gate_up, zero_tail
    )


def routed_glu_mlp(
    x: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str = "swiglu",
    row_scale: jax.Array | None = None,
    zero_tail: bool = True,
    positions: jax.Array | None = None,
    backend: str = "auto",
    quantization: str | None = None,
    combine: str | None = None,
) -> jax.Array:
    """``glu_mlp(permute(x, sort_indices, top_k), ...)``, on the kernel path with the permute fused into the
    gate_up kernel's loads where that pays; with ``combine``, also each token's rows summed (``permute.combine``).

    Fused ("pallas_gather"), the expert-sorted rows [T * k, D] are never written: the gate_up kernel gathers row r
    from ``x[sort_indices[r] // top_k]`` (grouped_matmul/sm90_gather.py), and the backward recomputes the sorted rows
    for the gate_up weights' gradient and sums each token's k row gradients (``combine``) for x's. Otherwise it is
    the composition itself.

    Args:
      x: [T, D] tokens.
      sort_indices: [T * k] int32 from ``Routing.sort_indices`` (or ``apply_capacity``).
      top_k: k, the experts per token.
      w_gate_up, w_down, group_sizes, activation, row_scale, zero_tail: as ``glu_mlp``'s, for the T * k sorted rows.
      positions: optional [T, k] int32, the inverse of ``sort_indices`` (``Routing.positions``), for ``permute``.
      backend: "auto", "xla", "pallas", or one implementation by name: "pallas_gather", "pallas_sorted".
      quantization: ``glu_mlp``'s. With "fp8_block" each token is quantized once; "pallas_gather" gathers its FP8
        rows in the gate_up kernel (D a multiple of 128), "pallas_sorted" permutes them and their scales first. With
        "mxfp8" the rows are permuted in high precision and quantized each ("pallas_sorted").
      combine: None, or the backend of ``permute.combine`` ("auto", "xla", "pallas") that sums each token's k rows
        (rows past the sum add nothing: zeros with ``zero_tail``, else not read). On fp8_block's kernels the sum is
        inside their custom VJP, so the backward takes the tokens' gradient: each token's dy is quantized once, its
        FP8 rows gathered in the kernels or permuted, and no [T * k, D] bf16 copy of it is written (those kernels
        write zeros past the sum whatever ``zero_tail`` says, and the sum reads them).

    Returns:
      [T * k, D] in x.dtype, in expert-sorted order (what ``combine`` takes); with ``combine`` [T, D].
    """
    num_tokens, d_model = checks.check_rank("x", x, 2, "[T, D]")
    checks.check_positive_int("top_k", top_k)
    checks.check_rank("sort_indices", sort_indices, 1, "[T * k]")
    checks.check_int32("sort_indices", sort_indices)
    checks.check_dim("sort_indices", sort_indices.shape[0], num_tokens * top_k, "length (T * top_k)")
    rows = jax.ShapeDtypeStruct((num_tokens * top_k, d_model), x.dtype)
    _, _, d_ff, _ = check_glu_mlp_args(
        rows, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_scale, quantization=quantization
    )
    weights = abstract_weights(w_gate_up, w_down)
    implementation = select_routed(
        backend, MlpCall(jnp.dtype(x.dtype), d_model, d_ff, activation, quantization, weights)
    )
    group_sizes = group_sizes.astype(jnp.int32)
    gather = implementation == "pallas_gather"
    mlp_implementation = "xla" if implementation == "xla" else "pallas"
    if quantization is not None:
        args = (activation, row_scale, quantization, mlp_implementation, (sort_indices, top_k, positions))
        # The FP8 kernels' custom VJP sums the rows itself.
        fused_combine = combine if mlp_implementation == "pallas" else None
        y = _quantized_glu_mlp(x, w_gate_up, w_down, group_sizes, *args, gather=gather, combine=fused_combine)
        if fused_combine is not None:
            return y
    elif gather:
        y = _run_pallas(x, sort_indices, top_k, w_gate_up, w_down, group_sizes, row_scale, activation, False, zero_tail)
    else:
        rows_backend = _rows_backend(x) if implementation == "pallas_sorted" else "xla"
        rows = permute_api.permute(x, sort_indices, top_k, positions=positions, backend=rows_backend)
        y = _glu_mlp(rows, w_gate_up, w_down, group_sizes, activation, row_scale, zero_tail, mlp_implementation)
    if combine is None:
        return y
    num_rows = None if zero_tail else rows_in_groups(group_sizes, y.shape[0])
    return permute_api.combine(y, sort_indices, top_k, num_rows=num_rows, positions=positions, backend=combine)


def _rows_backend(x) -> str:
    """Where the kernel path moves the sorted rows of x: the permute/combine kernels where they take x's width,
    else XLA."""
    return "pallas" if permute_api.kernel_unsupported(x) is None else "xla"


def _run_pallas(
    x, sort_indices, top_k, w_gate_up, w_down, group_sizes, row_scale, activation, recompute_gate_up, zero_tail
):
    if not isinstance(w_gate_up, PackedGateUp):
        w_gate_up = pack_gate_up(w_gate_up)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)
    args = (x, w_gate_up.array, w_down, group_sizes, scale, sort_indices)
    return _pallas_glu_mlp(*args, top_k, activation, recompute_gate_up, zero_tail)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _pallas_glu_mlp(
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, top_k, activation, recompute_gate_up, zero_tail
):
    """x [M, D] (or [T, D] tokens gathered by sort_indices // top_k), packed w_gate_up [G, D, 2F], w_down [G, F, D]
    -> [M, D] in x.dtype (rows past the sum unwritten unless ``zero_tail``)."""
    del recompute_gate_up  # a backward option
    row_tokens = _row_tokens(sort_indices, top_k)
    hidden = _gate_up(x, w_gate_up, group_sizes, activation, row_tokens, keep=False, zero_tail=zero_tail)
    return _down(hidden, w_down, group_sizes, row_scale, zero_tail)


def _row_tokens(sort_indices, top_k):
    """The token of each sorted row (None: the rows are x's own)."""
    return None if sort_indices is None else sort_indices // top_k


def _gate_up(x, w_gate_up, group_sizes, activation, row_tokens, *, keep: bool, zero_tail: bool):
    """hidden [M, F], or (hidden, packed pre-activation [M, 2F] rounded for the backward)."""
    return run_forward_kernel(
        x,
        w_gate_up,
        group_sizes,
        None,
        activation,
        x.dtype,
        False,
        keep=keep,
        row_tokens=row_tokens,
        zero_tail=zero_tail,
    )


def _down(hidden, w_down, group_sizes, row_scale, zero_tail: bool):
    """[M, D] = hidden · w_down[g], rows scaled by ``row_scale`` (if any) in the epilogue."""
    return run_forward_kernel(
        hidden, w_down, group_sizes, row_scale, None, hidden.dtype, False, keep=False, zero_tail=zero_tail
    )


def _glu_mlp_fwd(
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, top_k, activation, recompute_gate_up, zero_tail
):
    row_tokens = _row_tokens(sort_indices, top_k)
    gate_up_args = (x, w_gate_up, group_sizes, activation, row_tokens)
    if recompute_gate_up:
        hidden, gate_up = _gate_up(*gate_up_args, keep=False, zero_tail=zero_tail), None
    else:
        hidden, gate_up = _gate_up(*gate_up_args, keep=True, zero_tail=zero_tail)
    y = _down(hidden, w_down, group_sizes, row_scale, zero_tail)
    return y, (x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, gate_up)


def _glu_mlp_bwd(top_k, activation, recompute_gate_up, zero_tail, residuals, d_y):
    """The GLU MLP's VJP. Without ``zero_tail`` (d_y's rows past the sum are not the result's: ignored) the kernels
    skip those rows and what is left unwritten there never reaches a gradient: the wgrad kernels mask rows outside
    a group, d_row_scale is selected, and x's gradient comes from rows the caller reads (the dgrad writes zeros past
    the sum for an x of rows; a gathered x sums only the rows before it)."""
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, gate_up = residuals
    d_y = d_y.astype(x.dtype)  # wgmma multiplies equal dtypes; accumulation stays f32
    if recompute_gate_up:
        # The forward kernel again, so that the backward sees the very bits it would have kept (the hidden output
        # is written and dropped: half the pre-activation's bytes, for one kernel to maintain).
        row_tokens = _row_tokens(sort_indices, top_k)
        _, gate_up = _gate_up(x, w_gate_up, group_sizes, activation, row_tokens, keep=True, zero_tail=zero_tail)
    d_gate_up, hidden_scaled, d_row_scale = run_glu_dgrad(
        d_y, w_down, group_sizes, gate_up, row_scale, activation, zero_tail=zero_tail
    )
    d_w_down = run_wgrad_kernel(hidden_scaled, d_y, group_sizes, out_dtype=w_down.dtype)
    if sort_indices is None:
        d_x, d_w_gate_up = gemm_grads(x, w_gate_up, group_sizes, d_gate_up, transpose_rhs=False)
    else:
        # The gate_up wgrad contracts the sorted rows: with the gather fused they exist only here, for the backward.
        rows_backend = _rows_backend(x)
        rows = permute_api.permute(x, sort_indices, top_k, backend=rows_backend)
        d_rows, d_w_gate_up = gemm_grads(
            rows, w_gate_up, group_sizes, d_gate_up, transpose_rhs=False, zero_tail=zero_tail
        )
        num_rows = None if zero_tail else rows_in_groups(group_sizes, d_rows.shape[0])
        d_x = permute_api.combine(d_rows, sort_indices, top_k, num_rows=num_rows, backend=rows_backend)
    return d_x, d_w_gate_up, d_w_down, None, d_row_scale, None


_pallas_glu_mlp.defvjp(_glu_mlp_fwd, _glu_mlp_bwd)
