"""Tile configurations of the sm90 grouped-matmul kernels: the frozen Config, a tuned table, a heuristic.

Three kernels share one Config type (sm90.py, sm90_wgrad.py):
  "fwd"        out[M, N]   = lhs[M, K] · rhs[g][K, N]          rows ragged, contraction K (any sm90.Epilogue)
  "dgrad"      dlhs[M, K]  = dout[M, N] · rhs[g][K, N]^T       the fwd kernel with rhs read the other way round
  "glu_dgrad"  the dgrad of a GLU MLP's down projection, rhs [G, F, D]: dout [M, D] · rhs[g]^T with the GLU backward
               in its epilogue (sm90.Epilogue.activation_grad); its output columns are F
  "wgrad"      drhs[g]     = lhs_g^T · dout_g   -> [G, K, N]   contraction over the ragged rows
For fwd/dgrad, (block_m, block_n) tile the output [M, cols] and block_k the contraction; for wgrad, (block_m, block_n)
tile one group's [K, N] output and block_k walks its rows.

The tuned table is data (tuned/sm90.json beside this module, read when first needed: ``tuned_configs``); shapes off
it take ``heuristic_config``. The docs (docs/kernels/grouped_matmul.md) hold the measurements behind both.
"""

import dataclasses
import functools
import importlib.resources
import json
import math
import types
from collections.abc import Mapping
from typing import Literal

from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK

