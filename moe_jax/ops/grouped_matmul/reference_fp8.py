"""Block-scaled FP8 grouped matmul in pure JAX: the recipes of ``grouped_matmul(quantization=...)``, its "xla"
implementation, and the oracle of the FP8 kernel.

A recipe says how each operand of each of the three GEMMs is quantized to float8_e4m3fn with one scale per block
(moe_jax/ops/quant/reference.py has the arithmetic of a block's scale and values):

                 forward  x [M, K] . w[g] [K, N]    dgrad  dy [M, N] . w[g]^T        wgrad  x_g^T . dy_g
    fp8_block    x  1 x 128 along K                 dy  1 x 128 along N              x, dy  128 rows along M
                 w  128 x 128 over (K, N)           w   the forward's blocks          (per group, below)
    mxfp8        x  1 x 32 along K                  dy  1 x 32 along N               x, dy  32 rows along M
                 w  32 x 1 along K                  w   1 x 32 along N (again)
                 power-of-two scales (float8_e8m0fnu) throughout

Every operand is quantized in blocks along its GEMM's contraction, as Hopper's software scaling and MXFP8 need
(DeepSeek-V3's recipe; MXFP8's 1 x 32). fp8_block's square weight blocks lie along both K and N, so its dgrad
multiplies by the forward's quantized weights exactly, read transposed; MXFP8's weights are quantized a second time,
along N, from the high-precision weights.

Group boundaries. The wgrad contracts over one group's rows, so its blocks along M are counted from each group's
first row: group g's rows [start_g, end_g) form the blocks [start_g + b i, min(start_g + b (i + 1), end_g)), the
last one short. No block holds two groups' rows (a kernel computes a block's scale without reading another group's
rows), and the rows past sum(group_sizes) belong to no block.

Gate/up weights. With an activation the weights are quantized in the packed layout (``pack_gate_up``): with F a
multiple of 64 each 128-column block holds 64 gate columns and the matching 64 up columns, the layout the GLU kernel
reads. A plain [gate | up] array is packed before it is quantized, so it and its ``PackedGateUp`` give one result; a
``BlockScaled`` [gate | up] array is taken as it is.

Products: the operands' dequantized values (values * scales, exact in f32) are multiplied with f32 accumulation. A
Hopper kernel instead multiplies the FP8 values of one contraction block into a fresh accumulator and adds it, times
both blocks' scales, to an f32 total ("promotion"): the same sum up to f32 rounding and the tensor cores' own
accumulation within a block.

The products of dequantized operands reduce to two grouped GEMMs (``Gemms``): x . w[g] per group (the forward, and
the dgrad on dy and the transposed weights) and x_g^T . dy_g (the wgrad). ``XLA_GEMMS`` runs them as ``ragged_dot``
in f32, which defines the recipe; a recipe with power-of-two scales (``Recipe.exact_in_bf16``) has dequantized
values that bf16 holds exactly (but for blocks of magnitudes below about 2^-109), so a bf16 GEMM with f32
accumulation multiplies them to the same products and sums those in f32, in its own order (the grouped-matmul
kernels: ``launch.BF16_KERNEL_GEMMS``).

Gradients with respect to high-precision operands are straight-through (the quantization counts as the identity):
d lhs is the dgrad and d rhs the wgrad above, in the operands' dtypes. Pre-quantized operands (``BlockScaled``) are
constants: no gradient reaches them.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.ops.grouped_matmul.packing import PackedGateUp, pack_gate_up, stored_array
from moe_jax.ops.grouped_matmul.reference import epilogue, row_mask
from moe_jax.ops.quant import reference as quant
from moe_jax.ops.quant.reference import BlockScaled

DTYPE = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one ``quantization=`` quantizes the operands of the forward, dgrad and wgrad (the table above).

    Attributes:
      block: block length along every GEMM's contraction.
      weight_cols: the forward weights' block length along N (equal to ``block``: square blocks, which the dgrad
        reuses).
      pow2_scales: scales rounded up to powers of two, stored as float8_e8m0fnu.
    """

    block: int
    weight_cols: int
    pow2_scales: bool

    @property
    def lhs_block(self) -> tuple[int, int]:
        """block_shape of x [M, K] (and of dy [M, N] for the dgrad)."""
        return (1, self.block)

    def rhs_block(self, transpose_rhs: bool) -> tuple[int, int, int]:
        """block_shape of the forward's weights [G, K, N], or [G, N, K] with ``transpose_rhs``."""
        return (1, self.weight_cols, self.block) if transpose_rhs else (1, self.block, self.weight_cols)

    def dgrad_rhs_block(self, transpose_rhs: bool) -> tuple[int, int, int]:
        """block_shape of the dgrad's weights (contracting over N), in the same layout."""
        return (1, self.block, 1) if transpose_rhs else (1, 1, self.block)

    @property
    def dgrad_reuses_weights(self) -> bool:
        return self.weight_cols == self.block

    @property
    def scale_dtype(self) -> jnp.dtype:
        return quant.scale_dtype(self.pow2_scales)

    @property
    def exact_in_bf16(self) -> bool:
        """Whether bf16 holds the dequantized values exactly, but for blocks of tiny magnitudes: an e4m3 value (at most
        4 significant bits) times a power of two is a bf16 number wherever it stays in bf16's normal range, that is
        for block scales of at least 2^-117 (the smallest e4m3 value is 2^-9; 2^-110 for e5m2's 2^-16). The
        quantizer's power-of-two scales fall below 2^-117 only for blocks whose largest magnitude is below 448 x
        2^-118, about 2^-109, where the two paths may differ by bf16's subnormal rounding."""
        return self.pow2_scales


