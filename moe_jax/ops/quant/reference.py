"""Pure-JAX block-scaled FP8 quantization: the XLA path and the oracle of the quantizer kernel.

An array x is cut into blocks of ``block_shape`` (one entry per axis; 1 = each element alone along that axis). Every
block gets one scale, computed in f32:

  scale  = amax(|block|) / max, max = finfo(dtype).max        (448 for float8_e4m3fn), as the f32 product
           amax * (1 / max); at least 2**-126, f32's smallest normal number (an all-zero block: values 0)
           with pow2_scales: the smallest power of two >= amax / max and 2**-126 (exactly: nothing saturates)
  values = round_to_nearest_even(x / scale), clipped to +-max, in dtype, with x / scale computed as the f32
           product x * (1 / scale) (one division per block: a division per element would make the kernel
           compute-bound; exact for power-of-two scales, elsewhere within 1.5 f32 ulps of the quotient)

and ``values * scale`` approximates x to 3 significant bits (e4m3; 2 for e5m2). A block holding an Inf or NaN gets a
NaN or Inf scale, so each of its dequantized values is non-finite, never a finite wrong value. Blocks at the end of
an axis that block_shape does not divide are partial: their scale covers the elements that exist.

Power-of-two scales are stored as float8_e8m0fnu (the exponent byte of MXFP8, exact for every scale this makes:
2**-126 to 2**120, NaN for a non-finite block); other scales as f32.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
SMALLEST_SCALE = float(np.finfo(np.float32).smallest_normal)  # 2**-126
POW2_SCALE_DTYPE = jnp.float8_e8m0fnu
_FRACTION_BITS = 23  # of an f32
_FRACTION_MASK = (1 << _FRACTION_BITS) - 1


def scale_dtype(pow2_scales: bool) -> jnp.dtype:
    return jnp.dtype(POW2_SCALE_DTYPE if pow2_scales else jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """An array quantized per block: ``x ~= values * scales`` (each scale broadcast over its block).

    Attributes:
      values: x.shape in an FP8 dtype (float8_e4m3fn or float8_e5m2).
      scales: ``ceil(x.shape / block_shape)``, f32, or float8_e8m0fnu for power-of-two scales; block
        ``(i_0, i_1, ...)`` covers elements ``[i_0 * b_0, (i_0 + 1) * b_0) x ...`` of values.
      block_shape: static, one entry per axis.

    The layout is the logical one above: a kernel that wants another (a K-major copy of the values, scales with M
    minor) makes it from these arrays.
    """

    values: jax.Array
    scales: jax.Array
    block_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The FP8 dtype of the values."""
        return self.values.dtype

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``values * scales`` (broadcast over the blocks) in f32, then cast to ``dtype``."""
        scales = broadcast_blocks(self.scales.astype(jnp.float32), self.block_shape, self.shape)
        return (widened(self.values) * scales).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedMaster:
    """High-precision (master) weights with the FP8 copies the kernels read, quantized once for many calls.

    A training step that runs its layers on several micro-batches makes these once (``moe_jax.quantize_master``)
    and passes them where the weights go: every call's kernels read the copies, and the gradient reaches ``master``
    straight through, as it reaches high-precision weights that the op quantizes itself.

    Attributes:
      master: the weights as the op takes them, [G, K, N] (or [G, N, K] with ``transpose_rhs``), high precision.
      forward: the forward GEMM's copy [G, N, K] (K-major), fp8_block's 128 x 128 blocks.
      dgrad: the dgrad GEMM's copy [G, K, N] (N-major: K-major for a GEMM contracting N), the same blocks.
      transpose_rhs: static, the layout of ``master``; the calls' ``transpose_rhs`` must say the same.
    """

    master: jax.Array
    forward: BlockScaled
    dgrad: BlockScaled
    transpose_rhs: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.master.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The master's dtype (that of the weights' gradient)."""
        return self.master.dtype


def widened(values: jax.Array) -> jax.Array:
    """FP8 ``values`` in f32, exactly as rounded.

    XLA:GPU folds convert(convert(x, f8), f32) into x when both converts are in one program (its default
    ``xla_allow_excess_precision``), which would drop the quantization of an XLA quantizer followed by this; the
    optimization barrier keeps the narrow values between them.
    """
    return lax.optimization_barrier(values).astype(jnp.float32)


def broadcast_blocks(per_block: jax.Array, block_shape, shape) -> jax.Array:
    """[ceil(shape / block_shape)] -> shape: each block's entry repeated over its elements."""
    for axis, (block, size) in enumerate(zip(block_shape, shape, strict=True)):
        if block > 1:
            per_block = lax.slice_in_dim(jnp.repeat(per_block, block, axis=axis), 0, size, axis=axis)
    return per_block


