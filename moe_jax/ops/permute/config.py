"""Block shapes of the sm90 row-movement kernels (sm90.py): the frozen Config and its heuristic.

Both kernels move whole rows of width D between token order [T, D] and expert order [M = T * k, D]. One Pallas
thread (a warpgroup, 128 lanes) holds a row chunk of ``128 * vec_size`` columns in registers, ``vec_size`` contiguous
elements per lane, so every global access is ``vec_size * itemsize`` bytes wide per lane and one warp's access covers
whole 128-byte lines.

Where the chunk does not divide D (gpt-oss's D = 2880 is no multiple of 128), the last chunk ends at column D and
overlaps the one before: the overlap is loaded and stored twice with the same values, and the combine's weight
gradient counts it once (sm90.py).
"""

import dataclasses

import jax.numpy as jnp

LANES = 128  # one Pallas thread of Mosaic GPU is a warpgroup
ACCESS_BYTES = 16  # the widest global load / store of one lane
# Row chunks one CTA keeps in flight (the scatter kernel loads every chunk of its tokens before the first store):
# 16 chunks of 16 bytes per lane are 64 registers, which leaves room for several CTAs per SM.
MAX_CHUNKS_IN_FLIGHT = 16
MAX_TOKENS_PER_BLOCK = 8


@dataclasses.dataclass(frozen=True)
class Config:
    """How one launch walks the rows.

    Attributes:
      vec_size: elements one lane moves per access (a power of two); a register chunk spans ``128 * vec_size``
        columns, at most D (``chunk_starts``: where it does not divide D the last chunk overlaps the one before).
      tokens_per_block: tokens one CTA handles; the grid is ``ceil(T / tokens_per_block)``.
    """

    vec_size: int
    tokens_per_block: int

    def __post_init__(self):
        if self.vec_size < 1 or self.vec_size & (self.vec_size - 1) or self.vec_size > 16:
            raise ValueError(f"vec_size must be a power of two in [1, 16], got {self.vec_size}")
        if not 1 <= self.tokens_per_block <= MAX_TOKENS_PER_BLOCK:
            raise ValueError(f"tokens_per_block must be in [1, {MAX_TOKENS_PER_BLOCK}], got {self.tokens_per_block}")

    @property
    def chunk(self) -> int:
        """Columns of one register chunk."""
        return LANES * self.vec_size

    def chunk_starts(self, d_model: int) -> tuple[int, ...]:
        """The first column of each chunk of a row of width D: every ``chunk`` columns, the last one at D - chunk."""
        if d_model < self.chunk or d_model % self.vec_size:
            raise ValueError(
                f"D={d_model} must be at least the chunk width 128 * vec_size = {self.chunk} and a multiple of "
                f"vec_size={self.vec_size} (so that every access stays aligned)"
            )
        return tuple(min(c * self.chunk, d_model - self.chunk) for c in range(-(-d_model // self.chunk)))


DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The widest access is kept while its chunks move at most this much more than D (the overlap of the last chunk).
MAX_OVERLAP = 1 / 8


def supports(d_model: int, dtype) -> bool:
    """Whether the kernels handle rows of width ``d_model`` (at least the 128 lanes of a warpgroup) and dtype."""
    return d_model >= LANES and jnp.dtype(dtype) in map(jnp.dtype, DTYPES)


KERNELS = ("scatter_rows", "gather_rows")


def heuristic_config(d_model: int, dtype, kernel: str) -> Config:
    """The widest access whose chunks overlap by at most MAX_OVERLAP of D (one element per lane if none does), and
    the kernel's tokens per CTA.

    scatter_rows loads every chunk of its tokens before the first store, so it takes as many tokens as keep
    MAX_CHUNKS_IN_FLIGHT chunks in flight. gather_rows keeps a token's k rows in flight and handles its tokens one
    after the other, so one token per CTA: more only makes fewer CTAs (0.4-4% slower on an H100 at the qwen3,
    deepseek-v3 and gpt-oss shapes).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if not supports(d_model, dtype):
        raise ValueError(f"rows of width D={d_model} and dtype {jnp.dtype(dtype).name} have no kernel config")
    vec_size = ACCESS_BYTES // jnp.dtype(dtype).itemsize
    while vec_size > 1 and not _fits(d_model, vec_size):
        vec_size //= 2
    if kernel == "gather_rows":
        return Config(vec_size=vec_size, tokens_per_block=1)
    num_chunks = -(-d_model // (LANES * vec_size))
    tokens = max(1, min(MAX_TOKENS_PER_BLOCK, MAX_CHUNKS_IN_FLIGHT // num_chunks))
    return Config(vec_size=vec_size, tokens_per_block=tokens)


def _fits(d_model: int, vec_size: int) -> bool:
    """Whether chunks of ``128 * vec_size`` columns tile D aligned, with at most MAX_OVERLAP of it moved twice."""
    chunk = LANES * vec_size
    moved = -(-d_model // chunk) * chunk
    return d_model % vec_size == 0 and chunk <= d_model and moved - d_model <= MAX_OVERLAP * d_model