RECIPES = {"fp8_block": Recipe(128, 128, pow2_scales=False), "mxfp8": Recipe(32, 1, pow2_scales=True)}
QUANTIZATIONS = tuple(RECIPES)


def quantize(x: jax.Array, block_shape, recipe: Recipe) -> BlockScaled:
    """x (high precision) quantized per block of ``block_shape`` to float8_e4m3fn with the recipe's scales."""
    return quant.quantize_blockwise(x, block_shape, DTYPE, recipe.pow2_scales)


def as_quantized(x: jax.Array | BlockScaled, block_shape, recipe: Recipe) -> BlockScaled:
    """A BlockScaled operand as it is; a high-precision one quantized."""
    return x if isinstance(x, BlockScaled) else quantize(x, block_shape, recipe)


def high_precision(x: jax.Array | BlockScaled) -> jax.Array:
    """What a gradient GEMM re-quantizes: a high-precision operand itself, a BlockScaled one's dequantized values."""
    return x.dequantize() if isinstance(x, BlockScaled) else x


def output_dtype(lhs, rhs, preferred_element_type) -> jnp.dtype:
    """``preferred_element_type``, else the high-precision inputs' dtype (lhs's, then rhs's), else bf16."""
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    for operand in (lhs, stored_array(rhs)):
        if not isinstance(operand, BlockScaled):
            return jnp.dtype(operand.dtype)
    return jnp.dtype(jnp.bfloat16)


def stored_weights(rhs, activation: str | None, transpose_rhs: bool) -> tuple[jax.Array | BlockScaled, int | None]:
    """(the weights as they are quantized, the gate/up interleave width or None): a PackedGateUp's array; with an
    activation a plain high-precision array packed first (see the module docstring); anything else as it is."""
    if isinstance(rhs, PackedGateUp):
        return rhs.array, rhs.block
    if activation is not None and not isinstance(rhs, BlockScaled):
        packed = pack_gate_up(rhs, transposed=transpose_rhs)
        return packed.array, packed.block
    return rhs, None


def _k_major(w: jax.Array, transpose_rhs: bool) -> jax.Array:
    """Weights [G, K, N] from the layout they are stored in."""
    return jnp.swapaxes(w, 1, 2) if transpose_rhs else w