def scales_from_amax(amax: jax.Array, dtype, pow2_scales: bool) -> jax.Array:
    """Each block's f32 scale from its f32 amax (the kernel calls this on its registers too)."""
    largest = float(jnp.finfo(dtype).max)
    if not pow2_scales:
        # A product, not a division: XLA:CPU turns amax / 448 into amax * (1 / 448) (jax 0.11.2; the oracle test saw
        # 1-ulp differences), so every backend computes the product (within one rounding of amax / max).
        return jnp.maximum(amax * jnp.float32(1 / largest), jnp.float32(SMALLEST_SCALE))
    # The smallest power of two p with max * p >= amax, exactly, from the bits: with amax = f * 2**e and
    # max = g * 2**m (f, g in [1, 2)), p = 2**(e - m), doubled when f > g. Biased exponents stay biased.
    _, largest_exponent = math.frexp(largest)  # largest = (g / 2) * 2**largest_exponent
    largest_fraction = int((math.ldexp(largest, 1 - largest_exponent) - 1) * 2**_FRACTION_BITS)
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    exponent = lax.shift_right_logical(bits, jnp.int32(_FRACTION_BITS)) - (largest_exponent - 1)
    exponent = exponent + ((bits & _FRACTION_MASK) > largest_fraction).astype(jnp.int32)
    # At least 2**-126 (biased exponent 1), which also covers amax = 0 and subnormal amax.
    scale = lax.bitcast_convert_type(lax.shift_left(jnp.maximum(exponent, 1), jnp.int32(_FRACTION_BITS)), jnp.float32)
    # Inf and NaN amax (exponent bits all ones) keep a non-finite scale.
    return jnp.where(amax < jnp.float32(jnp.inf), scale, amax)


def reciprocals(scales: jax.Array) -> jax.Array:
    """``1 / scales`` in f32: finite for every finite scale (they lie in [2**-126, 2**120]), 0 for an infinite one."""
    return jnp.float32(1) / scales


def scaled_values(x: jax.Array, reciprocal: jax.Array, dtype) -> jax.Array:
    """``x * reciprocal`` (f32, equal shapes: 1 / scale broadcast over the blocks) rounded to nearest even in
    ``dtype``, clipped to its finite range.

    The clip comes first, so the cast never overflows; NaN passes through both (jnp.minimum and jnp.maximum
    propagate it) and becomes the FP8 NaN. In a block holding Inf the reciprocal is 0: finite x give 0 and Inf gives
    NaN, and the Inf scale makes every dequantized value non-finite.
    """
    limit = jnp.float32(jnp.finfo(dtype).max)
    return jnp.minimum(jnp.maximum(x * reciprocal, -limit), limit).astype(dtype)


def quantize_blockwise(x: jax.Array, block_shape: tuple[int, ...], dtype, pow2_scales: bool) -> BlockScaled:
    """``x`` (any float dtype and rank) quantized per block, as the module docstring defines it."""
    x = x.astype(jnp.float32)
    blocks = tuple(math.ceil(size / block) for size, block in zip(x.shape, block_shape, strict=True))
    # Zeros pad a partial block to full size: they never raise its amax.
    padded = jnp.pad(x, [(0, n * b - size) for n, b, size in zip(blocks, block_shape, x.shape, strict=True)])
    split = padded.reshape([dim for n, b in zip(blocks, block_shape, strict=True) for dim in (n, b)])
    amax = jnp.max(jnp.abs(split), axis=tuple(range(1, 2 * x.ndim, 2)))
    scales = scales_from_amax(amax, dtype, pow2_scales)
    values = scaled_values(x, broadcast_blocks(reciprocals(scales), block_shape, x.shape), dtype)
    return BlockScaled(values, scales.astype(scale_dtype(pow2_scales)), tuple(block_shape))


def quantize_row_blocks_transposed(
    x: jax.Array,
    first_rows: jax.Array,
    row_counts: jax.Array,
    block: int,
    dtype,
    pow2_scales: bool,
    row_tokens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x [M, C] in blocks of rows: block b is rows [first_rows[b], first_rows[b] + row_counts[b]) (at most ``block``,
    rows past M count as zeros), quantized along its rows per column and laid out transposed, padded with zeros to
    ``block`` rows each -> (values_t [C, block * B] in dtype, scales [B, C] in ``scale_dtype(pow2_scales)``). With
    ``row_tokens`` [M] int32, x is [T, C] and row r is x[row_tokens[r]]."""
    if row_tokens is not None:
        x = x[row_tokens]
    num_rows = x.shape[0]
    offsets = jnp.arange(block, dtype=jnp.int32)
    rows = first_rows[:, None] + offsets[None, :]  # [B, block]
    member = (offsets[None, :] < row_counts[:, None]) & (rows < num_rows)
    blocks = jnp.where(member[:, :, None], x.astype(jnp.float32)[jnp.clip(rows, 0, num_rows - 1)], 0.0)
    scales = scales_from_amax(jnp.max(jnp.abs(blocks), axis=1), dtype, pow2_scales)  # [B, C]
    values = scaled_values(blocks, reciprocals(scales)[:, None, :], dtype)
    return values.reshape(-1, x.shape[1]).T, scales.astype(scale_dtype(pow2_scales))
