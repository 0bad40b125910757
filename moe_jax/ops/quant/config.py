"""Tiles, pipeline depth and reach of the sm90 quantizer kernels (sm90.py, sm90_row_blocks.py, sm90_square.py)."""

import dataclasses

import jax.numpy as jnp

from moe_jax.ops.quant.reference import FP8_DTYPES

TILE = 128  # a tile is [TILE, TILE] of x: TILE / b blocks of x in each of its rows, of x^T in each column
BLOCKS = (32, 128)  # block lengths along a row: 1 x 128 (DeepSeek-V3's activations) and MXFP8's 1 x 32
CONSUMERS = 2  # compute warpgroups; each takes TILE / CONSUMERS rows (and columns, for x^T) of a tile
# Registers per thread: the producer only computes addresses; the consumers share the rest of an SM's 64k
# (512 per thread of one warpgroup), in multiples of 8.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = (512 - PRODUCER_REGISTERS) // CONSUMERS // 8 * 8
MAX_STAGES = 4
SHALLOW_STAGES = 2
PASSES = ("1 x 128", "1 x 32", "square", "row blocks", "gathered row blocks")  # heuristic_config's passes
# The row-block passes' tile order (Config.block_band): the band of 1-32 that runs fastest over the FP8 layers' wgrad
# operands on an H200 (docs/design.md, "FP8").
ROW_BLOCK_BANDS = {"row blocks": 16, "gathered row blocks": 4}
SMEM_BYTES = 227 * 1024  # shared memory of one CTA on sm90
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# A buffer's swizzle is the widest whose columns divide the array's (Mosaic GPU's rule for TMA with a tiled buffer):
# with K (and M, for x^T) multiples of 64 every buffer gets 64 or 128 bytes. Narrower ones (16 FP8 columns: no
# swizzle) failed Mosaic GPU's layout inference.
DIM_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class Config:
    """How one launch buffers its tiles.

    Attributes:
      stages: input tiles in the ring. The consumers release a slot as soon as its tile is in registers, so up to
        ``stages`` loads are in flight while they compute. Each consumer double-buffers its FP8 outputs.
      block_band: the row-block pass's tile order (sm90_row_blocks.py): its CTAs walk ``block_band`` blocks of a
        column tile before the next column tile, so that the tiles in flight together write longer runs of each row
        of the transposed output (1: a block's column tiles one after another).
    """

    stages: int
    block_band: int = 1

    def __post_init__(self):
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be in [2, {MAX_STAGES}], got {self.stages}")
        # A power of two: planar_snake then computes only the branch it takes, never a division by the width of a last
        # band that is empty.
        if self.block_band < 1 or self.block_band & (self.block_band - 1):
            raise ValueError(f"block_band must be a power of two, got {self.block_band}")

    def smem_bytes(self, in_dtype, with_transpose: bool) -> int:
        inputs = self.stages * TILE * TILE * jnp.dtype(in_dtype).itemsize
        outputs = (2 if with_transpose else 1) * 2 * TILE * TILE  # [2 buffers, TILE, TILE] FP8 per copy
        return inputs + outputs


def heuristic_config(in_dtype, with_transpose: bool, pass_name: str) -> Config:
    """The ring of one launch of ``pass_name`` (one of PASSES; ``with_transpose``: it writes two FP8 copies).

    The passes that keep x's layout (1 x 128 blocks of x's rows alone, the weights' 128 x 128 blocks in one or both
    layouts) take SHALLOW_STAGES, the others the deepest ring that fits in shared memory (at most MAX_STAGES): the
    depth each ran fastest at on an H200 at the benchmark shapes (docs/design.md, "FP8").
    """
    if pass_name not in PASSES:
        raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}")
    keeps_layout = pass_name == "square" or (pass_name == "1 x 128" and not with_transpose)
    stages = SHALLOW_STAGES if keeps_layout else MAX_STAGES
    while Config(stages).smem_bytes(in_dtype, with_transpose) > SMEM_BYTES:
        stages -= 1
    return Config(stages, block_band=ROW_BLOCK_BANDS.get(pass_name, 1))


