"""``moe_jax.quantize_blockwise``: block-scaled FP8 quantization (1 x 128 activations, 128 x 128 weights, MXFP8's
1 x 32 with power-of-two scales), and the activation quantizer's fused transposed copy for weight gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_jax._core import backend as dispatch
from moe_jax._core import checks
from moe_jax._core.hardware import interpret_params, num_sms
from moe_jax.ops.quant import config, reference, sm90
from moe_jax.ops.quant.reference import FP8_DTYPES, POW2_SCALE_DTYPE, BlockScaled

__all__ = ["BlockScaled", "quantize_blockwise", "quantize_blockwise_with_transpose"]


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


def _check_options(x, dtype, pow2_scales) -> None:
    checks.shape_of("x", x)
    checks.check_float("x", x)
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


def _kernel_unsupported(call: _QuantizeCall) -> str | None:
    refusal = config.refusal(call.shape, call.in_dtype, call.block_shape, call.dtype, call.with_transpose)
    return None if refusal is None else f"the Pallas kernel {refusal}"


IMPLEMENTATIONS = (dispatch.Implementation("pallas", _kernel_unsupported), dispatch.XLA)


def _use_kernel(op: str, x, block_shape, dtype, with_transpose: bool, backend: str) -> bool:
    call = _QuantizeCall(tuple(x.shape), jnp.dtype(x.dtype), block_shape, jnp.dtype(dtype), with_transpose)
    return dispatch.select(op, backend, IMPLEMENTATIONS, call).is_kernel


def _kernel(x, block: int, dtype, pow2_scales: bool, with_transpose: bool) -> list[BlockScaled]:
    """The sm90 kernel's outputs as BlockScaled: x's, then x^T's with ``with_transpose``."""
    outputs = sm90.quantize_tiles(
        x,
        block=block,
        dtype=dtype,
        pow2_scales=pow2_scales,
        with_transpose=with_transpose,
        config=config.heuristic_config(x.dtype, with_transpose),
        num_sms=num_sms(),
        interpret=interpret_params(),
    )
    results = []
    for values, scales in zip(outputs[::2], outputs[1::2], strict=True):
        if pow2_scales:
            scales = lax.bitcast_convert_type(scales, POW2_SCALE_DTYPE)
        results.append(BlockScaled(values, scales, (1, block)))
    return results


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
        elsewhere. Weights take the XLA path: they are quantized once per step, against every activation's
        quantization per GEMM, and a 128 x 128 block is the same block of w [G, K, N] and of its K-major copy
        [G, N, K], so ``quantize_blockwise(w.transpose(0, 2, 1), (1, 128, 128))`` gives that copy (its scales are
        the transposed scales of w's).

    Returns:
      ``BlockScaled`` with values [x.shape] in ``dtype`` and scales [ceil(x.shape / block_shape)].
    """
    _check_options(x, dtype, pow2_scales)
    block_shape = _check_block_shape(block_shape, x.ndim)
    if _use_kernel("quantize_blockwise", x, block_shape, dtype, False, backend):
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
