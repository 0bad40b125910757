"""Tile configurations of the sm90 grouped-matmul kernels: the frozen Config, a tuned table, a heuristic.

Three kernels share one Config type (sm90.py, sm90_wgrad.py):
  "fwd"        out[M, N]   = lhs[M, K] · rhs[g][K, N]          rows ragged, contraction K (any sm90.Epilogue)
  "dgrad"      dlhs[M, K]  = dout[M, N] · rhs[g][K, N]^T       the fwd kernel with rhs read the other way round
  "glu_dgrad"  the dgrad of a GLU MLP's down projection, rhs [G, F, D]: dout [M, D] · rhs[g]^T with the GLU backward
               in its epilogue (sm90.Epilogue.activation_grad); its output columns are F
  "wgrad"      drhs[g]     = lhs_g^T · dout_g   -> [G, K, N]   contraction over the ragged rows
For fwd/dgrad, (block_m, block_n) tile the output [M, cols] and block_k the contraction; for wgrad, (block_m, block_n)
tile one group's [K, N] output and block_k walks its rows.
"""

import dataclasses
import math
from typing import Literal

from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK

KINDS = ("fwd", "dgrad", "glu_dgrad", "wgrad")
WGMMA_M = 64  # rows of one wgmma instruction: a compute warpgroup owns a multiple of this
SMEM_BYTES = 227 * 1024  # dynamic shared memory one H100/H200 block can have
SMEM_ALIGNMENT = 1024  # where Pallas (jax 0.11.2) starts each shared-memory scratch buffer
# Registers per consumer thread an overlapped epilogue may hold across tiles: with a [64, 256] f32 accumulator (128
# registers) and the addresses, more would spill under the 232-register budget of two consumers.
OVERLAP_REGISTERS = 64
# wgrad walks a group's output tiles in bands of up to WGRAD_BAND_TILES row tiles (the width measured on 2026-11-25:
# TUNED's note), narrower where the band's x blocks would hold more than WGRAD_BAND_BYTES of L2 (a third of an H100's
# 50 MB; the named shapes' bands take 1-8 MB).
WGRAD_BAND_TILES = 16
WGRAD_BAND_BYTES = 16 * 2**20
# Mean rows per group at or below which the heuristic's glu_dgrad runs one CTA per span in group bands (GROUP_BANDS
# below; measured faster at 256: qwen3-30b, gpt-oss-120b), and its fwd / dgrad skip a tail's idle MMAs where a
# group's weights are small (LOCKSTEP_WEIGHT_BYTES). The fwd / dgrad walk group bands at every size.
SMALL_GROUP_ROWS = 256
# Mean rows per group at or below which the heuristic's fwd / dgrad take 64-row tiles with one consumer warpgroup
# (decode-sized batches, where a 128-row tile holds a group's few rows). Measured at 4-64 rows a group
# (heuristic_config's note).
TINY_GROUP_ROWS = 64
# Bytes of one group's 16-bit weights above which the heuristic's glu_dgrad walks group bands whatever the rows per
# group (heuristic_config's note: measured slower below 3.1 MB, faster above 16.6 MB; 8 MB lies between).
GLU_DGRAD_BAND_WEIGHT_BYTES = 8 * 2**20
# Bytes of one group's 16-bit weights above which the fwd / dgrad in group bands of small groups keep their
# warpgroups in lockstep (SMALL_WEIGHT_BANDS' note: without it 0-3.4% faster at 3.1 / 6.3 MB, 1.5-14% slower at 16.6 /
# 33 MB; 8 MB lies between).
LOCKSTEP_WEIGHT_BYTES = 8 * 2**20
# Longest contraction (D) at which the heuristic's glu_dgrad takes 6 pipeline stages rather than 5 (measured: 6
# faster at D = 2048 / 2880, slower at 4096 / 7168).
DEEP_RING_MAX_CONTRACTION = 2880
# Longest contraction (D) at which the heuristic's glu_dgrad in group bands keeps 128 x 128 tiles; past it it takes
# 128 x 256 ones with 4 stages (GLU_DGRAD_WIDE_RING's shape). Measured with group bands (H100, row scale, swiglu): at
# D = 7168 the wide tiles ran faster (dsv3-ep8 down 1747 -> 1601 us; the deepseek-v3 layer's shape 7277 -> 7089 us),
# at D = 4096 alike (mixtral down 3419 / 3429 us), at D = 2048 / 2880 21-32% slower.
WIDE_RING_MAX_CONTRACTION = 4096


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile shape and pipeline of one kernel launch.

    Attributes:
      block_m: output rows of a CTA tile, split evenly over the compute warpgroups (each owns a multiple of 64 rows).
      block_n: output columns of a CTA tile (one wgmma N: a multiple of 64, at most 256).
      block_k: contraction step of the pipeline (64 or 128).
      num_stages: shared-memory buffers of the TMA -> wgmma pipeline.
      num_compute_wgs: consumer warpgroups; one more producer warpgroup issues every TMA load.
      epilogue_n: columns written back per TMA store (the epilogue buffer is double-buffered per warpgroup); a
        multiple of 64.
      grid_minor: which output-tile axis varies fastest over the persistent grid ("m" or "n"); for wgrad, over
        one group's [K, N] output tiles. fwd / dgrad / glu_dgrad also take "g": row tiles fastest, in bands that
        never mix two groups (schedule.row_tile_bands: a group's row tiles split evenly into bands of at most
        grid_width).
      grid_width: tiles along the minor axis before the major one advances (a band that stays in L2).
      overlap_epilogue: a consumer keeps its tile's outputs in registers and stores them while the tensor cores run
        the first steps of its next tile, instead of between the two tiles. Applies where the kept outputs fit in
        OVERLAP_REGISTERS registers per thread (so not to f32 outputs of 256-column tiles, nor to a forward that
        also keeps its accumulator next to a GLU); elsewhere the epilogue runs between the tiles.
      lockstep_tails: fwd / dgrad / glu_dgrad: every compute warpgroup of a tile issues its MMAs, also one none of
        whose rows is stored (in a group's tail tile of at most 64 rows). Skipping them makes such a tile shorter
        than the others, and the persistent CTAs drift apart: the CTAs that share a weight tile then no longer read
        it from L2 together but each from HBM. wgrad ignores it (its tiles have no per-warpgroup rows).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    num_compute_wgs: int = 2
    epilogue_n: int = 64
    grid_minor: Literal["m", "n", "g"] = "n"
    grid_width: int = 8
    overlap_epilogue: bool = False
    lockstep_tails: bool = False

    def __post_init__(self):
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
        if self.block_m % (WGMMA_M * self.num_compute_wgs) or self.wg_block_m > 2 * WGMMA_M:
            raise ValueError(
                f"block_m must be 64 or 128 rows per compute warpgroup ({self.num_compute_wgs}), got {self.block_m}"
            )
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n must be a multiple of 64 in [64, 256], got {self.block_n}")
        if self.block_k not in (64, 128):
            raise ValueError(f"block_k must be 64 or 128 (one or two 128-byte swizzle widths), got {self.block_k}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be at least 2 (load one buffer while computing on another), got {self}")
        # Narrower chunks (a 32- or 64-byte swizzle of bf16 rows) lower, and pass under the interpreter, but the H200
        # faults on them with CUDA_ERROR_MISALIGNED_ADDRESS (jax 0.11.2; epilogue_n 16 and 32, block_m 128 and 256).
        if self.epilogue_n % 64 or self.block_n % self.epilogue_n:
            raise ValueError(f"epilogue_n must be a multiple of 64 dividing block_n={self.block_n}, got {self}")
        if self.grid_minor not in ("m", "n", "g"):
            raise ValueError(f"grid_minor must be 'm', 'n' or 'g', got {self.grid_minor!r}")
        if self.grid_width < 1:
            raise ValueError(f"grid_width must be >= 1, got {self.grid_width}")

    @property
    def wg_block_m(self) -> int:
        """Rows of the tile owned by one compute warpgroup."""
        return self.block_m // self.num_compute_wgs

    def smem_bytes(
        self,
        in_itemsize: int,
        out_itemsize: int,
        *,
        operand_cols: int = 0,
        row_vectors: int = 0,
    ) -> int:
        """Shared memory of one CTA: the pipeline's stages, the epilogue's double buffer and its operands.

        Args:
          in_itemsize, out_itemsize: bytes per input / output element.
          operand_cols: columns of the [wg_block_m, operand_cols] input-dtype tile each consumer's epilogue loads
            itself (the GLU backward's packed gate/up rows, 2 * block_n, where the ring does not carry them).
          row_vectors: [wg_block_m] f32 vectors per consumer (row_scale in, partial sums out), in one buffer.
        """
        buffers = [
            self.num_stages * self.block_m * self.block_k * in_itemsize,  # x ring
            self.num_stages * self.block_n * self.block_k * in_itemsize,  # w ring
            2 * self.block_m * self.epilogue_n * out_itemsize,
            self.block_m * operand_cols * in_itemsize,
            row_vectors * self.block_m * 4,
        ]
        # Pallas starts every scratch buffer at a SMEM_ALIGNMENT boundary.
        return sum(-(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for size in buffers)

    def fits(self, in_itemsize: int = 2, out_itemsize: int = 2, **epilogue) -> bool:
        """Whether the CTA's shared memory fits (``epilogue``: smem_bytes's operand_cols / row_vectors)."""
        # Leave room for the barriers and the compiler's own scratch.
        return self.smem_bytes(in_itemsize, out_itemsize, **epilogue) <= SMEM_BYTES - 2048


# Key: (kind, G, M, K, N) of the *op* (K, N as in rhs [G, K, N]); the value is the fastest config measured, listing
# only the fields that differ from Config()'s defaults. Measured on an H200 (uniform routing; the median of 4
# interleaved rounds, candidates within ~5% of each other are within a run's noise) by
#   python -m benchmarks.tune_grouped_matmul tune --kinds fwd,dgrad,glu_dgrad --jobs 14 --iters 10 --rounds 4
# on 2026-11-22 at git 9bf2357 (the sweep with 2-CTA clusters: benchmarks/results/2026-11-22_h200_9bf2357_tune.md),
# except the wgrad entries, from the earlier sweep with --kinds fwd,dgrad,wgrad at git 3ca740a (no clusters;
# benchmarks/results/2026-11-22_h200_3ca740a_tune.md) plus the overlapped epilogue, which was faster at all 8 shapes
# (time --configs table,table-c,table+o: benchmarks/results/2026-11-22_h200_overlap_ab.md) and won the wgrad sweep
# with it at 7 of 8 (tune --kinds wgrad at git 0363df0: ..._0363df0_tune_wgrad.md; the 8th, mixtral gate_up, a tie).
# The dsv3-ep8/down forward entry is from a re-sweep with the overlapped epilogue among the candidates (tune --kinds
# fwd --rounds 4 at git be4f7b3, 2026-11-22, confirmed by `time --rounds 8`: 1.62-1.67 ms against 1.72-1.76 for the
# 128x128 clustered config it replaced; benchmarks/results/2026-11-22_h200_be4f7b3_tune_fwd.md). The forward entries
# of qwen3 (both), gpt-oss (both) and mixtral gate_up add the overlapped epilogue to the config they had: faster at
# all five in two calls with the order of the pair swapped (1-9%; `time --configs table,table+oc` at git 7050f30 with
# clusters + overlap admitted: benchmarks/results/2026-11-22_h200_7050f30_overlap_clusters.md).
# The wgrad entries walk each group's output tiles in bands of 16 row tiles (grid_minor "m"), since 2026-11-25:
# against the whole-row order they had before (which the wgrad kernel then hard-coded), on an H100, mixtral gate_up
# 9.21 -> 5.96 ms, dsv3-ep8 down 1.67 -> 1.50, the other six within -4% .. +5% (3 interleaved rounds, outputs
# bit-identical; 2-CTA clusters no faster at any of the 8: benchmarks/results/2026-11-25_h100_wgrad_order.md).
# The fused GLU forward uses the "fwd" entry of its gate_up shape; glu_dgrad is keyed by the "<model>/down" shape.
# The five unclustered entries of dsv3-ep8 / mixtral (fwd of both down shapes, dsv3-ep8 gate_up's dgrad, both
# glu_dgrad) add lockstep_tails since 2026-11-26 (sixth session): a group's tail tile of <= 64 rows then runs as long
# as a full one and the CTAs sharing a weight tile stay in step. On an H100 (`time --configs
# table,table/lockstep_tails=True --rounds 8`; benchmarks/RESULTS.md) dsv3-ep8/down fwd 1.648 -> 1.504 ms,
# mixtral/down fwd 3.228 -> 3.098, dsv3-ep8/gate_up dgrad 3.366 -> 3.141, glu_dgrad 2.378 -> 2.320 and 5.005 ->
# 4.888; ncu at dsv3-ep8/down counted 2.47 -> 2.00 GB read from HBM. Clustered entries gained nothing (their pairs
# already run in step), nor did qwen3's / gpt-oss's memory-bound ones, which keep skipping the idle MMAs.
# In step, the CTAs re-read a weight tile from HBM only where a band of the "m" / "n" orders cuts a group in two; the
# fwd / dgrad entries among the five walk bands by group (grid_minor "g", up to 16 spans; the glu_dgrad ones were not
# measured with it) since the same session: device time (CUPTI, 4 alternated rounds of 15 calls, H100) mixtral/down
# fwd 2677 -> 2592 us, dsv3-ep8/down fwd 1323 -> 1292, dsv3-ep8/gate_up dgrad 2698 -> 2669; ncu's HBM reads at
# dsv3-ep8/down 2.01 -> 1.15 GB and at mixtral/down 5.47 -> 2.60 GB. (Without lockstep_tails the group bands read as
# much as before: why an earlier try of group-aligned bands, 2026-11-25, found no gain.)
# benchmarks/results/2026-11-26_h100_lockstep_bands.md has the measurements.
WGRAD_BANDS = Config(grid_minor="m", grid_width=WGRAD_BAND_TILES, overlap_epilogue=True)
# At the qwen3-30b / gpt-oss shapes (128 groups of ~256 rows: 2-3 row tiles each) the fwd / dgrad / glu_dgrad
# entries walk group bands in lockstep with one CTA per span (GROUP_BANDS) since 2026-11-26 (seventh session). There
# the clustered m8 / n-order entries read 15-26% more than the ideal bytes from HBM (ncu, fwd: gpt-oss gate_up 5.57
# -> 4.61 GB, down 2.82 -> 2.36, qwen3 gate_up 1.08 -> 0.96): a group with an odd number of tiles makes every
# following pair straddle two groups, and a straddling span's band is its first tile's group, so the second group's
# weights are read in two bands. (qwen3 down's fwd entry was unclustered n8, with the drift of lockstep_tails.)
# Device time (CUPTI, 4 alternated rounds of 15 calls, H100, outputs bit-identical): fwd qwen3 gate_up 444 -> 404
# us, qwen3 down 231 -> 215, gpt-oss gate_up 2128 -> 1941, gpt-oss down 1113 -> 1010; dgrad 440 -> 417, 241 -> 228,
# 2309 -> 2055, 1153 -> 1048; glu_dgrad 387 -> 380, 1794 -> 1769; on an H200, fwd 1.4-2.1% only
# (benchmarks/results/2026-11-26_h100_small_groups.md).
# The dsv3-ep8 / mixtral fwd and dgrad entries (8-32 groups of 1024-2048 rows) take the same config since the eighth
# session (same day), in place of 2-CTA clusters or group bands without the overlapped epilogue. Device time (CUPTI,
# 4 alternated rounds of 15 calls, H100, outputs bit-identical): fwd dsv3-ep8 gate_up 2752 -> 2621 us, mixtral down
# 2602 -> 2563, mixtral gate_up 5604 -> 5342 (its rounds spread by 6%), dsv3-ep8 down unchanged (it had it); dgrad
# dsv3-ep8 gate_up 2725 -> 2638, dsv3-ep8 down 1338 -> 1320, mixtral down 2635 -> 2531, mixtral gate_up 5634 ->
# 5457. Of their glu_dgrad entries only mixtral down's walked group bands then (4617 -> 4560 us; dsv3-ep8 down's ran
# 2.2% slower so; all four do since GLU_DGRAD_RING below). Not measured on an H200
# (benchmarks/results/2026-11-26_h100_group_bands.md).
GROUP_BANDS = Config(grid_minor="g", grid_width=16, overlap_epilogue=True, lockstep_tails=True)
# The qwen3-30b fwd / dgrad entries (3.1 / 6.3 MB of weights a group, shared by 2-3 row tiles) skip a tail tile's
# idle MMAs since the fifteenth session (2026-11-27): device time (CUPTI, H100, 3-4 alternated rounds of 10 calls,
# two calls with the order swapped, routings u0 / u1; outputs bit-identical) gate_up fwd 403.4 -> 397.4 and 383.4 ->
# 378.4 us, gate_up dgrad 418.8 -> 404.4 and 401.6 -> 393.4, down fwd 214.2 -> 210.8 and 208.9 -> 206.4, down dgrad
# 225.9 -> 225.6 and 229.7 -> 228.3. At gpt-oss-120b (16.6 / 33 MB a group) the lockstep keeps the CTAs sharing a
# weight tile in step, and dropping it cost 1.5-14% (fwd gate_up 1926 -> 2002, down 1004 -> 1142 us; dgrad 2073 ->
# 2248, 1045 -> 1061). (benchmarks/RESULTS.md, fifteenth session.)
SMALL_WEIGHT_BANDS = dataclasses.replace(GROUP_BANDS, lockstep_tails=False)
# The glu_dgrad entries take 128 x 128 tiles whose packed gate/up rows ride the pipeline's ring (gate_up_ring_slots)
# since 2026-11-27 (tenth session). Before, each consumer loaded them into a buffer of its own, and that buffer left
# room for 64-column tiles with 6 stages (qwen3-30b, gpt-oss-120b) or 128-column ones with 3 (dsv3-ep8, mixtral).
# At gpt-oss down the plain dgrad of those 64-column tiles took 1735 us against 1046 us with the table's 128 x 256
# tiles, and the whole glu_dgrad 1795: the narrow MMAs, not the epilogue, cost the time. Device time (CUPTI, 3
# alternated rounds of 10 calls, H100, swiglu with row_scale; d_gate_up and h bit-identical, the row-scale gradient
# within 4e-4 (its partial sums per tile change with the width)): qwen3-30b down 400 -> 341 us, gpt-oss-120b down
# 1806 -> 1466, dsv3-ep8 down 2176 -> 1769, mixtral down 4613 -> 3441. Of the ring configs 5 stages ran faster than
# 4 (by 5-9%, 0.2% at dsv3-ep8), group bands faster than "n" / "m" bands (by 1-22%), and an overlapped epilogue
# slower (by 8-28%). (benchmarks/RESULTS.md, 2026-11-27, tenth session.) Mixtral down keeps 5 stages; gpt_oss's
# backward narrowed from the wide tiles below (CLAMPED_BLOCK_N) takes them too.
GLU_DGRAD_RING = dataclasses.replace(GROUP_BANDS, block_n=128, num_stages=5, overlap_epilogue=False)
# Since the thirteenth session (2026-11-27) a row scale's two vectors share one shared-memory buffer and the kernel
# reserves no reduction scratch (sm90.py), which frees 3 KB: 6 stages of 128 x 128 tiles fit next to a row scale.
# They run faster at the short contractions of qwen3-30b / gpt-oss-120b down (D = 2048 / 2880), for every
# activation, outputs bit-identical: swiglu 340 -> 328 / 1460 -> 1401 us, gpt_oss 390 -> 372 / 1664 -> 1614, geglu
# 357 -> 345 / 1546 -> 1507; slower at dsv3-ep8 / mixtral down (swiglu 1747 -> 1783 / 3419 -> 3594 us; gpt_oss and
# geglu 0.1-2%). (Device time, CUPTI, 3 alternated rounds of 10 calls, H100, row scale; benchmarks/RESULTS.md,
# thirteenth session.)
GLU_DGRAD_DEEP_RING = dataclasses.replace(GLU_DGRAD_RING, num_stages=6)
# At dsv3-ep8 down (D = 7168: a long contraction) 128 x 256 tiles run faster, the up block in the first half of a slot's
# weight buffer, with the 3 stages that then fitted next to a row scale: 1745 -> 1620 us, outputs bit-identical but the
# row-scale gradient (within 3e-4). Elsewhere they did not pay: tied at mixtral down (3487 / 3455 us), 21% / 32% slower
# at qwen3-30b / gpt-oss-120b down (D = 2048 / 2880; the plain dgrad there runs 5% / 15% slower with 3 stages than with
# 4). Without a row scale 4 stages beat the 128 x 128 ring by 16% at dsv3-ep8 and 10% at mixtral. (Device time, CUPTI, 3
# alternated rounds of 10 calls, H100, swiglu; benchmarks/RESULTS.md, 2026-11-27, eleventh session.) 4 stages fit next
# to a row scale since the thirteenth session (GLU_DGRAD_DEEP_RING's note): at dsv3-ep8 down swiglu 1630 -> 1601 us,
# geglu 1779 -> 1725 (the 128 x 128 ring: 1747 / 1773); at mixtral down swiglu 3429 against the 5-stage ring's 3419 (a
# tie, which keeps the ring).
GLU_DGRAD_WIDE_RING = dataclasses.replace(GLU_DGRAD_RING, block_n=256, num_stages=4)
TUNED: dict[tuple[str, int, int, int, int], Config] = {
    ("fwd", 128, 32768, 2048, 1536): SMALL_WEIGHT_BANDS,
    ("dgrad", 128, 32768, 2048, 1536): SMALL_WEIGHT_BANDS,
    ("wgrad", 128, 32768, 2048, 1536): WGRAD_BANDS,
    ("fwd", 128, 32768, 768, 2048): SMALL_WEIGHT_BANDS,
    ("dgrad", 128, 32768, 768, 2048): SMALL_WEIGHT_BANDS,
    ("glu_dgrad", 128, 32768, 768, 2048): GLU_DGRAD_DEEP_RING,
    ("wgrad", 128, 32768, 768, 2048): WGRAD_BANDS,
    ("fwd", 128, 32768, 2880, 5760): GROUP_BANDS,
    ("dgrad", 128, 32768, 2880, 5760): GROUP_BANDS,
    ("wgrad", 128, 32768, 2880, 5760): WGRAD_BANDS,
    ("fwd", 128, 32768, 2880, 2880): GROUP_BANDS,
    ("dgrad", 128, 32768, 2880, 2880): GROUP_BANDS,
    ("glu_dgrad", 128, 32768, 2880, 2880): GLU_DGRAD_DEEP_RING,
    ("wgrad", 128, 32768, 2880, 2880): WGRAD_BANDS,
    ("fwd", 32, 32768, 7168, 4096): GROUP_BANDS,
    ("dgrad", 32, 32768, 7168, 4096): GROUP_BANDS,
    ("wgrad", 32, 32768, 7168, 4096): WGRAD_BANDS,
    ("fwd", 32, 32768, 2048, 7168): GROUP_BANDS,
    ("dgrad", 32, 32768, 2048, 7168): GROUP_BANDS,
    ("glu_dgrad", 32, 32768, 2048, 7168): GLU_DGRAD_WIDE_RING,
    ("wgrad", 32, 32768, 2048, 7168): WGRAD_BANDS,
    ("fwd", 8, 16384, 4096, 28672): GROUP_BANDS,
    ("dgrad", 8, 16384, 4096, 28672): GROUP_BANDS,
    ("wgrad", 8, 16384, 4096, 28672): WGRAD_BANDS,
    ("fwd", 8, 16384, 14336, 4096): GROUP_BANDS,
    ("dgrad", 8, 16384, 14336, 4096): GROUP_BANDS,
    ("glu_dgrad", 8, 16384, 14336, 4096): GLU_DGRAD_RING,
    ("wgrad", 8, 16384, 14336, 4096): WGRAD_BANDS,
}


# gpt_oss's GLU backward is at most CLAMPED_BLOCK_N columns wide. On 256-column tiles (GLU_DGRAD_WIDE_RING) it ran
# slower whether its epilogue computes h, d_gate and d_up together (spilling registers) or one per store
# (sm90.Epilogue.recompute_grads): at dsv3-ep8 down 2500 / 2590 us against 1843 with the 128 x 128 ring and the
# outputs recomputed (CUPTI device time, H100, row scale; benchmarks/RESULTS.md, 2026-11-27, twelfth session). Its
# forward takes the table's tiles since each stored value is computed in its store's branch (sm90.py, _epilogue's
# prepare): the keeping forward no longer spills at 256 columns (500 bytes before), and ran 10% / 14% faster than the
# 128-column tiles it used to take at qwen3-30b / gpt-oss-120b gate_up (490 / 544 us, 2227 / 2598 us), tied at
# dsv3-ep8.
CLAMPED_BLOCK_N = 128


def gate_up_ring_slots(config: Config) -> int:
    """Pipeline slots that carry one glu_dgrad tile's packed gate/up rows, or 0 where they take a buffer of their own.

    The producer can load them into the ring of operand buffers, after the tile's last contraction step, one epilogue
    chunk's gate and up blocks per slot: the gate block [block_m, block_k] in the x buffer, the up block in the first
    block_m rows of the weights' [block_n, block_k] (read transposed), so block_n is block_m or twice it and block_k
    == PACK_BLOCK. That frees the [block_m, 2 * block_n] buffer the consumers would otherwise load them into, for
    deeper pipelines or wider tiles (sm90.py, "GLU backward"). An overlapped epilogue reads a tile's slots after the
    next tile's first steps, so the ring must then keep a slot for those.
    """
    slots = config.block_n // PACK_BLOCK
    shape = config.block_n in (config.block_m, 2 * config.block_m) and config.block_k == PACK_BLOCK
    depth = config.num_stages > slots or not config.overlap_epilogue
    return slots if shape and depth else 0


def row_vector_count(row_scale: bool, glu_backward: bool) -> int:
    """[wg_block_m] f32 shared-memory vectors per consumer: the row scale in and, in the GLU backward, the row-scale
    gradient's partial sums out (sm90.py keeps them in one buffer)."""
    return int(row_scale) * (2 if glu_backward else 1)


def epilogue_smem(kind: str, config: Config, row_scale: bool) -> dict:
    """smem_bytes's epilogue operands of a kernel kind (``row_scale``: the epilogue scales rows)."""
    glu_backward = kind == "glu_dgrad"
    operand_cols = 2 * config.block_n if glu_backward and not gate_up_ring_slots(config) else 0
    return dict(operand_cols=operand_cols, row_vectors=row_vector_count(row_scale, glu_backward))


def heuristic_config(
    kind: str, *, m: int, k: int, n: int, g: int, out_itemsize: int = 2, row_scale: bool = False
) -> Config:
    """A good config for shapes not in the table.

    Args:
      kind: "fwd", "dgrad", "glu_dgrad" or "wgrad".
      m, k, n, g: the op's rows, contraction, columns and groups (rhs is [G, K, N]).
      out_itemsize: bytes per output element (the epilogue buffer grows with it).
      row_scale: the epilogue scales rows (a row_scale vector per consumer; two for glu_dgrad).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out_cols = k if kind in ("dgrad", "glu_dgrad") else n
    if kind == "wgrad":
        # Output tiles are [K, N] blocks of one group; the contraction (rows of a group) is short when G is large.
        rows_per_group = max(m // max(g, 1), 1)
        stages = 4 if rows_per_group >= 256 else 3
        # Its tiles are short (a group's rows), so storing one while the next one's first steps run pays: 8-17% at
        # every named shape (docs/kernels/grouped_matmul.md, "Overlapped epilogue"). A group's tiles go in bands of
        # row tiles (K blocks) over each column tile: the band's x blocks stay in L2 while y streams past once per
        # band (mixtral gate_up's wgrad 1.55x faster than in whole rows: TUNED's note).
        block_m = 128
        band_bytes = rows_per_group * block_m * 2  # one x block [rows, block_m] of 16-bit elements
        config = Config(
            block_m=block_m,
            block_n=256 if n >= 256 else 128,
            block_k=64,
            num_stages=stages,
            grid_minor="m",
            grid_width=max(1, min(WGRAD_BAND_TILES, WGRAD_BAND_BYTES // band_bytes)),
            overlap_epilogue=True,
        )
        return _fit(config, out_itemsize, kind, row_scale)
    block_n, stages = (256 if out_cols >= 1024 else 128), 4
    # Bytes of one group's weights, and whether the kernel walks group bands (the order's note below).
    weight_bytes = k * n * 2
    small_groups = m <= SMALL_GROUP_ROWS * g
    banded = kind != "glu_dgrad" or small_groups or weight_bytes > GLU_DGRAD_BAND_WEIGHT_BYTES
    if kind == "glu_dgrad" and banded and n > WIDE_RING_MAX_CONTRACTION:
        # A long contraction: GLU_DGRAD_WIDE_RING's tiles, whose gate/up rows ride the ring too, with the 4 stages
        # that fit next to a row scale (WIDE_RING_MAX_CONTRACTION's note; measured in group bands only).
        block_n, stages = GLU_DGRAD_WIDE_RING.block_n, GLU_DGRAD_WIDE_RING.num_stages
    elif kind == "glu_dgrad":
        # 128 x 128 tiles carry the epilogue's packed gate/up rows in the pipeline's ring (gate_up_ring_slots), which
        # leaves room for 6 stages. The sixth paid where the contraction (D, the op's n) is short and cost where it is
        # long (GLU_DGRAD_DEEP_RING's note; H100, row scale): 2.5-5% faster at qwen3-30b / gpt-oss-120b down and at
        # the qwen3-30b layer's shape; 2% slower at dsv3-ep8 down, 0.1-5% at mixtral down (5% swiglu) and 0.6% at the
        # deepseek-v3 layer's shape. The one point off the rule: 1% slower at the gpt-oss-120b layer's shape (D = 2880).
        block_n, stages = 128, (6 if n <= DEEP_RING_MAX_CONTRACTION else 5)
    # The fwd / dgrad walk group bands with one CTA per span and their warpgroups in lockstep (GROUP_BANDS' note):
    # clustered pairs and fixed-width bands make CTAs read a group's weight tile once more wherever a pair straddles
    # two groups or a band cuts one (about half the groups at 2-3 row tiles each, like the named qwen3-30b / gpt-oss
    # shapes). Until the sixteenth session (2026-11-27) groups past SMALL_GROUP_ROWS took 2-CTA clusters in m8 (fwd)
    # or n / m bands (dgrad) instead. Against those (device time, H100; benchmarks/RESULTS.md, sixteenth session;
    # outputs bit-identical in the kernels' A/B, and every output of the layers with equal sums and sums of squares):
    # - other models' shapes (384-1024 rows; shapes.py's "heuristic" tag): 1-6% faster at 15 of 16 kernels, a tie at
    #   the 16th (olmoe-1b-7b gate_up fwd 430 -> 407 us, deepseek-v2-lite gate_up fwd 468 -> 439, phi3.5-moe gate_up
    #   fwd 2388 -> 2295);
    # - the whole layers (moe_ffn forward + backward, M = T * k): deepseek-v3 64.1 -> 62.2 ms (gathered gate_up 13.9 ->
    #   13.3, down 6.30 -> 5.97, the two dgrads 12.2 -> 11.5); at gpt-oss-120b / qwen3-30b-a3b the changed kernels ran
    #   0-4% faster or alike.
    # Without lockstep, small groups with small weights run faster (SMALL_WEIGHT_BANDS' note); past SMALL_GROUP_ROWS it
    # gained at most 1.7% (granite-3b, olmoe-1b-7b down: 1.6-4.2 MB a group) and cost 6% at deepseek-v2-lite down's
    # dgrad (5.8 MB, 384 rows) and 9-14% at phi3.5-moe (52-105 MB), so there they keep it. The fwd / dgrad overlap their
    # epilogue with the next tile's first steps (where the kept outputs fit: not next to a 256-wide GLU accumulator): at
    # the layers' shapes the down projection (row_scale epilogue) ran 12% (Qwen3) and 4% (DeepSeek-V3) faster with it
    # and the gate_up dgrad 8% and 3% (H200, with clusters then).
    # The GLU backward runs unclustered (clusters cost it 4-5% at the layers' shapes, H200) and without the overlap (14%
    # slower with it at Qwen3). In "n" / "m" bands it ran much slower where a group's weights are large, presumably
    # because the CTAs of a group's row tiles drift apart and each reads the weights from HBM (not profiled; the
    # forward's ncu counts showed that: TUNED's note); group bands in lockstep read them together. At the deepseek-v3
    # layer's down shape (512 rows and 29 MB of weights a group) 14.6 -> 7.3 ms, at gpt-oss-120b's (512 rows, 16.6 MB)
    # 2.90 -> 2.69 ms; at qwen3-30b's (1024 rows, 3.1 MB) they were 8% slower (0.93 against 0.86 ms). (Device time,
    # H100, row scale; the deepseek-v3 pair at 5 stages, gpt-oss-120b's 5 -> 6, qwen3-30b's at 6.) An H200 ran both
    # orders alike at the deepseek-v3 / gpt-oss-120b shapes (6.66 / 2.44 ms), and the whole deepseek-v3 layer's
    # forward + backward in 64.1 ms with group bands against 66.9 with "n" bands (spreads overlapping).
    # (benchmarks/RESULTS.md, thirteenth session.)
    # Decode-sized groups: the fwd / dgrad on 64-row tiles with one consumer warpgroup (the note below).
    tiny = kind != "glu_dgrad" and m <= TINY_GROUP_ROWS * g
    if banded:
        # Small groups with small weights: the fwd / dgrad skip a tail's idle MMAs (SMALL_WEIGHT_BANDS' note). One
        # consumer warpgroup has no idle half to keep in step.
        locked = not tiny and (kind == "glu_dgrad" or not small_groups or weight_bytes > LOCKSTEP_WEIGHT_BYTES)
        order = dataclasses.replace(GROUP_BANDS if locked else SMALL_WEIGHT_BANDS, overlap_epilogue=kind != "glu_dgrad")
    else:
        # The GLU backward of large groups with small weights. Wide outputs: walk a band of row tiles over all column
        # tiles so rhs stays in L2; narrow ones: all columns of a row band are in flight at once and lhs stays in L2.
        n_tiles = math.ceil(out_cols / block_n)
        bands = dict(grid_minor="n", grid_width=n_tiles) if n_tiles <= 16 else dict(grid_minor="m", grid_width=16)
        order = Config(**bands)
    # Decode-sized groups (at most TINY_GROUP_ROWS rows on average) take one consumer warpgroup on 64-row tiles.
    # Against two on 128-row tiles (H100, device time, outputs bit-identical; shapes.py's "decode" tag, uniform
    # routings: 4-8 rows a group at T = 128, 64 at T = 1024): the plain fwd 0.4-3.6% faster at the six shapes, the
    # dgrad 0.5-3.5% at five; 5 stages gained nothing more. In the decode layers (moe_ffn, T = 128) the forward's GLU
    # / row-scale kernels ran alike, the forward + backward 0.3-1.0% faster (benchmarks/RESULTS.md, seventeenth
    # session). Under skewed routings of that mean (one expert half the rows; Zipf) 9 of 12 such kernels ran 0.4-4.1%
    # faster and 3 up to 2.1% slower.
    block_m, num_wgs = (64, 1) if tiny else (128, 2)
    config = dataclasses.replace(
        order, block_m=block_m, num_compute_wgs=num_wgs, block_n=block_n, block_k=64, num_stages=stages
    )
    return _fit(config, out_itemsize, kind, row_scale)


def _fit(config: Config, out_itemsize: int, kind: str, row_scale: bool) -> Config:
    """Drops pipeline stages until the config fits in shared memory."""
    while not config.fits(2, out_itemsize, **epilogue_smem(kind, config, row_scale)) and config.num_stages > 2:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def get_config(
    kind: str,
    *,
    m: int,
    k: int,
    n: int,
    g: int,
    out_itemsize: int = 2,
    row_scale: bool = False,
    clamped: bool = False,
) -> Config:
    """The tuned config for (kind, G, M, K, N) if there is one (and it fits), else the heuristic's.

    ``clamped``: a glu_dgrad through gpt_oss's clamps, which is then at most CLAMPED_BLOCK_N columns wide.
    """
    tuned = TUNED.get((kind, g, m, k, n))
    if tuned is not None and tuned.fits(2, out_itemsize, **epilogue_smem(kind, tuned, row_scale)):
        config = tuned
    else:
        config = heuristic_config(kind, m=m, k=k, n=n, g=g, out_itemsize=out_itemsize, row_scale=row_scale)
    if clamped and kind == "glu_dgrad" and config.block_n > CLAMPED_BLOCK_N:
        narrow = dataclasses.replace(config, block_n=CLAMPED_BLOCK_N, num_stages=GLU_DGRAD_RING.num_stages)
        return _fit(narrow, out_itemsize, kind, row_scale)
    return config
