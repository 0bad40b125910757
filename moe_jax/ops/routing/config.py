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
# Where "auto" takes the kernel: route (kernel + XLA's end of the counting sort) against XLA's route, device time at
# T = 16384 on an H100 with the looped kernel (bd631fd): 4.8x at E = 160 (k 6), 3.4x at E = 256 (softmax, k 8), 2.4x
# at E = 384 (k 8, three chunks), 2.0x / 1.8x at E = 512 with k = 8 / 10, 0.70x at E = 512 with k = 16; with the
# chunks' candidates selected by the same looped rounds (2026-11-25): 2.7x at E = 384, 2.2x at E = 512 / k = 10 and
# 1.02x at E = 512 / k = 16 (a tie, left to XLA); docs/kernels/routing.md. Up to MAX_EXPERTS_AUTO_ANY_K experts every
# k that chunks takes the kernel (1.2x at E = 384 before the loops); past it, up to MAX_TOP_K_AUTO_WIDE.
MAX_EXPERTS_AUTO = 512
MAX_EXPERTS_AUTO_ANY_K = 384
MAX_TOP_K_AUTO_WIDE = 10
# Past this many (padded) experts the kernel splits the expert axis into chunks: a [64, 128] f32 tile is 64
# registers per thread, and the tiles of one chunk fit; the whole row of 384 experts spilled 26 KB per thread, and the
# whole row of 256 ran at 255 registers. Kernel alone, T = 16384, H200 (2026-11-26, RESULTS.md), whole row against
# chunks: E 128 softmax k 8 22.8 µs against 27.5 (chunks of 64); E 192 49.8 against 40.0 (64); E 256 softmax 58.2
# against 46.7 (128); E 256 sigmoid, 8 groups / top 4, bias 77.5 against 60.0 (128). That is with the logits in L2:
# the chunks read them again in every pass, and in the routing glue or the layer (logits from HBM) they saved 0-5 µs.
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
    router (E 128) the kernel took 24.8-24.9 µs against 23.4-23.6 and the routing glue (route + permute + combine +
    aux losses) 466.5-467.0 µs against 475.2-476.2 (H100, 2026-11-26). A sigmoid router needs a max and an exp per
    logit more: at deepseek-v3's (E 256 in chunks) the kernel took 101 µs against 80, as long as XLA's two
    reductions (22 µs).
    """
    return score == "softmax"


def supports(num_experts: int) -> bool:
    """Whether the gating kernel takes E = ``num_experts`` (backend "pallas")."""
    return num_experts <= MAX_EXPERTS


def prefers_kernel(num_experts: int, top_k: int, num_groups: int) -> bool:
    """Whether backend "auto" routes with the kernel: where it measured faster than XLA, i.e. up to
    MAX_WHOLE_ROW_EXPERTS (whole row or chunks), and chunks up to MAX_EXPERTS_AUTO_ANY_K experts, or up to
    MAX_EXPERTS_AUTO with k at most MAX_TOP_K_AUTO_WIDE (a whole row of 384 experts was 0.64x XLA's route)."""
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
