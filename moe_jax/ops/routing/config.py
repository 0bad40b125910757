"""Shapes of the sm90 gating kernel (sm90.py): the frozen Config and its heuristic.

One CTA gates ``BLOCK_TOKENS`` = 64 tokens: one warpgroup holds their [64, E] logits in the wgmma register layout
(64 rows is the M of one wgmma, which the in-block prefix sum of the counting sort uses), or [64, C] chunks of them
past CHUNK_PAST_EXPERTS. E is padded to a multiple of 16 so that the expert axis fits the register layout and a
swizzled bf16 shared-memory tile.
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
      chunk_experts: experts whose [64, chunk_experts] tiles the kernel holds at a time. ``padded_experts`` keeps the
        whole row in registers; a narrower chunk (a multiple of the shared-memory swizzle's column tile dividing
        ``padded_experts``) selects each chunk's top k and then the top k of their candidates, reading the logits from
        L2 once per pass.
        None means ``padded_experts``.
    """

    padded_experts: int
    rank_chunk: int
    chunk_experts: int | None = None

    def __post_init__(self):
        if self.padded_experts < EXPERT_ALIGN or self.padded_experts % EXPERT_ALIGN:
            raise ValueError(f"padded_experts must be a positive multiple of {EXPERT_ALIGN}, got {self.padded_experts}")
        if self.rank_chunk % EXPERT_ALIGN or self.rank_chunk > MAX_WGMMA_N or self.padded_experts % self.rank_chunk:
            raise ValueError(
                f"rank_chunk must be a multiple of {EXPERT_ALIGN} in [16, {MAX_WGMMA_N}] dividing "
                f"padded_experts={self.padded_experts}, got {self.rank_chunk}"
            )
        if self.chunk_experts is None:
            object.__setattr__(self, "chunk_experts", self.padded_experts)
        column_tile = self.swizzle // 2
        if (
            self.chunk_experts < 1
            or self.padded_experts % self.chunk_experts
            or (self.chunk_experts < self.padded_experts and self.chunk_experts % column_tile)
        ):
            raise ValueError(
                f"chunk_experts must divide padded_experts={self.padded_experts} and, when smaller, be a multiple of "
                f"{column_tile} (the shared-memory swizzle's column tile), got {self.chunk_experts}"
            )

    @property
    def swizzle(self) -> int:
        """Bytes of the shared-memory swizzle of one bf16 rank_chunk-wide row: the largest of 128, 64, 32 that fits."""
        row_bytes = 2 * self.rank_chunk
        return next(s for s in (128, 64, 32) if row_bytes % s == 0)


# The largest E tested on the device (E = 512, k = 16, chunked); "pallas" takes up to this many experts.
MAX_EXPERTS = 512
# Where "auto" takes the kernel: route (kernel + XLA's end of the counting sort) runs 2-5x faster than XLA's route up
# to E = 384 at every k that chunks, and at E = 512 up to k = MAX_TOP_K_AUTO_WIDE (2.2x at k = 10); at E = 512 and
# k = 16 the two tie, which is left to XLA (T = 16384, H100; docs/kernels/routing.md).
MAX_EXPERTS_AUTO = 512
MAX_EXPERTS_AUTO_ANY_K = 384
MAX_TOP_K_AUTO_WIDE = 10
# Past this many (padded) experts the kernel splits the expert axis into chunks: a [64, 128] f32 tile is 64
# registers per thread, and the tiles of one chunk fit, while a whole row of 256 experts runs at 255 registers and
# one of 384 spills. The kernel alone (T = 16384, H200, logits in L2) runs about 20% faster in chunks at E = 192 / 256
# and 21% slower at E = 128, where the whole row fits.
CHUNK_PAST_EXPERTS = 128
CHUNK_EXPERTS = 128
# backend "auto" takes the kernel up to this many experts whatever k (the whole row where k is too large to chunk).
MAX_WHOLE_ROW_EXPERTS = 256
# Each chunk passes k candidates to the final rounds over all chunks' candidates ([64, chunks * k] keys and ids):
# up to this k (larger k, as k = E, keeps the whole row).
MAX_CHUNKED_TOP_K = 16


def kernel_statistics(score: str) -> bool:
    """Whether the gating kernel also returns the aux losses' statistics (each token's logsumexp, per-block column
    sums of probs); else ``route`` computes them in XLA from the logits and probs, as the reference does.

    Softmax routers take them from the kernel, where logsumexp is the softmax's own max and sum: at qwen3-30b-a3b's
    router (E 128, H100) the kernel runs 6% longer and the routing glue (route + permute + combine + aux losses) 2%
    shorter. A sigmoid router needs a max and an exp per logit more, which costs the kernel (deepseek-v3's, E 256 in
    chunks) as long as XLA's two reductions take.
    """
    return score == "softmax"


def supports(num_experts: int) -> bool:
    """Whether the gating kernel takes E = ``num_experts`` (backend "pallas")."""
    return num_experts <= MAX_EXPERTS


def prefers_kernel(num_experts: int, top_k: int, num_groups: int) -> bool:
    """Whether backend "auto" routes with the kernel: where it runs faster than XLA, i.e. up to
    MAX_WHOLE_ROW_EXPERTS (whole row or chunks), and chunks up to MAX_EXPERTS_AUTO_ANY_K experts, or up to
    MAX_EXPERTS_AUTO with k at most MAX_TOP_K_AUTO_WIDE (a whole row of 384 experts runs 0.64x as fast as XLA's)."""
    config = heuristic_config(num_experts, top_k, num_groups)
    if config.padded_experts <= MAX_WHOLE_ROW_EXPERTS:
        return True
    if config.chunk_experts == config.padded_experts:
        return False
    return num_experts <= MAX_EXPERTS_AUTO_ANY_K or (num_experts <= MAX_EXPERTS_AUTO and top_k <= MAX_TOP_K_AUTO_WIDE)


def heuristic_config(num_experts: int, top_k: int = 1, num_groups: int = 1) -> Config:
    """E padded to 16; the widest wgmma N (at most 256, a multiple of 16) that divides it; and past
    CHUNK_PAST_EXPERTS with k <= MAX_CHUNKED_TOP_K, chunks of 128 or 64 experts holding whole expert groups (else
    the whole row)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    group_width = num_experts // num_groups if num_groups > 1 else 1
    padded = -(-num_experts // EXPERT_ALIGN) * EXPERT_ALIGN
    rank_chunk = next(n for n in range(min(padded, MAX_WGMMA_N), 0, -EXPERT_ALIGN) if padded % n == 0)
    whole = Config(padded_experts=padded, rank_chunk=rank_chunk)
    if padded <= CHUNK_PAST_EXPERTS or top_k > MAX_CHUNKED_TOP_K:
        return whole
    for chunk in (CHUNK_EXPERTS, CHUNK_EXPERTS // 2):
        if padded % chunk == 0 and chunk % group_width == 0 and chunk % (whole.swizzle // 2) == 0:
            return Config(padded_experts=padded, rank_chunk=rank_chunk, chunk_experts=chunk)
    return whole