def refusal(
    shape: tuple[int, ...], in_dtype, block_shape: tuple[int, ...], dtype, with_transpose: bool, pow2_scales=False
) -> str | None:
    """Why the kernels cannot quantize an array of ``shape`` and ``in_dtype`` this way; None when they can: [M, K]
    in 1 x b blocks (sm90.py), or [G, A, B] in 1 x TILE x TILE blocks (sm90_square.py)."""
    if len(shape) == 3:
        if pow2_scales:
            # One scale per tile is a scalar in the kernel, and Mosaic GPU does not lower the bit arithmetic of a
            # power-of-two scale on a scalar (sm90); the per-row scales of sm90.py are vectors and do.
            return "takes f32 scales for [G, A, B] arrays, not power-of-two ones"
        return _square_refusal(shape, in_dtype, block_shape, dtype)
    if len(shape) != 2:
        return f"takes [M, K] or [G, A, B] arrays, got rank {len(shape)}"
    if tuple(block_shape) not in [(1, block) for block in BLOCKS]:
        return f"takes block_shape (1, b) with b in {BLOCKS}, got {tuple(block_shape)}"
    dtypes_refusal = _dtypes_refusal(in_dtype, dtype)
    if dtypes_refusal is not None:
        return dtypes_refusal
    rows, cols = shape
    if min(shape) == 0 or cols % DIM_MULTIPLE or (with_transpose and rows % DIM_MULTIPLE):
        axes = "M and K" if with_transpose else "K"
        return f"needs M > 0 and {axes} positive multiples of {DIM_MULTIPLE}, got [M, K] = {list(shape)}"
    return None


def _dtypes_refusal(in_dtype, dtype) -> str | None:
    if jnp.dtype(in_dtype) not in map(jnp.dtype, INPUT_DTYPES):
        return f"takes bfloat16, float16 or float32 inputs, got {jnp.dtype(in_dtype).name}"
    if jnp.dtype(dtype) not in map(jnp.dtype, FP8_DTYPES):
        return f"writes float8_e4m3fn or float8_e5m2, got {jnp.dtype(dtype).name}"
    return None


def _square_refusal(shape: tuple[int, int, int], in_dtype, block_shape: tuple[int, ...], dtype) -> str | None:
    if tuple(block_shape) != (1, TILE, TILE):
        return f"takes [G, A, B] arrays in block_shape (1, {TILE}, {TILE}), got {tuple(block_shape)}"
    dtypes_refusal = _dtypes_refusal(in_dtype, dtype)
    if dtypes_refusal is not None:
        return dtypes_refusal
    if min(shape) == 0 or shape[1] % DIM_MULTIPLE or shape[2] % DIM_MULTIPLE:
        return f"needs G > 0 and A, B positive multiples of {DIM_MULTIPLE}, got [G, A, B] = {list(shape)}"
    return None


def row_blocks_refusal(shape: tuple[int, int], in_dtype, block_rows: int, dtype) -> str | None:
    """Why sm90_row_blocks.py cannot quantize x [M, C] of ``in_dtype`` in blocks of ``block_rows`` rows; None when it
    can."""
    if block_rows != TILE:
        return f"takes blocks of {TILE} rows, got {block_rows}"
    if jnp.dtype(in_dtype).itemsize > 2:
        # Mosaic GPU's layout inference finds no layout for a transposing read of 32-bit rows in one-row tiles.
        return f"takes 16-bit inputs (bfloat16, float16), got {jnp.dtype(in_dtype).name}"
    dtypes_refusal = _dtypes_refusal(in_dtype, dtype)
    if dtypes_refusal is not None:
        return dtypes_refusal
    if min(shape) == 0 or shape[1] % DIM_MULTIPLE:
        return f"needs M > 0 and C a positive multiple of {DIM_MULTIPLE}, got [M, C] = {list(shape)}"
    return None