KINDS = ("fwd", "dgrad", "glu_dgrad", "wgrad")
WGMMA_M = 64  # rows of one wgmma instruction: a compute warpgroup owns a multiple of this
SMEM_BYTES = 227 * 1024  # dynamic shared memory one H100/H200 block can have
SMEM_ALIGNMENT = 1024  # where Pallas (jax 0.11.2) starts each shared-memory scratch buffer
# Registers per consumer thread an overlapped epilogue may hold across tiles: with a [64, 256] f32 accumulator (128
# registers) and the addresses, more would spill under the 232-register budget of two consumers.
OVERLAP_REGISTERS = 64
# wgrad walks a group's output tiles in bands of up to WGRAD_BAND_TILES row tiles, narrower where the band's x blocks
# would hold more than WGRAD_BAND_BYTES of L2 (a third of an H100's 50 MB; the named shapes' bands take 1-8 MB).
WGRAD_BAND_TILES = 16
WGRAD_BAND_BYTES = 16 * 2**20
# Mean rows per group at or below which groups count as small (two 128-row tiles or fewer): the heuristic's
# glu_dgrad then walks group bands, and its fwd / dgrad let a tail tile skip its idle MMAs where a group's weights
# are small (IN_STEP_WEIGHT_BYTES). The fwd / dgrad walk group bands at every size.
SMALL_GROUP_ROWS = 256
# Mean rows per group at or below which the heuristic's fwd / dgrad take 64-row tiles with one consumer warpgroup
# (decode-sized batches, where a 128-row tile holds a group's few rows).
TINY_GROUP_ROWS = 64
# Bytes of one group's 16-bit weights above which the heuristic's glu_dgrad walks group bands whatever the rows per
# group: CTAs of one group's row tiles that drift apart in "n" / "m" bands each read such weights from HBM.
GLU_DGRAD_BAND_WEIGHT_BYTES = 8 * 2**20
# Bytes of one group's 16-bit weights above which the fwd / dgrad of small groups keep their CTAs in step
# (Config.keep_ctas_in_step); at or below it the L2 serves CTAs that drift apart, and skipping idle MMAs pays.
IN_STEP_WEIGHT_BYTES = 8 * 2**20
# Longest contraction (D) at which the heuristic's glu_dgrad takes GLU_DGRAD_SHORT_D_TILES' 6 pipeline stages rather
# than 5: the sixth runs faster at D = 2048 / 2880 and slower at 4096 / 7168 (H100).
SHORT_D_MAX = 2880
# Longest contraction (D) at which the heuristic's glu_dgrad in group bands keeps 128 x 128 tiles; past it
# GLU_DGRAD_LONG_D_TILES' 128 x 256 tiles run faster (at D = 7168; alike at 4096, 21-32% slower at 2048 / 2880).
MEDIUM_D_MAX = 4096
# The FP8 forward (sm90_fp8.py) steps through K in blocks of the fp8_block recipe's 128, and its narrow tiles are one
# weight-scale block wide.
FP8_BLOCK = 128
# The FP8 kernel's wide tiles: one and a half weight-scale blocks, whose total and partial still fit two consumers'
# registers (sm90_fp8.check).
FP8_WIDE_BLOCK_N = 192
# Output columns from which fp8_config takes three consumer warpgroups (192-row tiles) rather than two (128-row
# tiles), both promoting each K block as its MMA completes. Measured on an H200: three run 7-11% faster at N = 4096 to
# 28672, where a third warpgroup's MMAs keep the tensor cores busy during the other two's promotions; two run 2-5%
# faster at N = 1536 / 2880, whose fewer column tiles leave 192-row tiles too few to spread evenly over the SMs.
FP8_THREE_CONSUMERS_MIN_N = 4096


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile shape and pipeline of one kernel launch.

    Attributes:
      block_m: output rows of a CTA tile, split evenly over the compute warpgroups (each owns a multiple of 64 rows).
      block_n: output columns of a CTA tile (one wgmma N: a multiple of 64, at most 256).
      block_k: contraction step of the pipeline (64 or 128).
      num_stages: shared-memory buffers of the TMA -> wgmma pipeline.
      num_compute_wgs: consumer warpgroups; one more producer warpgroup issues every TMA load. Each of 1, 2 or 3
        consumers gets 256, 232 or 152 registers a thread (sm90_pipeline.compute_registers).
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
      keep_ctas_in_step: fwd / dgrad / glu_dgrad: every compute warpgroup of a tile issues its MMAs, also one none of
        whose rows is stored (in a group's tail tile of at most 64 rows), so that a tail tile takes as long as a full
        one. Where such warpgroups skip them, tail tiles are shorter, the persistent CTAs drift apart, and CTAs that
        share a weight tile each read it from HBM instead of together from L2. wgrad ignores it (its tiles have no
        per-warpgroup rows).
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
    keep_ctas_in_step: bool = False

    def __post_init__(self):
        if self.num_compute_wgs not in (1, 2, 3):
            raise ValueError(f"num_compute_wgs must be 1, 2 or 3, got {self.num_compute_wgs}")
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
        operand_fp8: bool = False,
        row_vectors: int = 0,
        scale_k_blocks: int = 0,
        kept_fp8: bool = False,
    ) -> int:
        """Shared memory of one CTA: the pipeline's stages, the epilogue's double buffer and its operands.

        Args:
          in_itemsize, out_itemsize: bytes per input / output element.
          operand_cols: columns of the [wg_block_m, operand_cols] output-dtype tile each consumer's epilogue loads
            itself (the GLU backward's packed gate/up rows, 2 * block_n, where the ring does not carry them).
          operand_fp8: that tile is FP8 instead (one byte an element), with an f32 scale per row and FP8_BLOCK
            columns in a buffer of its own (the GLU backward's pre-activation kept in FP8 blocks).
          row_vectors: [wg_block_m] f32 vectors per consumer (row_scale in, partial sums out), in one buffer.
          scale_k_blocks: FP8 operands (sm90_fp8.py): ``fp8_scale_k_blocks(K)``, the f32 weight scales each
            consumer holds per weight block under its tile (``fp8_tile_scale_blocks``); the x scales then take a
            [block_m] f32 ring beside the pipeline's.
          kept_fp8: the forward keeps its pre-activation in FP8 blocks (sm90.Epilogue.keep_blocks): a [block_m,
            FP8_BLOCK] buffer of one-byte values.
        """
        buffers = [
            self.num_stages * self.block_m * self.block_k * in_itemsize,  # x ring
            self.num_stages * self.block_n * self.block_k * in_itemsize,  # w ring
            2 * self.block_m * self.epilogue_n * out_itemsize,
            self.block_m * FP8_BLOCK * kept_fp8,
            self.block_m * operand_cols * (1 if operand_fp8 else out_itemsize),
            (operand_cols // FP8_BLOCK * self.block_m * 4) if operand_fp8 else 0,
            row_vectors * self.block_m * 4,
            (self.num_stages * self.block_m * 4) if scale_k_blocks else 0,
            self.num_compute_wgs * fp8_tile_scale_blocks(self.block_n) * scale_k_blocks * 4,
        ]
        # Pallas starts every scratch buffer at a SMEM_ALIGNMENT boundary.
        return sum(-(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for size in buffers)

    def fits(self, in_itemsize: int = 2, out_itemsize: int = 2, **epilogue) -> bool:
        """Whether the CTA's shared memory fits (``epilogue``: smem_bytes's keywords)."""
        # Leave room for the barriers and the compiler's own scratch.
        return self.smem_bytes(in_itemsize, out_itemsize, **epilogue) <= SMEM_BYTES - 2048


# Group bands in step: one CTA per row tile, in bands that never mix two groups' weight tiles, so that the CTAs of a
# band read each weight tile together; the epilogue is stored during the next tile's first steps.
GROUP_BANDS = Config(grid_minor="g", grid_width=16, overlap_epilogue=True, keep_ctas_in_step=True)
# Group bands whose tail tiles skip their idle MMAs: faster where a group's weights are small enough for the L2 to
# serve CTAs that drift apart (IN_STEP_WEIGHT_BYTES).
GROUP_BANDS_SHORT_TAILS = dataclasses.replace(GROUP_BANDS, keep_ctas_in_step=False)
# wgrad: a group's output tiles in bands of row tiles (WGRAD_BAND_TILES), whose x blocks stay in L2 while y streams
# past once per band; its tiles are short (a group's rows), so each is stored during the next one's first steps.
WGRAD_BANDS = Config(grid_minor="m", grid_width=WGRAD_BAND_TILES, overlap_epilogue=True)
# glu_dgrad: 128 x 128 tiles whose packed gate/up rows ride the pipeline's ring (gate_up_ring_slots) rather than a
# buffer of their own, which leaves shared memory for 5 stages next to a row scale. The GLU backward runs 8-28% slower
# with an overlapped epilogue.
GLU_DGRAD_TILES = dataclasses.replace(GROUP_BANDS, block_n=128, num_stages=5, overlap_epilogue=False)
# glu_dgrad at short contractions (D <= SHORT_D_MAX): a sixth stage, which fits next to a row scale.
GLU_DGRAD_SHORT_D_TILES = dataclasses.replace(GLU_DGRAD_TILES, num_stages=6)
# glu_dgrad at long contractions (D > MEDIUM_D_MAX): 128 x 256 tiles, the up block in the first half of a ring slot's
# weight buffer, with the 4 stages that fit next to a row scale.
GLU_DGRAD_LONG_D_TILES = dataclasses.replace(GLU_DGRAD_TILES, block_n=256, num_stages=4)
# gpt_oss's clamped GLU backward is at most this many columns wide: on 256-column tiles its epilogue spills registers
# whether it computes h, d_gate and d_up together or one per store (sm90.Epilogue.recompute_grads), and runs slower.
CLAMPED_GLU_MAX_BLOCK_N = 128

TunedKey = tuple[str, int, int, int, int]  # (kind, G, M, K, N) of the op, K and N as in rhs [G, K, N]


@functools.cache
def tuned_configs() -> Mapping[TunedKey, Config]:
    """The tuned table: the fastest config measured per (kind, G, M, K, N) on sm90 GPUs (H100, H200).

    Read from tuned/sm90.json (package data) on the first call. glu_dgrad is keyed by the down projection's shape;
    the fused GLU forward takes the fwd entry of its gate_up shape.
    """
    text = importlib.resources.files(__package__).joinpath("tuned", "sm90.json").read_text()
    table = {}
    for entry in json.loads(text)["entries"]:
        if entry["kind"] not in KINDS:
            raise ValueError(f"tuned/sm90.json: kind must be one of {KINDS}, got {entry}")
        table[entry["kind"], entry["g"], entry["m"], entry["k"], entry["n"]] = Config(**entry["config"])
    return types.MappingProxyType(table)


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


def row_vector_count(row_scale: bool, glu_backward: bool, kept_scales: bool = False) -> int:
    """[wg_block_m] f32 shared-memory vectors per consumer: the row scale in and, in the GLU backward, the row-scale
    gradient's partial sums out; with ``kept_scales`` the forward's FP8 pre-activation's scales out (sm90.py keeps
    them in one buffer)."""
    return int(row_scale) * (2 if glu_backward else 1) + int(kept_scales)


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
        block_m = 128
        band_bytes = rows_per_group * block_m * 2  # one x block [rows, block_m] of 16-bit elements
        config = dataclasses.replace(
            WGRAD_BANDS,
            block_m=block_m,
            block_n=256 if n >= 256 else 128,
            block_k=64,
            num_stages=4 if rows_per_group >= 256 else 3,
            grid_width=max(1, min(WGRAD_BAND_TILES, WGRAD_BAND_BYTES // band_bytes)),
        )
        return _fit(config, out_itemsize, kind, row_scale)
    block_n, stages = (256 if out_cols >= 1024 else 128), 4
    # The fwd / dgrad walk group bands at every size (fixed-width "n" / "m" bands cut groups, and a cut group's weight
    # tile is read once per part); the GLU backward where groups are small or their weights large.
    weight_bytes = k * n * 2  # one group's weights
    small_groups = m <= SMALL_GROUP_ROWS * g
    banded = kind != "glu_dgrad" or small_groups or weight_bytes > GLU_DGRAD_BAND_WEIGHT_BYTES
    if kind == "glu_dgrad" and banded and n > MEDIUM_D_MAX:
        block_n, stages = GLU_DGRAD_LONG_D_TILES.block_n, GLU_DGRAD_LONG_D_TILES.num_stages
    elif kind == "glu_dgrad":
        # 128 x 128 tiles, whose packed gate/up rows ride the pipeline's ring.
        tiles = GLU_DGRAD_SHORT_D_TILES if n <= SHORT_D_MAX else GLU_DGRAD_TILES
        block_n, stages = tiles.block_n, tiles.num_stages
    # Decode-sized groups (at most TINY_GROUP_ROWS rows on average): the fwd / dgrad on 64-row tiles with one consumer
    # warpgroup.
    tiny = kind != "glu_dgrad" and m <= TINY_GROUP_ROWS * g
    if banded:
        # Small groups with small weights: the fwd / dgrad tail tiles skip their idle MMAs. One consumer warpgroup has
        # no idle half to keep in step.
        in_step = not tiny and (kind == "glu_dgrad" or not small_groups or weight_bytes > IN_STEP_WEIGHT_BYTES)
        group_bands = GROUP_BANDS if in_step else GROUP_BANDS_SHORT_TAILS
        order = dataclasses.replace(group_bands, overlap_epilogue=kind != "glu_dgrad")
    else:
        # The GLU backward of large groups with small weights. Wide outputs: walk a band of row tiles over all column
        # tiles so rhs stays in L2; narrow ones: all columns of a row band are in flight at once and lhs stays in L2.
        n_tiles = math.ceil(out_cols / block_n)
        bands = dict(grid_minor="n", grid_width=n_tiles) if n_tiles <= 16 else dict(grid_minor="m", grid_width=16)
        order = Config(**bands)
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


def fp8_scale_k_blocks(contraction: int) -> int:
    """The weight scales per tile that the FP8 kernel loads: ceil(K / FP8_BLOCK), padded to a multiple of 32.

    Each consumer's row of them is a TMA destination in shared memory, and a TMA destination starts on a 128-byte
    boundary: 32 f32 make every row of the [consumers, K blocks] buffer start on one."""
    return -(-math.ceil(contraction / FP8_BLOCK) // 32) * 32


def fp8_tile_scale_blocks(block_n: int) -> int:
    """Weight-scale blocks under one FP8 tile's columns: one for 128-column tiles, two for FP8_WIDE_BLOCK_N ones
    (a tile starts 0 or 64 columns past a block's start)."""
    return 1 if block_n == FP8_BLOCK else 2


def fp8_config(
    *,
    m: int,
    k: int,
    n: int,
    g: int,
    out_itemsize: int = 2,
    row_scale: bool = False,
    consumers: int | None = None,
    glu_forward: bool = False,
    glu_backward: bool = False,
    scaled_gate_up: bool = False,
    block_n: int | None = None,
    keep_blocks: bool = False,
) -> Config:
    """The FP8 kernel's config (forward, and the dgrad with its own columns as ``n``): the heuristic forward's tile
    order, FP8_BLOCK-wide steps (sm90_fp8.py), the epilogue between tiles, as many stages as fit in shared memory,
    and 64 rows per consumer warpgroup: three of them on 128 columns where n >= FP8_THREE_CONSUMERS_MIN_N, else two
    on FP8_WIDE_BLOCK_N columns (128 with a GLU in the epilogue, whose gate/up blocks pair 128 columns), or one on
    128 columns for the heuristic's 64-row tiles of decode-sized groups: on an H200 three consumers run fastest from
    4096 columns and 128 x 192 tiles below them (docs/kernels/grouped_matmul.md, "FP8"). ``consumers`` /
    ``block_n``: those in their place.

    ``glu_forward``: the gate_up projection with the GLU in its epilogue. ``glu_backward``: the down projection's
    dgrad with the GLU backward in its epilogue (n = F), whose consumers load their [wg_block_m, 2 * block_n] packed
    gate/up rows themselves (the pipeline's ring carries them only for 64-wide steps) and keep two row vectors with a
    row scale; always two consumers, whose registers hold the GLU backward's temporaries beside the f32 total.
    ``scaled_gate_up`` (with ``glu_backward``): those rows are FP8 with their 1 x 128 blocks' scales
    (sm90.Epilogue.scaled_gate_up), half the bytes of 16-bit ones: at the bench layers' widths a stage more fits.
    ``keep_blocks``: the GLU forward also stores its pre-activation in FP8 blocks (sm90.Epilogue.keep_blocks), whose
    buffers take shared memory from the pipeline.

    Not tuned: the tuned table holds 16-bit kernels only.
    """
    order = heuristic_config("fwd", m=m, k=k, n=n, g=g, out_itemsize=out_itemsize, row_scale=row_scale)
    if consumers is None and order.num_compute_wgs > 1:
        consumers = 2 if glu_backward or n < FP8_THREE_CONSUMERS_MIN_N else 3
    if block_n is None:
        wide = consumers == 2 and not (glu_forward or glu_backward)
        block_n = FP8_WIDE_BLOCK_N if wide else FP8_BLOCK
    config = dataclasses.replace(order, block_n=block_n, block_k=FP8_BLOCK, overlap_epilogue=False, num_stages=8)
    if consumers is not None:
        config = dataclasses.replace(config, block_m=WGMMA_M * consumers, num_compute_wgs=consumers)
    epilogue = dict(
        operand_cols=2 * FP8_BLOCK if glu_backward else 0,
        operand_fp8=glu_backward and scaled_gate_up,
        row_vectors=row_vector_count(row_scale, glu_backward, keep_blocks),
        scale_k_blocks=fp8_scale_k_blocks(k),
        kept_fp8=keep_blocks,
    )
    while not config.fits(1, out_itemsize, **epilogue) and config.num_stages > 2:
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

    ``clamped``: a glu_dgrad through gpt_oss's clamps, which is then at most CLAMPED_GLU_MAX_BLOCK_N columns wide.
    """
    tuned = tuned_configs().get((kind, g, m, k, n))
    if tuned is not None and tuned.fits(2, out_itemsize, **epilogue_smem(kind, tuned, row_scale)):
        config = tuned
    else:
        config = heuristic_config(kind, m=m, k=k, n=n, g=g, out_itemsize=out_itemsize, row_scale=row_scale)
    if clamped and kind == "glu_dgrad" and config.block_n > CLAMPED_GLU_MAX_BLOCK_N:
        narrow = dataclasses.replace(config, block_n=CLAMPED_GLU_MAX_BLOCK_N, num_stages=GLU_DGRAD_TILES.num_stages)
        return _fit(narrow, out_itemsize, kind, row_scale)
    return config
