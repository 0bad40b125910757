"""``moe_jax.quantize_blockwise``: block-scaled FP8 quantization (1 x 128 activations, 128 x 128 weights, MXFP8's
1 x 32 with power-of-two scales); the activation quantizer's fused transposed copy for weight gradients, and the
weight quantizer's two layouts (the FP8 forward's and dgrad's) from one read of the weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_jax._core import backend as dispatch
from moe_jax._core import checks
from moe_jax._core.hardware import interpret_params, num_sms
from moe_jax.ops.quant import config, reference, sm90, sm90_row_blocks, sm90_square
from moe_jax.ops.quant.reference import FP8_DTYPES, POW2_SCALE_DTYPE, BlockScaled

__all__ = [
    "BlockScaled",
    "quantize_blockwise",
    "quantize_blockwise_with_transpose",
    "quantize_row_blocks_transposed",
    "quantize_square_blocks",
]


def _check_block_shape(block_shape, ndim: int) -> tuple[int, ...]:
    if not isinstance(block_shape, tuple | list) or any(
        isinstance(b, bool) or not isinstance(b, int | np.integer) for b in block_shape
    ):
        raise TypeError(f"block_shape must be a tuple of Python ints (one per axis of x), got {block_shape!r}")
    if len(block_shape) != ndim:
        raise ValueError(f"block_shape must have one entry per axis of x (rank {ndim}), got {tuple(block_shape)}")
    if any(b < 1 for b in block_shape):
        raise ValueError(
            f"block_shape entries must be >= 1 (1 = one element per block along that axis), got {block_shape}"
        )
    return tuple(int(b) for b in block_shape)


def _check_options(x, dtype, pow2_scales, name: str = "x") -> None:
    checks.shape_of(name, x)
    checks.check_float(name, x)
    if jnp.dtype(dtype) not in map(jnp.dtype, FP8_DTYPES):
        names = ", ".join(jnp.dtype(d).name for d in FP8_DTYPES)
        raise TypeError(f"dtype must be one of ({names}), got {jnp.dtype(dtype).name}")
    checks.check_static_bool("pow2_scales", pow2_scales)


@dataclasses.dataclass(frozen=True)
class _QuantizeCall:
    """What the quantizer implementations decide on."""

    shape: tuple[int, ...]
    in_dtype: jnp.dtype
    block_shape: tuple[int, ...]
    dtype: jnp.dtype
    with_transpose: bool
    row_blocks: bool = False  # quantize_row_blocks_transposed's blocks of block_shape[0] rows at given starts
    pow2_scales: bool = False


def _kernel_unsupported(call: _QuantizeCall) -> str | None:
    if call.row_blocks:
        refusal = config.row_blocks_refusal(call.shape, call.in_dtype, call.block_shape[0], call.dtype)
    else:
        refusal = config.refusal(
            call.shape, call.in_dtype, call.block_shape, call.dtype, call.with_transpose, call.pow2_scales
        )
    return None if refusal is None else f"the Pallas kernel {refusal}"


IMPLEMENTATIONS = (dispatch.Implementation("pallas", _kernel_unsupported), dispatch.XLA)


def _use_kernel(
    op: str, x, block_shape, dtype, with_transpose: bool, backend: str, row_blocks: bool = False, pow2_scales=False
) -> bool:
    shape, in_dtype, dtype = tuple(x.shape), jnp.dtype(x.dtype), jnp.dtype(dtype)
    call = _QuantizeCall(shape, in_dtype, block_shape, dtype, with_transpose, row_blocks, pow2_scales)
    return dispatch.select(op, backend, IMPLEMENTATIONS, call).is_kernel


def _kernel(x, block: int, dtype, pow2_scales: bool, with_transpose: bool) -> list[BlockScaled]:
    """The sm90 kernel's outputs as BlockScaled: x's, then x^T's with ``with_transpose``."""
    outputs = sm90.quantize_tiles(
        x,
        block=block,
        dtype=dtype,
        pow2_scales=pow2_scales,
        with_transpose=with_transpose,
        config=config.heuristic_config(x.dtype, with_transpose, f"1 x {block}"),
        num_sms=num_sms(),
        interpret=interpret_params(),
    )
    return _block_scaled(outputs, (1, block), pow2_scales)


