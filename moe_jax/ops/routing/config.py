"""Shapes of the sm90 gating kernel (sm90.py): the frozen Config and its heuristic.

One CTA gates ``BLOCK_TOKENS`` = 64 tokens: one warpgroup holds their [64, E] logits in the wgmma register layout
(64 rows is the M of one wgmma, which the in-block prefix sum of the counting sort uses). E is padded to a multiple of
16 so that the expert axis fits the register layout and a swizzled bf16 shared-memory tile.
"""

import dataclasses

BLOCK_TOKENS = 64
EXPERT_ALIGN = 16  # pad E to this: 8 for the register layout, 16 for a 32-byte swizzle of bf16
MAX_WGMMA_N = 256


@dataclasses.dataclass(frozen=True)
class Config:
    """How the expert axis is laid out.

    Attributes:
      padded_experts: E rounded up to a multiple of 16 (padding experts are never eligible).
      rank_chunk: experts per prefix-sum wgmma (its N): divides ``padded_experts``, a multiple of 16, at most 256.
    """

    padded_experts: int
    rank_chunk: int

    def __post_init__(self):
        if self.padded_experts < EXPERT_ALIGN or self.padded_experts % EXPERT_ALIGN:
            raise ValueError(f"padded_experts must be a positive multiple of {EXPERT_ALIGN}, got {self.padded_experts}")
        if self.rank_chunk % EXPERT_ALIGN or self.rank_chunk > MAX_WGMMA_N or self.padded_experts % self.rank_chunk:
            raise ValueError(
                f"rank_chunk must be a multiple of {EXPERT_ALIGN} in [16, {MAX_WGMMA_N}] dividing "
                f"padded_experts={self.padded_experts}, got {self.rank_chunk}"
            )

    @property
    def swizzle(self) -> int:
        """Bytes of the shared-memory swizzle of one bf16 rank_chunk-wide row: the largest of 128, 64, 32 that fits."""
        row_bytes = 2 * self.rank_chunk
        return next(s for s in (128, 64, 32) if row_bytes % s == 0)


# The largest E tested on the device: the gating kernel keeps [64, E] f32 tiles in registers, so a much wider E
# would spill; "auto" routes such layers through the XLA reference instead.
MAX_EXPERTS = 512


def supports(num_experts: int) -> bool:
    return num_experts <= MAX_EXPERTS


def heuristic_config(num_experts: int) -> Config:
    """E padded to 16, and the widest wgmma N (at most 256, a multiple of 16) that divides it."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    padded = -(-num_experts // EXPERT_ALIGN) * EXPERT_ALIGN
    chunk = next(n for n in range(min(padded, MAX_WGMMA_N), 0, -EXPERT_ALIGN) if padded % n == 0)
    return Config(padded_experts=padded, rank_chunk=chunk)
