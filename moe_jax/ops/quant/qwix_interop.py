"""Conversion between ``BlockScaled`` and qwix's ``QArray``, the JAX ecosystem's quantized-array type (tokamax takes
it; ``qwix.quantize(x, jnp.float8_e4m3fn, tiled_axes={...})`` makes one).

Both hold FP8 values of the array's shape and one scale per block, ``x ~= values * scale``: a symmetric QArray (no
zero point) with FP8 values is a BlockScaled whose block shape is its scale tile shape, and back. qwix requires the
blocks to tile the array exactly; a BlockScaled with a partial last block has no QArray form. The values pass
unchanged and the scales change dtype only where that is exact (qwix keeps them in a float dtype, the "mxfp8"
recipe in float8_e8m0fnu; both hold every power of two a pow2 quantizer makes), so a conversion never changes a
number.

qwix is optional: ``from_qarray`` and ``is_qarray`` read a QArray's fields without importing qwix; ``to_qarray``
imports it.
"""

import jax.numpy as jnp

from moe_jax.ops.quant.reference import FP8_DTYPES, POW2_SCALE_DTYPE, BlockScaled

_QWIX_POW2_QTYPES = ("mxfp8",)  # qwix's string qtypes with e4m3 values and power-of-two scales


def is_qarray(x) -> bool:
    """Whether ``x`` is a qwix ``QArray`` (checked by type name and module, without importing qwix)."""
    return type(x).__name__ == "QArray" and type(x).__module__.split(".")[0] == "qwix"


def from_qarray(qarray, *, name: str = "qarray") -> BlockScaled:
    """A qwix ``QArray`` with FP8 values and no zero point -> the same numbers as a ``BlockScaled``.

    Args:
      qarray: ``qvalue`` [*shape] float8_e4m3fn / float8_e5m2, ``scale`` [*shape / tile] in a float dtype,
        ``zero_point`` None. qtype "mxfp8" (power-of-two scales) gives float8_e8m0fnu scales, the dtype the
        "mxfp8" recipe takes; every other qtype f32 scales.
      name: the argument's name in error messages.

    Returns:
      ``BlockScaled(values=qarray.qvalue, scales, block_shape=shape / scale.shape)``.
    """
    if qarray.zero_point is not None:
        raise ValueError(f"{name} is an asymmetric QArray (it has a zero point); block-scaled FP8 is symmetric")
    values, scale = qarray.qvalue, qarray.scale
    if jnp.dtype(values.dtype) not in map(jnp.dtype, FP8_DTYPES):
        raise TypeError(
            f"{name}.qvalue must be float8_e4m3fn or float8_e5m2 to become a BlockScaled, got {jnp.dtype(values.dtype)}"
        )
    if scale.ndim != values.ndim or any(size % blocks for size, blocks in zip(values.shape, scale.shape, strict=True)):
        raise ValueError(f"{name}.scale of shape {scale.shape} does not tile qvalue of shape {values.shape}")
    block_shape = tuple(size // blocks for size, blocks in zip(values.shape, scale.shape, strict=True))
    pow2 = isinstance(qarray.qtype, str) and qarray.qtype in _QWIX_POW2_QTYPES
    return BlockScaled(values, scale.astype(POW2_SCALE_DTYPE if pow2 else jnp.float32), block_shape)


def to_qarray(block_scaled: BlockScaled, *, scale_dtype=jnp.float32):
    """A ``BlockScaled`` -> a qwix ``QArray`` of the same numbers (``qwix.dequantize`` gives ``.dequantize()``).

    Args:
      block_scaled: values [*shape] FP8 whose blocks tile the shape exactly (qwix has no partial blocks).
      scale_dtype: the QArray's scale dtype, which is also the dtype ``qwix.dequantize`` returns; f32 (default)
        holds every scale exactly.

    Raises:
      ImportError: qwix is not installed (``pip install qwix``).
    """
    try:
        import qwix
    except ImportError as error:
        raise ImportError("to_qarray needs qwix: pip install qwix") from error
    shape, block_shape = block_scaled.shape, block_scaled.block_shape
    if any(size % block for size, block in zip(shape, block_shape, strict=True)):
        raise ValueError(
            f"a QArray needs blocks that tile the array: shape {shape} is not a multiple of block_shape {block_shape}"
        )
    scales = block_scaled.scales.astype(scale_dtype)
    return qwix.QArray(qvalue=block_scaled.values, scale=scales, zero_point=None, qtype=block_scaled.values.dtype)