def _square_kernel(w, dtype, pow2_scales: bool, as_is: bool, transposed: bool) -> list[BlockScaled]:
    """The sm90 square-block kernel's outputs as BlockScaled: w's copy, then w^T's, as asked."""
    outputs = sm90_square.quantize_square_tiles(
        w,
        dtype=dtype,
        pow2_scales=pow2_scales,
        as_is=as_is,
        transposed=transposed,
        config=config.heuristic_config(w.dtype, as_is and transposed, "square"),
        num_sms=num_sms(),
        interpret=interpret_params(),
    )
    return _block_scaled(outputs, (1, config.TILE, config.TILE), pow2_scales)


def _stored_scales(scales: jax.Array, pow2_scales: bool) -> jax.Array:
    """The kernels' scales as BlockScaled holds them: f32, or their exponent bytes viewed as float8_e8m0fnu."""
    return lax.bitcast_convert_type(scales, POW2_SCALE_DTYPE) if pow2_scales else scales


def _block_scaled(outputs, block_shape: tuple[int, ...], pow2_scales: bool) -> list[BlockScaled]:
    """A kernel's (values, scales, values, scales, ...) outputs as one BlockScaled per pair."""
    pairs = zip(outputs[::2], outputs[1::2], strict=True)
    return [BlockScaled(values, _stored_scales(scales, pow2_scales), block_shape) for values, scales in pairs]


def quantize_blockwise(
    x: jax.Array,
    block_shape: tuple[int, ...],
    *,
    dtype=jnp.float8_e4m3fn,
    pow2_scales: bool = False,
    backend: str = "auto",
) -> BlockScaled:
    """Quantizes ``x`` to FP8 with one scale per block of ``block_shape``.

    Per block: ``scale = amax(|block|) / finfo(dtype).max`` in f32 (at least 2**-126; with ``pow2_scales`` rounded up
    to a power of two, so nothing saturates), ``values = round_to_nearest_even(x / scale)`` clipped to
    ``+-finfo(dtype).max``, with ``x / scale`` the f32 product ``x * (1 / scale)``. An all-zero block dequantizes to
    exact zeros; a block holding Inf or NaN dequantizes to non-finite values only. A block that runs past the end of
    an axis covers the elements that exist (moe_jax/ops/quant/reference.py has the arithmetic to the bit).

    Args:
      x: any rank, float dtype. Activations [M, K] take block_shape (1, 128); weights [G, K, N] (1, 128, 128);
        MXFP8 takes 32 along K with ``pow2_scales=True``.
      block_shape: one positive int per axis of x (1: every element alone along that axis).
      dtype: float8_e4m3fn (max 448) or float8_e5m2 (max 57344).
      pow2_scales: power-of-two scales, stored as float8_e8m0fnu; otherwise f32 scales.
      backend: "auto", "xla" or "pallas". The Pallas kernel (an H100/H200's default under "auto") takes
        [M, K] bf16/f16/f32 with block_shape (1, 128) or (1, 32) and K a multiple of 64; "auto" falls back to "xla"
        elsewhere. It also takes weights [G, A, B] bf16/f16/f32 with block_shape (1, 128, 128), A, B multiples
        of 64 and f32 scales (``quantize_square_blocks`` writes their transposed copy in the same pass).

    Returns:
      ``BlockScaled`` with values [x.shape] in ``dtype`` and scales [ceil(x.shape / block_shape)].
    """
    _check_options(x, dtype, pow2_scales)
    block_shape = _check_block_shape(block_shape, x.ndim)
    if _use_kernel("quantize_blockwise", x, block_shape, dtype, False, backend, pow2_scales=pow2_scales):
        if x.ndim == 3:
            return _square_kernel(x, dtype, pow2_scales, as_is=True, transposed=False)[0]
        return _kernel(x, block_shape[1], dtype, pow2_scales, with_transpose=False)[0]
    return reference.quantize_blockwise(x, block_shape, dtype, pow2_scales)