def _products(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] . w[g] [G, K, N] per group in f32 (full f32 products, not TF32), zeros past the sum -> [M, N]."""
    out = lax.ragged_dot(x, w, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.where(row_mask(group_sizes, x.shape[0])[:, None], out, 0.0)


def _wgrad_products(x: jax.Array, dy: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x_g^T . dy_g per group in f32: x [M, K], dy [M, N], both zero past the sum -> [G, K, N]."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return lax.ragged_dot_general(
        x, dy, group_sizes, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


@dataclasses.dataclass(frozen=True)
class Gemms:
    """The grouped GEMMs that multiply the dequantized operands (f32 arrays), both with f32 results.

    Attributes:
      products: (x [M, K], w [G, K, N], group_sizes [G]) -> [M, N], x's rows of group g times w[g], zeros past the
        sum of group_sizes.
      wgrad: (x [M, K], dy [M, N], group_sizes [G]) -> [G, K, N], x_g^T . dy_g (rows past the sum are zeros).
    """

    products: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    wgrad: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


XLA_GEMMS = Gemms(_products, _wgrad_products)


def quantize_rows_per_group(x: jax.Array, group_sizes: jax.Array, recipe: Recipe) -> jax.Array:
    """x [M, C] quantized in blocks of ``recipe.block`` rows per column, counted from each group's first row (the
    module docstring), and dequantized: [M, C] f32, zeros past sum(group_sizes).

    The blocks are gathered into [blocks, block, C] (a static bound on their number: ceil(M / block) + G, as each
    group adds at most one short block) for their amax, then every row takes its block's scale.
    """
    num_rows, block = x.shape[0], recipe.block
    x = x.astype(jnp.float32)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    block_ends = jnp.cumsum((ends - starts + block - 1) // block)
    block_firsts = block_ends - (ends - starts + block - 1) // block
    capacity = math.ceil(num_rows / block) + sizes.shape[0]

    # Each block's rows: its group's start plus its place in the group.
    blocks = jnp.arange(capacity, dtype=jnp.int32)
    block_group = jnp.minimum(jnp.searchsorted(block_ends, blocks, side="right"), sizes.shape[0] - 1)
    first_row = starts[block_group] + (blocks - block_firsts[block_group]) * block
    rows = first_row[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
    member = (blocks < block_ends[-1])[:, None] & (rows < ends[block_group][:, None])
    members = jnp.where(member[:, :, None], x[jnp.clip(rows, 0, num_rows - 1)], 0.0)
    scales = quant.scales_from_amax(jnp.max(jnp.abs(members), axis=1), DTYPE, recipe.pow2_scales)  # [blocks, C]

    # Each row's block.
    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), sizes.shape[0] - 1)
    row_block = block_firsts[row_group] + (row - starts[row_group]) // block
    row_scales = scales[jnp.clip(row_block, 0, capacity - 1)]
    values = quant.scaled_values(x, quant.reciprocals(row_scales), DTYPE)
    return jnp.where(row_mask(sizes, num_rows)[:, None], quant.widened(values) * row_scales, 0.0)


def dgrad_weights(rhs, rhs_quantized: BlockScaled, recipe: Recipe, transpose_rhs: bool) -> BlockScaled:
    """The dgrad's quantized weights, in rhs's layout: the forward's (fp8_block), or rhs quantized along N."""
    if recipe.dgrad_reuses_weights:
        return rhs_quantized
    return quantize(high_precision(rhs), recipe.dgrad_rhs_block(transpose_rhs), recipe)


def quantized_dgrad(
    dgrad_w: BlockScaled, group_sizes, d_out, recipe: Recipe, transpose_rhs: bool, out_dtype, gemms: Gemms = XLA_GEMMS
):
    """d lhs [M, K] = dy . w[g]^T with dy = d_out [M, N] quantized along N and ``dgrad_w`` (``dgrad_weights``)."""
    dy = quantize(d_out.astype(jnp.float32), recipe.lhs_block, recipe).dequantize()
    w_nk = jnp.swapaxes(_k_major(dgrad_w.dequantize(), transpose_rhs), 1, 2)
    return gemms.products(dy, w_nk, group_sizes).astype(out_dtype)


def quantized_wgrad(lhs, group_sizes, d_out, recipe: Recipe, transpose_rhs: bool, out_dtype, gemms: Gemms = XLA_GEMMS):
    """d rhs [G, K, N] (or [G, N, K]) = x_g^T . dy_g with x (lhs, or its dequantized values) and dy = d_out [M, N]
    quantized in blocks of rows from each group's first row."""
    x_rows = quantize_rows_per_group(high_precision(lhs), group_sizes, recipe)
    dy_rows = quantize_rows_per_group(d_out.astype(jnp.float32), group_sizes, recipe)
    return _k_major(gemms.wgrad(x_rows, dy_rows, group_sizes), transpose_rhs).astype(out_dtype)