def quantize_blockwise_with_transpose(
    x: jax.Array,
    block_size: int = config.TILE,
    *,
    dtype=jnp.float8_e4m3fn,
    pow2_scales: bool = False,
    backend: str = "auto",
) -> tuple[BlockScaled, BlockScaled]:
    """``quantize_blockwise(x, (1, block_size))`` and ``quantize_blockwise(x.T, (1, block_size))``, from one read of x.

    The weight gradient of ``x @ w`` contracts over M: its FP8 operand is x^T [K, M] quantized along M, which the
    Pallas kernel writes from the same loaded tiles as x's own copy.

    Args:
      x: [M, K] float.
      block_size: the blocks' length along the rows of x and of x^T.
      dtype, pow2_scales, backend: as in ``quantize_blockwise``; the kernel takes block_size 128 or 32 and M, K
        multiples of 64.

    Returns:
      (x quantized: values [M, K], scales [M, ceil(K / block_size)]; x^T quantized: values [K, M], scales
      [K, ceil(M / block_size)]).
    """
    _check_options(x, dtype, pow2_scales)
    checks.check_rank("x", x, 2, "[M, K]")
    checks.check_positive_int("block_size", block_size)
    block_shape = (1, block_size)
    if _use_kernel("quantize_blockwise_with_transpose", x, block_shape, dtype, True, backend):
        return tuple(_kernel(x, block_size, dtype, pow2_scales, with_transpose=True))
    return (
        reference.quantize_blockwise(x, block_shape, dtype, pow2_scales),
        reference.quantize_blockwise(x.T, block_shape, dtype, pow2_scales),
    )


COPIES = ("as_is", "transposed")


def quantize_square_blocks(
    w: jax.Array,
    block_size: int = config.TILE,
    *,
    copies: tuple[str, ...] = COPIES,
    dtype=jnp.float8_e4m3fn,
    pow2_scales: bool = False,
    backend: str = "auto",
) -> tuple[BlockScaled, ...]:
    """``quantize_blockwise(w, (1, b, b))`` and/or the same for ``w.transpose(0, 2, 1)``, from one read of w.

    A b x b block is the same block of w [G, A, B] and of w^T [G, B, A], with one scale: the FP8 grouped matmul reads
    its weights [G, N, K] in the forward and [G, K, N] in the dgrad, and the Pallas kernel writes both copies as it
    reads w once (XLA's path quantizes w, then transposes the FP8 copy).

    Args:
      w: [G, A, B] float.
      block_size: b, the blocks' side.
      copies: which copies to return, in this order: "as_is" ([G, A, B]) and/or "transposed" ([G, B, A]).
      dtype, pow2_scales, backend: as in ``quantize_blockwise``; the kernel takes b = 128, bf16/f16/f32 w and A, B
        multiples of 64.

    Returns:
      One BlockScaled of block_shape (1, b, b) per entry of ``copies``: values [G, A, B] and scales
      [G, ceil(A / b), ceil(B / b)], or values [G, B, A] and scales [G, ceil(B / b), ceil(A / b)].
    """
    _check_options(w, dtype, pow2_scales, "w")
    checks.check_rank("w", w, 3, "[G, A, B]")
    checks.check_positive_int("block_size", block_size)
    if not copies or len(set(copies)) != len(copies) or any(copy not in COPIES for copy in copies):
        raise ValueError(f"copies must name each of {COPIES} at most once (at least one), got {copies!r}")
    block_shape = (1, block_size, block_size)
    if _use_kernel("quantize_square_blocks", w, block_shape, dtype, len(copies) == 2, backend, pow2_scales=pow2_scales):
        made = _square_kernel(w, dtype, pow2_scales, as_is="as_is" in copies, transposed="transposed" in copies)
        return tuple(made) if copies[0] == "as_is" or len(made) == 1 else tuple(reversed(made))
    quantized = reference.quantize_blockwise(w, block_shape, dtype, pow2_scales)
    made = {"as_is": quantized, "transposed": swap_last_axes(quantized)}
    return tuple(made[copy] for copy in copies)


def swap_last_axes(x: BlockScaled) -> BlockScaled:
    """[G, A, B] -> [G, B, A]: values, scales and blocks transposed together."""
    g, a, b = x.block_shape
    return BlockScaled(jnp.swapaxes(x.values, 1, 2), jnp.swapaxes(x.scales, 1, 2), (g, b, a))


def quantize_row_blocks_transposed(
    x: jax.Array,
    first_rows: jax.Array,
    row_counts: jax.Array,
    block_size: int = config.TILE,
    *,
    row_tokens: jax.Array | None = None,
    copy_rows: jax.Array | None = None,
    dtype=jnp.float8_e4m3fn,
    pow2_scales: bool = False,
    backend: str = "auto",
) -> tuple:
    """Blocks of up to ``block_size`` rows of x, each starting on any row, quantized along their rows per column and
    written transposed, each padded with zeros to ``block_size`` rows: the FP8 wgrad's operand layout
    (grouped_matmul/token_blocks.py), from one read of x; with ``copy_rows``, also x's own 1 x 128 copy (the FP8
    GEMMs' lhs) from the same read.

    Args:
      x: [M, C] float; or with ``row_tokens``, [T, C] tokens whose rows the blocks gather.
      first_rows: [B] int32, block b's first row (in [0, M); any row for an empty block).
      row_counts: [B] int32 in [0, block_size], its rows (rows past M count as zeros).
      block_size: the blocks' rows.
      row_tokens: optional [M] int32 in [0, T): row r of the blocks is ``x[row_tokens[r]]``, gathered as the rows
        are read (e.g. a routing's ``sort_indices // top_k``: the expert-sorted copies of the tokens, never written).
      copy_rows: optional [B] int32 in [0, block_size], not with ``row_tokens``: block b also writes rows
        [first_rows[b], first_rows[b] + copy_rows[b]) of x's 1 x 128 copy. The windows must not overlap; a row in
        none of them is unspecified in that copy (the kernel does not write it).
      dtype, pow2_scales, backend: as in ``quantize_blockwise``; the kernel takes block_size 128, bf16/f16 x and C
        a multiple of 64.

    Returns:
      (values_t [C, block_size * B]: block b's rows in columns [block_size * b, block_size * b + row_counts[b]),
      zeros after; scales [B, C]: block b's scale of column c at [b, c], f32 or float8_e8m0fnu); with ``copy_rows``
      also x's ``BlockScaled`` in 1 x 128 blocks, as ``quantize_blockwise(x, (1, 128))`` gives it in the windows.
    """
    _check_options(x, dtype, pow2_scales)
    checks.check_rank("x", x, 2, "[M, C]")
    checks.check_positive_int("block_size", block_size)
    for name, table in (("first_rows", first_rows), ("row_counts", row_counts)):
        checks.check_rank(name, table, 1, "[B]")
        checks.check_int32(name, table)
    checks.check_dim("row_counts", row_counts.shape[0], first_rows.shape[0], "length (B, first_rows.shape[0])")
    if row_tokens is not None:
        checks.check_rank("row_tokens", row_tokens, 1, "[M]")
        checks.check_int32("row_tokens", row_tokens)
    if copy_rows is not None:
        if row_tokens is not None:
            raise ValueError("copy_rows writes x's own rows: pass it without row_tokens")
        checks.check_rank("copy_rows", copy_rows, 1, "[B]")
        checks.check_int32("copy_rows", copy_rows)
        checks.check_dim("copy_rows", copy_rows.shape[0], first_rows.shape[0], "length (B, first_rows.shape[0])")
    if _use_kernel("quantize_row_blocks_transposed", x, (block_size, 1), dtype, True, backend, row_blocks=True):
        values_t, scales, *row_copy = sm90_row_blocks.quantize_row_blocks_transposed(
            x,
            first_rows,
            row_counts,
            row_tokens=row_tokens,
            copy_rows=copy_rows,
            dtype=dtype,
            pow2_scales=pow2_scales,
            config=config.heuristic_config(
                x.dtype, copy_rows is not None, "row blocks" if row_tokens is None else "gathered row blocks"
            ),
            num_sms=num_sms(),
            interpret=interpret_params(),
        )
        return values_t, _stored_scales(scales, pow2_scales), *_block_scaled(row_copy, (1, config.TILE), pow2_scales)
    blocks = reference.quantize_row_blocks_transposed(
        x, first_rows, row_counts, block_size, dtype, pow2_scales, row_tokens
    )
    if copy_rows is None:
        return blocks
    return *blocks, reference.quantize_blockwise(x, (1, config.TILE), dtype, pow2_scales)