def quantized_grads(
    lhs, rhs, rhs_quantized: BlockScaled, group_sizes, d_out, recipe: Recipe, transpose_rhs: bool, gemms: Gemms
):
    """(d lhs, d rhs) of the forward ``lhs . rhs[g]`` for the cotangent ``d_out`` [M, N], each GEMM quantized per
    ``recipe`` (the module docstring) and multiplied by ``gemms``; None for a BlockScaled operand.

    Args:
      lhs: [M, K] high precision, or BlockScaled; rhs: [G, K, N] (or [G, N, K] with ``transpose_rhs``) likewise.
      rhs_quantized: the forward's quantized rhs (what fp8_block's dgrad reuses).
      group_sizes: [G] int32, non-negative; d_out: [M, N].
    """
    d_lhs = d_rhs = None
    if not isinstance(lhs, BlockScaled):
        dgrad_w = dgrad_weights(rhs, rhs_quantized, recipe, transpose_rhs)
        d_lhs = quantized_dgrad(dgrad_w, group_sizes, d_out, recipe, transpose_rhs, lhs.dtype, gemms)
    if not isinstance(rhs, BlockScaled):
        d_rhs = quantized_wgrad(lhs, group_sizes, d_out, recipe, transpose_rhs, rhs.dtype, gemms)
    return d_lhs, d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def quantized_products(lhs, rhs, group_sizes, recipe: Recipe, transpose_rhs: bool, gemms: Gemms) -> jax.Array:
    """lhs [M, K] . rhs[g] per group on the quantized operands, f32 [M, N] (zeros past the sum), with the recipe's
    quantized gradients, all multiplied by ``gemms``. lhs and rhs (the stored weights: [G, K, N], or [G, N, K] with
    ``transpose_rhs``) are high precision or BlockScaled; group_sizes are non-negative."""
    return quantized_forward(lhs, rhs, group_sizes, recipe, transpose_rhs, gemms)[0]


def quantized_forward(
    lhs, rhs, group_sizes, recipe: Recipe, transpose_rhs: bool, gemms: Gemms
) -> tuple[jax.Array, BlockScaled]:
    """(``quantized_products``'s value, the quantized rhs), without its custom gradient."""
    x = as_quantized(lhs, recipe.lhs_block, recipe)
    w = as_quantized(rhs, recipe.rhs_block(transpose_rhs), recipe)
    return gemms.products(x.dequantize(), _k_major(w.dequantize(), transpose_rhs), group_sizes), w


def _quantized_products_fwd(lhs, rhs, group_sizes, recipe, transpose_rhs, gemms):
    out, w = quantized_forward(lhs, rhs, group_sizes, recipe, transpose_rhs, gemms)
    return out, (lhs, rhs, w, group_sizes)


def _quantized_products_bwd(recipe, transpose_rhs, gemms, residuals, d_out):
    lhs, rhs, rhs_quantized, group_sizes = residuals
    return *quantized_grads(lhs, rhs, rhs_quantized, group_sizes, d_out, recipe, transpose_rhs, gemms), None


quantized_products.defvjp(_quantized_products_fwd, _quantized_products_bwd)


def grouped_matmul(
    lhs: jax.Array | BlockScaled,
    rhs: jax.Array | BlockScaled | PackedGateUp,
    group_sizes: jax.Array,
    *,
    quantization: str,
    activation: str | None = None,
    row_scale: jax.Array | None = None,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    gemms: Gemms = XLA_GEMMS,
) -> jax.Array:
    """Reference for ``moe_jax.grouped_matmul(quantization=...)``: the product of the quantized operands (by
    ``gemms``), then the epilogue (GLU, row scale) in f32 and the cast to the output dtype (``output_dtype``)."""
    recipe = RECIPES[quantization]
    out_dtype = output_dtype(lhs, rhs, preferred_element_type)
    weights, block = stored_weights(rhs, activation, transpose_rhs)
    group_sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)  # negative sizes count as 0, as in the kernels
    out = quantized_products(lhs, weights, group_sizes, recipe, transpose_rhs, gemms)
    return epilogue(out, block, activation, row_scale, out_dtype)
