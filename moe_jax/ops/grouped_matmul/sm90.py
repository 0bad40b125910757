"""Mosaic GPU (sm90) ragged grouped matmul, row-ragged: out[M, C] = x[M, R] · w[g][R, C] on each row tile of group g.

The forward pass is (x, w) = (lhs, rhs) and dgrad is (x, w^T) = (dout, rhs read transposed): one kernel, the B
operand's shared-memory tile is either [block_k, block_n] (w stored [G, R, C]) or [block_n, block_k] (w stored
[G, C, R], "K-major") and wgmma takes the latter transposed, so no transposed copy of the weights is ever made.

Structure (one CTA per SM, persistent; the pipeline itself is in sm90_pipeline.py):
  * the producer warpgroup streams the block_k slices of the tile's x rows and of w[g] into a ring of swizzled
    shared-memory buffers with TMA, running ahead across tile boundaries;
  * consumer warpgroup w owns rows [w * wg_block_m, (w+1) * wg_block_m) of the tile and accumulates them with
    wgmma; a warpgroup none of whose rows is stored (the tail tile of a group) issues no MMA unless
    ``config.keep_ctas_in_step`` (rows that are not stored cost MMAs but no correctness: each output row depends on
    its own x row only; a tail tile then takes as long as a full one, so CTAs sharing a weight tile read it from L2
    together instead of each from HBM). The epilogue
    (``Epilogue``) turns the f32 accumulator into the outputs and TMA-stores the tile's own rows only; with
    ``config.overlap_epilogue`` a consumer keeps them in registers and stores them chunk by chunk between the first
    steps of its next tile, while the tensor cores work (where they fit: ``Epilogue.kept_bytes``);
  * tiles come from schedule.row_tiles, walked in a planar-snake order over (row tile, column tile), or with
    ``grid_minor="g"`` in bands that never mix groups (schedule.row_tile_bands); the loop bound is read from the
    device, so empty groups cost nothing and no host sync is needed.

Epilogues (``Epilogue``; the GLU math arrives as functions, the kernel holds no activation policy):
  * plain: cast and store [M, C];
  * forward: GLU over packed [gate | up] column blocks (packing.py) -> [M, C/2], and/or a per-row scale, optionally
    also storing the raw accumulator (the pre-activation the backward keeps);
  * GLU backward (dgrad of the down projection): the accumulator is d_h = dout · w_down^T; with the tile's rows of
    the packed pre-activation and of row_scale it writes d_gate_up [M, 2C] (packed), h * row_scale [M, C] (the down
    projection's wgrad operand) and per-tile partial sums of h · d_h for the row-scale gradient. row_scale is
    TMA-loaded by the consumer while its MMAs run. The packed rows ride the pipeline's ring where the tile shape
    allows (config.gate_up_ring_slots: block_n equal to block_m or twice it): the producer loads them into the next
    slots after the tile's last step, one slot per epilogue chunk, and the consumer releases each slot once it has
    read it. Elsewhere the consumer loads them into a buffer of their own, which leaves less shared memory for the
    pipeline (at a 64-column tile the narrow MMAs then cost more than the whole epilogue).

FP8 operands (``x_scales`` / ``w_scales``, sm90_fp8.py): x and w in float8_e4m3fn, w stored [G, C, R] (wgmma takes FP8
only K-major), each 128-wide K block multiplied into a fresh accumulator and added to an f32 total with its scales;
the scales ride beside the tiles. The epilogues are the same, but for the GLU backward's pre-activation, which may
arrive in FP8 too (``Epilogue.scaled_gate_up``: a scale per row and 128 packed columns, the 1 x 128 blocks of the
kept pre-activation): the consumer loads the FP8 rows and their scales with its own TMA copies and dequantizes each
chunk in f32, so no dequantized copy of the pre-activation is written.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.grouped_matmul import sm90_fp8 as fp8
from moe_jax.ops.grouped_matmul import sm90_gather as gather
from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from moe_jax.ops.grouped_matmul.config import Config, gate_up_ring_slots, row_vector_count
from moe_jax.ops.grouped_matmul.schedule import (
    BAND_FIRST,
    BAND_REVERSED,
    BAND_WIDTH,
    ROW_ALIGN,
    TILE_GROUP,
    TILE_ROW,
    TILE_ROWS,
    TILE_SKIP,
    ZERO_TILE,
    row_tile_bands,
)
from moe_jax.ops.grouped_matmul.sm90_fresh_product import fresh_product
from moe_jax.ops.quant import reference as quant_reference


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What each consumer does with its f32 accumulator [wg_block_m, block_n] (static; the default is plain).

    Attributes:
      activation: GLU forward ``(gate, up) -> h`` on f32 arrays: the accumulator's columns are ``pack``-wide blocks
        of gate columns each followed by the matching up columns; the output holds h, [M, C/2].
      activation_grad: GLU backward ``(gate, up, d_h) -> (h, d_gate, d_up)``: the accumulator is d_h (before the
        row scale), gate/up come from the packed pre-activation operand [M, 2C]. Outputs: d_gate_up [M, 2C] (packed),
        h * row_scale [M, C] and, with ``row_scale``, partial row sums of h · d_h [C tiles, row tiles, block_m] f32.
      row_scale: rows are scaled by the row_scale operand [M] f32 (forward: the output; backward: d_h).
      keep_acc: forward only: also store the accumulator itself (cast to the output dtype) as a second output.
      keep_rounding: with keep_acc and an activation, ``(gate, up) -> (gate, up)``: f32 values exactly representable
        in the output dtype, stored in place of the accumulator (how the GLU backward wants its input rounded).
      recompute_grads: GLU backward: each of h, d_gate and d_up is computed in its own store's branch from gate, up
        and d_h, recomputing the terms they share. Fewer registers live at once (gpt_oss's clamps spill them when
        all three are computed together), at the cost of the shared terms' arithmetic (three sigmoids instead of
        one).
      pack: the gate/up interleave width (columns); must divide block_n / 2 (fwd) or block_n (bwd).
      scaled_gate_up: GLU backward: the packed pre-activation is FP8 with a scale per row and block of
        ``SCALED_GATE_UP_BLOCK`` packed columns (``pack`` gate and their ``pack`` up columns), dequantized in f32 as
        the consumer reads it (the gate_up_scales operand; the consumers load the rows themselves, no ring).
      keep_blocks: with keep_acc and an activation, the kept pre-activation is stored in float8_e4m3fn in those
        blocks instead (a tile of block_n = SCALED_GATE_UP_BLOCK columns holds one a row): each row's block scale
        from the amax of its rounded values (``keep_rounding``), with quant.reference's arithmetic, so the values
        and scales are the quantizer's of the rounded pre-activation, bit for bit. The scales leave as per-tile rows
        [C tiles, T, block_m] f32 (schedule.gather_tile_rows), as the GLU backward's partial sums do.
    """

    activation: Callable | None = None
    activation_grad: Callable | None = None
    row_scale: bool = False
    keep_acc: bool = False
    keep_rounding: Callable | None = None
    recompute_grads: bool = False
    pack: int = 64
    scaled_gate_up: bool = False
    keep_blocks: bool = False

    def __post_init__(self):
        if self.activation is not None and self.activation_grad is not None:
            raise ValueError("Epilogue: activation (forward) and activation_grad (backward) exclude each other")
        if self.keep_acc and self.activation_grad is not None:
            raise ValueError("Epilogue: keep_acc is a forward option")
        if self.keep_rounding is not None and not (self.keep_acc and self.activation is not None):
            raise ValueError("Epilogue: keep_rounding needs keep_acc and an activation")
        if self.keep_blocks and (not self.keep_acc or self.activation is None or 2 * self.pack != SCALED_GATE_UP_BLOCK):
            raise ValueError(
                f"Epilogue: keep_blocks keeps a GLU forward's pre-activation (keep_acc, an activation) in blocks of "
                f"{SCALED_GATE_UP_BLOCK} packed columns, pack = {SCALED_GATE_UP_BLOCK // 2}; got {self}"
            )
        if self.recompute_grads and self.activation_grad is None:
            raise ValueError("Epilogue: recompute_grads is a GLU backward option")
        if self.scaled_gate_up and (self.activation_grad is None or 2 * self.pack != SCALED_GATE_UP_BLOCK):
            raise ValueError(
                f"Epilogue: scaled_gate_up is a GLU backward option whose blocks of {SCALED_GATE_UP_BLOCK} packed "
                f"columns hold pack = {SCALED_GATE_UP_BLOCK // 2} gate and up columns each, got pack={self.pack}"
            )

    @property
    def backward(self) -> bool:
        return self.activation_grad is not None

    def check(self, config: Config) -> None:
        """Raises ValueError when the tile shape cannot serve this epilogue."""
        glu_cols = config.block_n // 2 if self.activation else config.block_n
        if (self.activation or self.backward) and (glu_cols % self.pack or self.pack % config.epilogue_n):
            raise ValueError(
                f"a GLU epilogue needs pack={self.pack} dividing the tile's hidden columns ({glu_cols}) and a "
                f"multiple of epilogue_n={config.epilogue_n}"
            )
        if self.keep_blocks and config.block_n != SCALED_GATE_UP_BLOCK:
            raise ValueError(f"Epilogue: keep_blocks needs tiles of one block, block_n = {SCALED_GATE_UP_BLOCK}")
        if self.scaled_gate_up and self.ring_slots(config):
            raise ValueError(f"Epilogue: an FP8 pre-activation is loaded by the consumers, not the ring, got {config}")
        if self.operand_cols(config) > 256:
            raise ValueError(
                "the GLU backward's consumers load [gate | up] tiles of 2 * block_n <= 256 columns themselves; wider "
                "tiles need the pipeline's ring (config.gate_up_ring_slots: with overlap_epilogue more than "
                f"block_n / 64 stages), got {config}"
            )

    def ring_slots(self, config: Config) -> int:
        """Pipeline slots carrying a tile's packed gate/up rows (the backward; config.gate_up_ring_slots), else 0."""
        return gate_up_ring_slots(config) if self.backward and self.pack == config.block_k else 0

    def operand_cols(self, config: Config) -> int:
        """Columns of the per-consumer operand tile the epilogue loads itself (the backward's packed gate/up rows,
        where the pipeline's ring does not carry them)."""
        return 2 * config.block_n if self.backward and not self.ring_slots(config) else 0

    def own_loads(self, config: Config) -> int:
        """TMA copies a consumer issues per tile for its epilogue operands (the ring's are the producer's)."""
        return self.row_scale + (self.operand_cols(config) > 0) + self.scaled_gate_up

    def kept_bytes(self, config: Config, out_itemsize: int) -> int:
        """Bytes one consumer holds for a tile's outputs between its last MMA and its stores (the overlapped
        epilogue's carry)."""
        if self.backward:
            columns, itemsize = config.block_n, 4  # d_h, f32
        else:
            columns = (config.block_n // 2 if self.activation else config.block_n) + self.keep_acc * config.block_n
            itemsize = out_itemsize
        return config.wg_block_m * columns * itemsize

    def row_vectors(self) -> int:
        """[wg_block_m] f32 shared-memory vectors per consumer (config.row_vector_count)."""
        return row_vector_count(self.row_scale, self.backward, self.keep_blocks)


PLAIN = Epilogue()  # cast and store
SCALED_GATE_UP_BLOCK = 128  # packed columns per scale of an FP8 pre-activation (Epilogue.scaled_gate_up)
KEPT_BLOCKS_DTYPE = jnp.float8_e4m3fn  # Epilogue.keep_blocks's values


def grouped_matmul_rows(
    x: jax.Array,
    w: jax.Array,
    tiles: jax.Array,
    num_tiles: jax.Array,
    *,
    w_transposed: bool,
    out_dtype,
    config: Config,
    num_sms: int,
    interpret=None,
    epilogue: Epilogue = PLAIN,
    row_scale: jax.Array | None = None,
    gate_up: jax.Array | None = None,
    gate_up_scales: jax.Array | None = None,
    row_tokens: jax.Array | None = None,
    x_scales: jax.Array | None = None,
    w_scales: jax.Array | None = None,
):
    """out[M, C] = x[rows of g] · w[g] over the row tiles of schedule.row_tiles, through ``epilogue``.

    Args:
      x: [M, R] with M a multiple of 8 and R of 64; with ``row_tokens``, [T, R] rows that row r gathers from.
      w: [G, R, C], or [G, C, R] with ``w_transposed``; C a multiple of 64; same dtype as x (bf16 or f16; or
        float8_e4m3fn with the scales below, w stored [G, C, R] and R a multiple of 64: a 64-wide last K block
        is read with a 64-byte swizzle, sm90_fp8.ring_swizzle_columns).
      tiles, num_tiles: schedule.row_tiles(group_sizes, M, config.block_m).
      w_transposed: w's last axis is the contraction.
      out_dtype: dtype of every [M, .] output (accumulation is f32).
      config: tile shapes; num_sms: persistent CTAs; interpret: Mosaic GPU interpreter params or None.
      epilogue: see ``Epilogue``.
      row_scale: [M] f32, with ``epilogue.row_scale``.
      gate_up: [M, 2C] packed pre-activation in out_dtype, for the GLU backward (x's dtype for 16-bit x); in FP8 with
        ``epilogue.scaled_gate_up``.
      gate_up_scales: [2C / 128, M] f32 with ``epilogue.scaled_gate_up``: row r's scale of packed block b at [b, r]
        (MN-major: a tile's rows of one block are contiguous).
      row_tokens: [M] int32 in [0, T): row r of the product is x[row_tokens[r]] (sm90_gather.py; R a multiple of
        block_k). M a multiple of 8.
      x_scales: FP8 x's scales, MN-major: [R / 128, M] f32 (row r's scale of K block k at [k, r]).
      w_scales: FP8 w's scales: [G, ceil(C / 128) + 1, config.fp8_scale_k_blocks(R)] f32 (block (n, k) of group g
        at [g, n, k]; the K blocks padded, and one block past the last, which 192-column tiles load).

    Returns:
      plain: [M, C]: the rows of every tile's group, zeros for the rows of ZERO_TILE tiles. Forward: out ([M, C/2]
      with an activation, else [M, C]), or (out, acc [M, C]) with ``keep_acc``, or (out, acc [M, C] in FP8, its
      scales [C / 128, T, block_m] per tile) with ``keep_blocks``. GLU backward: (d_gate_up [M, 2C],
      h_scaled [M, C]), plus the partial sums [cdiv(C, block_n), T, block_m] f32 with ``row_scale``.
    """
    m, r = x.shape if row_tokens is None else (row_tokens.shape[0], x.shape[1])
    cols = w.shape[1] if w_transposed else w.shape[2]
    cfg, epi = config, epilogue
    epi.check(cfg)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wg_m, num_wgs, stages, epi_n = cfg.wg_block_m, cfg.num_compute_wgs, cfg.num_stages, cfg.epilogue_n
    k_steps = pl.cdiv(r, bk)
    n_tiles = pl.cdiv(cols, bn)
    max_tiles = tiles.shape[1]
    operands = [
        op
        for op in (
            row_scale if epi.row_scale else None,
            gate_up if epi.backward else None,
            gate_up_scales if epi.scaled_gate_up else None,
        )
        if op is not None
    ]
    ring_slots = epi.ring_slots(cfg)
    loads_per_tile = epi.own_loads(cfg)
    overlap = pipe.overlaps_epilogue(cfg, epi.kept_bytes(cfg, jnp.dtype(out_dtype).itemsize))
    gathered = row_tokens is not None
    if ring_slots and (gathered or not w_transposed):
        # A ring slot's weight buffer must be [block_n, block_k] and its "produced" barrier count two TMA copies.
        raise ValueError("the GLU backward's ring-carried gate/up rows need w_transposed=True and no row_tokens")
    banded = cfg.grid_minor == "g"
    # The band of every row tile, for the "g" order (a small XLA computation on the tile table, like the table itself).
    bands = [row_tile_bands(tiles, num_tiles, cfg.grid_width)] if banded else []
    fp8_scales = [] if x_scales is None else [x_scales, w_scales]
    if fp8_scales:
        fp8.check(cfg, w_transposed=w_transposed, overlap=overlap)
    if gathered:
        if r % bk:
            raise ValueError(f"gathered rows need the contraction ({r}) to be a multiple of block_k ({bk})")
        # Tile boxes run up to block_m rows past M: those rows read token 0 and are never stored.
        row_tokens = jnp.pad(row_tokens.astype(jnp.int32), (0, bm))

    def body(tiles_gmem, count_gmem, x_gmem, w_gmem, *refs):
        row_tokens_gmem, refs = (refs[0], refs[1:]) if gathered else (None, refs)
        bands_gmem, refs = (refs[0], refs[1:]) if banded else (None, refs)
        (x_scales_gmem, w_scales_gmem), refs = (refs[:2], refs[2:]) if fp8_scales else ((None, None), refs)
        operand_gmem, refs = refs[: len(operands)], refs[len(operands) :]
        gate_up_gmem = operand_gmem[int(epi.row_scale)] if epi.backward else None
        out_gmems, refs = refs[: len(out_types)], refs[len(out_types) :]
        x_smem, w_smem, out_smem, produced, consumed, *refs = refs
        fp8_scratch, epi_scratch = refs[: len(fp8_scratch_types)], refs[len(fp8_scratch_types) :]
        num_row_tiles = count_gmem[0]
        wg = lax.axis_index("wg")
        work = (num_row_tiles * n_tiles,)

        def tile_of(lin):
            """Linear work index -> (row tile, column tile, steps): work items walk (row tile, column tile) in
            planar-snake order, or in group bands; a tile that only stores zeros runs no step."""
            if banded:
                mi, ni = band_item(lin)
            else:
                mi, ni = plgpu.planar_snake(
                    lin, (num_row_tiles, n_tiles), 0 if cfg.grid_minor == "m" else 1, cfg.grid_width
                )
            steps = jnp.where(tiles_gmem[TILE_GROUP, mi] == ZERO_TILE, 0, k_steps).astype(jnp.int32)
            return mi, ni, steps

        def band_item(lin):
            """Work item -> (row tile, column tile) in schedule.row_tile_bands's order: row tiles fastest within a
            band."""
            tile_row = lin // n_tiles  # a row tile of lin's band (row_tile_bands's docstring)
            first, width = bands_gmem[BAND_FIRST, tile_row], bands_gmem[BAND_WIDTH, tile_row]
            within = lin - first * n_tiles
            ni = within // width
            ni = jnp.where(bands_gmem[BAND_REVERSED, tile_row] != 0, n_tiles - 1 - ni, ni)
            return first + within % width, ni

        @pl.when(wg == num_wgs)
        def _producer():
            plgpu.set_max_registers(pipe.PRODUCER_REGISTERS, action="decrease")

            def load_tile(info, carry):
                mi, ni, steps = tile_of(info.index[0])
                group = tiles_gmem[TILE_GROUP, mi]
                row0 = pl.multiple_of(tiles_gmem[TILE_ROW, mi], ROW_ALIGN)

                def load(k, slot):
                    ks, ns = pl.ds(k * bk, bk), pl.ds(ni * bn, bn)
                    w_block = w_gmem.at[group, ns, ks] if w_transposed else w_gmem.at[group, ks, ns]
                    if gathered:
                        plgpu.copy_gmem_to_smem(w_block, w_smem.at[slot], produced.at[slot])
                        gather.load_rows(
                            x_gmem,
                            row_tokens_gmem,
                            row0,
                            k * bk,
                            x_smem.at[slot],
                            produced.at[slot],
                            interpret=interpret,
                        )
                    else:
                        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row0, bm), ks], x_smem.at[slot], produced.at[slot])
                        plgpu.copy_gmem_to_smem(w_block, w_smem.at[slot], produced.at[slot])
                    if fp8_scales:
                        fp8.load_x_scales(x_scales_gmem, k, row0, fp8_scratch[0].at[slot], produced.at[slot])

                pipe.produce(carry, steps, stages, consumed, load)
                if ring_slots:
                    load_gate_up = functools.partial(load_gate_up_chunk, row0, ni)
                    pipe.produce(carry + steps, ring_slots, stages, consumed, load_gate_up)
                return carry + steps + ring_slots

            def load_gate_up_chunk(row0, ni, chunk, slot):
                """The packed gate/up rows of epilogue chunk ``chunk`` into ring slot ``slot``: its gate block into
                the x buffer, its up block into the first block_m rows of the weights' (each [block_m, block_k])."""
                gate_col = 2 * (ni * bn + chunk * epi_n)
                for col, dst in ((gate_col, x_smem.at[slot]), (gate_col + epi_n, w_smem.at[slot, pl.ds(0, bm)])):
                    src = gate_up_gmem.at[pl.ds(row0, bm), pl.ds(col, epi_n)]
                    plgpu.copy_gmem_to_smem(src, dst, produced.at[slot])

            total_steps = plgpu.nd_loop(work, collective_axes="sm", init_carry=jnp.int32(0))(load_tile)
            pipe.drain(total_steps, stages, consumed)

        @pl.when(wg < num_wgs)
        def _consumer():
            plgpu.set_max_registers(pipe.compute_registers(num_wgs), action="increase")
            ring = (x_smem, w_smem, produced, consumed)
            epilogue = _epilogue(
                epi, cfg, cols, out_dtype, wg, out_gmems, out_smem, operand_gmem, epi_scratch, ring, overlap
            )

            def stores(outputs):
                values, tile = outputs
                return epilogue.stores(values, *tile)

            def tile_step(info, first_step, overlapped):
                mi, ni, steps = tile_of(info.index[0])
                row0, skip, rows = tiles_gmem[TILE_ROW, mi], tiles_gmem[TILE_SKIP, mi], tiles_gmem[TILE_ROWS, mi]
                # The tile's stored rows within this warpgroup's wg_m-row slice.
                wg_first = jnp.clip(skip - wg * wg_m, 0, wg_m)
                wg_rows = jnp.clip(skip + rows - wg * wg_m, 0, wg_m) - wg_first
                wg_row0 = row0 + wg * wg_m
                # With the overlap an epilogue operand load that would overwrite what the previous tile's stores read
                # runs after them.
                prefetch = functools.partial(epilogue.prefetch, wg_row0, ni)
                if overlap and epilogue.prefetch_after_stores:
                    overlapped.append(prefetch)
                else:
                    prefetch()

                def operands(slot):
                    """The slot's x rows of this consumer and w, as wgmma takes them."""
                    if gathered:
                        gather.acquire_rows(interpret=interpret)
                    x_tile = x_smem.at[slot, pl.ds(pl.multiple_of(wg * wg_m, wg_m), wg_m)]
                    w_block = w_smem.at[slot]
                    return x_tile, w_block.transpose((1, 0)) if w_transposed else w_block

                # A warpgroup with no rows to store skips its MMAs, unless the tile is to last as long as a full one:
                # then every warpgroup multiplies (a tile with steps has rows).
                def wgmma(acc, slot):
                    """acc += the slot's x rows of this consumer . w."""
                    issue = functools.partial(plgpu.wgmma, acc, *operands(slot))
                    if cfg.keep_ctas_in_step:
                        issue()
                    else:
                        pl.when(wg_rows > 0)(issue)

                def fp8_product(slot):
                    """The slot's x rows of this consumer . w, [wg_m, bn] f32 (FP8: a fresh accumulator a step)."""
                    return fresh_product(*operands(slot), interpret=interpret)

                def mma(acc):
                    def issue(k, slot):
                        del k  # the slot says which buffers
                        wgmma(acc, slot)

                    pipe.consume(first_step, steps, stages, produced, consumed, issue, overlapped)
                    return acc[...]

                if fp8_scales:
                    x_scales_smem, w_scales_smem, w_scales_loaded = fp8_scratch
                    scales = (x_scales_smem, w_scales_smem.at[wg], w_scales_loaded.at[wg])
                    fp8.load_w_scales(w_scales_gmem, tiles_gmem[TILE_GROUP, mi], ni * bn, *scales[1:], steps)
                    has_rows = None if cfg.keep_ctas_in_step else wg_rows > 0
                    acc = fp8.promoted_products(
                        first_step,
                        steps,
                        stages,
                        produced,
                        consumed,
                        fp8_product,
                        scales,
                        (wg_m, bn),
                        wg,
                        ni * bn,
                        has_rows,
                    )
                else:
                    acc = pl.run_scoped(mma, plgpu.ACC((wg_m, bn), jnp.float32))
                # The ring's slots after the tile's steps hold its epilogue operands.
                outputs = (epilogue.prepare(acc), (mi, ni, wg_row0, wg_first, wg_rows, first_step + steps))
                return steps + ring_slots, outputs

            empty = (epilogue.empty(), (jnp.int32(0),) * 6)
            pipe.consume_tiles(work, tile_step, stores, empty, overlap)
            plgpu.wait_smem_to_gmem(0)

    in_dtype = x.dtype
    w_block_shape = (bn, bk) if w_transposed else (bk, bn)
    out_types = _out_types(epi, m, cols, out_dtype, x.dtype, (n_tiles, max_tiles, bm))
    # FP8 operands whose contraction ends in a half block (64 values: gpt-oss's 2880) take a 64-byte swizzle: Mosaic
    # GPU's TMA tiles a whole operand by its swizzle width, and TMA zero-fills the last step's columns past R.
    ring_minor = fp8.ring_swizzle_columns(bk, r) if fp8_scales else bk
    x_transforms = gather.smem_transforms(bk, in_dtype, interpret) if gathered else pipe.swizzled(ring_minor, in_dtype)
    fp8_scratch_types = fp8.scratch(cfg, r) if fp8_scales else []
    produced_arrivals = (gather.produced_arrivals(bm, interpret) if gathered else 2) + (1 if fp8_scales else 0)
    scratch = [
        plgpu.SMEM((stages, bm, bk), in_dtype, transforms=x_transforms),
        plgpu.SMEM(
            (stages, *w_block_shape),
            in_dtype,
            transforms=pipe.swizzled(ring_minor if w_transposed else w_block_shape[1], in_dtype),
        ),
        pipe.epilogue_smem(num_wgs, wg_m, epi_n, out_dtype),
        # produced: the TMA loads of a step landed (x, w and with FP8 x's scales; gathered rows: see sm90_gather.py)
        plgpu.Barrier(num_arrivals=produced_arrivals, num_barriers=stages),
        pipe.consumed_barriers(num_wgs, stages),
        *fp8_scratch_types,
    ]
    if loads_per_tile:
        # loaded[w]: consumer w's epilogue operands of its current tile landed.
        scratch.append(plgpu.Barrier(num_arrivals=loads_per_tile, num_barriers=num_wgs))
    if epi.row_vectors():
        # The tile's row_scale rows, then (GLU backward) the partial sums on their way out: one buffer, as every
        # buffer starts at a 1 KB boundary (config.SMEM_ALIGNMENT).
        scratch.append(plgpu.SMEM((epi.row_vectors(), num_wgs, wg_m), jnp.float32))
    gate_up_cols = epi.operand_cols(cfg)
    if gate_up_cols:
        # Tiles of `pack` columns (a 64-byte swizzle for FP8 rows): the epilogue reads `epilogue_n` columns at a time.
        gate_up_transforms = pipe.swizzled(epi.pack, gate_up.dtype)
        scratch.append(plgpu.SMEM((num_wgs, wg_m, gate_up_cols), gate_up.dtype, transforms=gate_up_transforms))
    if epi.scaled_gate_up:
        # The scales of the tile's packed blocks, [blocks, wg_block_m] per consumer (config.Config.smem_bytes's
        # operand_fp8).
        scratch.append(plgpu.SMEM((num_wgs, gate_up_cols // SCALED_GATE_UP_BLOCK, wg_m), jnp.float32))
    if epi.keep_blocks:
        # One buffer a consumer: the block is a tile's first store (forward_targets), after the wait for every
        # earlier one.
        kept_transforms = pipe.swizzled(SCALED_GATE_UP_BLOCK, KEPT_BLOCKS_DTYPE, 1)
        kept_shape = (num_wgs, 1, wg_m, SCALED_GATE_UP_BLOCK)
        scratch.append(plgpu.SMEM(kept_shape, KEPT_BLOCKS_DTYPE, transforms=kept_transforms))
    kernel = plgpu.kernel(
        body,
        out_type=tuple(out_types) if len(out_types) > 1 else out_types[0],
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=num_wgs + 1,
        thread_name="wg",
        kernel_name=_kernel_name(epi, gathered, bool(fp8_scales)),
        # Approximate exp / division in the GLU epilogues only: far inside bf16 rounding, and the plain kernels keep
        # their exact code. No shared memory for cross-warp reductions: the only reduction, the GLU backward's row
        # sums over a chunk's columns, stays within each warp in the wgmma layout (a cross-warp one would not lower),
        # and the 2 KB the lowering reserves by default would cost the pipeline a stage (config.Config.fits). Lanes
        # lower in half the time of warpgroups (no layout inference pass) and run the same.
        compiler_params=plgpu.CompilerParams(
            approx_math=epi.activation is not None or epi.backward,
            reduction_scratch_bytes=0,
            lowering_semantics=plgpu.LoweringSemantics.Lane,
        ),
        interpret=interpret,
    )
    return kernel(tiles, num_tiles, x, w, *([row_tokens] if gathered else []), *bands, *fp8_scales, *operands)


def _kernel_name(epi: Epilogue, gathered: bool, fp8_operands: bool = False) -> str:
    """What profiles call the kernel: "moe_gmm" plus its operands and epilogue, e.g. moe_gmm_gather_glu."""
    flags = (
        ("fp8", fp8_operands),
        ("gather", gathered),
        ("glu", epi.activation is not None),
        ("glu_bwd", epi.backward),
        ("row_scale", epi.row_scale),
    )
    return "_".join(["moe_gmm"] + [part for part, present in flags if present])


def _out_types(epi: Epilogue, m: int, cols: int, out_dtype, in_dtype, partials_shape) -> list:
    if epi.backward:
        types = [jax.ShapeDtypeStruct((m, 2 * cols), out_dtype), jax.ShapeDtypeStruct((m, cols), out_dtype)]
        if epi.row_scale:
            types.append(jax.ShapeDtypeStruct(partials_shape, jnp.float32))
        return types
    out_cols = cols // 2 if epi.activation else cols
    types = [jax.ShapeDtypeStruct((m, out_cols), out_dtype)]
    if epi.keep_blocks:
        types += [jax.ShapeDtypeStruct((m, cols), KEPT_BLOCKS_DTYPE), jax.ShapeDtypeStruct(partials_shape, jnp.float32)]
    elif epi.keep_acc:
        types.append(jax.ShapeDtypeStruct((m, cols), out_dtype))
    return types


class _EpilogueFns(NamedTuple):
    """Consumer ``wg``'s epilogue, as closures over its refs.

    prefetch(wg_row0, ni): issues the TMA loads of the tile's epilogue operands that the consumer loads itself (before
      its MMAs, or, with ``prefetch_after_stores``, once the previous tile's stores no longer read the buffers).
    prepare(acc) -> values: what the tile keeps after its MMAs: the backward's d_h chunks, or the forward's
      stored values, [wg_block_m, epilogue_n] arrays each. The forward's are functions computing them in their
      store's branch, except where they ride the overlapped epilogue's loop carry.
    stores(values, mi, ni, wg_row0, wg_first, wg_rows, ring_step) -> callables, run in order, that compute and store
      the outputs from ``values`` (one per value); ``ring_step``: the pipeline step whose slot holds the tile's first
      ring-carried operands (Epilogue.ring_slots).
    empty() -> values of the right types, for the loop carry before the first tile.
    """

    prefetch: Callable
    prefetch_after_stores: bool
    prepare: Callable
    stores: Callable
    empty: Callable


def _epilogue(
    epi: Epilogue,
    cfg: Config,
    cols: int,
    out_dtype,
    wg,
    out_gmems,
    out_smem,
    operand_gmem,
    scratch,
    ring,
    overlap: bool,
) -> _EpilogueFns:
    """``ring``: the pipeline's (x_smem, w_smem, produced, consumed), for the operands it carries; ``overlap``: the
    outputs ride the loop carry (sm90_pipeline.consume_tiles)."""
    wg_m, bn, epi_n, pack = cfg.wg_block_m, cfg.block_n, cfg.epilogue_n, epi.pack
    gate_up_in_ring = epi.ring_slots(cfg) > 0
    self_loads = epi.own_loads(cfg) > 0
    loaded, *buffers = scratch if self_loads else (None, *scratch)
    buffers = iter(buffers)
    row_vectors_smem = next(buffers) if epi.row_vectors() else None
    row_scale_smem = row_vectors_smem.at[0] if epi.row_scale else None
    partial_smem = row_vectors_smem.at[1] if epi.backward and epi.row_scale else None
    gate_up_smem = next(buffers) if epi.operand_cols(cfg) else None
    gate_up_scales_smem = next(buffers) if epi.scaled_gate_up else None
    kept_smem = next(buffers) if epi.keep_blocks else None
    kept_scales_smem = row_vectors_smem.at[int(epi.row_scale)] if epi.keep_blocks else None
    operand_gmem = iter(operand_gmem)
    row_scale_gmem = next(operand_gmem) if epi.row_scale else None
    gate_up_gmem = next(operand_gmem) if epi.backward else None
    gate_up_scales_gmem = next(operand_gmem) if epi.scaled_gate_up else None
    row_vector = plgpu.Layout.WGMMA.reduce(1)

    def packed_cols(f: int) -> tuple[int, int]:
        """Columns of the gate and up values of hidden column f within a packed tile (f a multiple of epi_n)."""
        gate = 2 * pack * (f // pack) + f % pack
        return gate, gate + pack

    def prefetch(wg_row0, ni):
        if not self_loads:
            return
        # The buffers were last read by the previous tile's epilogue: every thread of the warpgroup must be done with
        # them (barrier) and those generic-proxy reads ordered before the TMA's writes (fence): commit_smem is both.
        plgpu.commit_smem()
        rows = pl.ds(pl.multiple_of(wg_row0, ROW_ALIGN), wg_m)
        if epi.row_scale:
            plgpu.copy_gmem_to_smem(row_scale_gmem.at[rows], row_scale_smem.at[wg], loaded.at[wg])
        if gate_up_smem is not None:
            gate_up_tile = gate_up_gmem.at[rows, pl.ds(2 * ni * bn, 2 * bn)]
            plgpu.copy_gmem_to_smem(gate_up_tile, gate_up_smem.at[wg], loaded.at[wg])
        if epi.scaled_gate_up:
            blocks = gate_up_scales_smem.shape[1]
            scales_tile = gate_up_scales_gmem.at[pl.ds(ni * blocks, blocks), rows]
            plgpu.copy_gmem_to_smem(scales_tile, gate_up_scales_smem.at[wg], loaded.at[wg])

    def scaled(value, scale):
        return value if scale is None else value * lax.broadcast_in_dim(scale, value.shape, [0])

    # Forward (and plain): a function per stored value, computing it from the accumulator; forward_targets lists
    # the stores in the same order. Chunks of one hidden column block go together, in column order, so that every
    # chunk past the tile's last column follows every stored one (pipe.store_chunk's rule).
    def forward_values(acc, scale) -> list[Callable]:
        def cast(value):
            return value.astype(out_dtype)

        if epi.activation is None:
            values = []
            for chunk in pipe.column_chunks(acc, epi_n):
                values += [functools.partial(cast, chunk)] * epi.keep_acc
                values.append(lambda chunk=chunk: cast(scaled(chunk, scale)))
            return values

        def rounded(gate, up):
            """The kept (gate, up), f32 values of out_dtype."""
            if epi.keep_rounding is None:
                return tuple(cast(value).astype(jnp.float32) for value in (gate, up))
            return epi.keep_rounding(gate, up)

        def kept(gate, up, i):
            return cast(rounded(gate, up)[i])

        chunks = [tuple(acc[:, col : col + epi_n] for col in packed_cols(f)) for f in range(0, bn // 2, epi_n)]
        hidden = [lambda gate=gate, up=up: cast(scaled(epi.activation(gate, up), scale)) for gate, up in chunks]
        if epi.keep_blocks:
            block, block_scale = _kept_block(chunks, rounded)
            return [block, *hidden, block_scale]
        values = []
        for (gate, up), h in zip(chunks, hidden, strict=True):
            values += [functools.partial(kept, gate, up, i) for i in range(2)] * epi.keep_acc
            values.append(h)
        return values

    def forward_targets(ni) -> list:
        """(buffer, dst_gmem, col, num_cols) of each of forward_values' stored values (with keep_blocks, not of the
        last value: the block scales)."""
        out_gmem, *acc_gmem = out_gmems  # acc_gmem: [the accumulator's output] with keep_acc, else []
        targets = []
        if epi.activation is None:
            for f in range(0, bn, epi_n):
                targets += [(out_smem, dst, ni * bn + f, cols) for dst in acc_gmem]
                targets.append((out_smem, out_gmem, ni * bn + f, cols))
            return targets
        hidden = [(out_smem, out_gmem, ni * (bn // 2) + f, cols // 2) for f in range(0, bn // 2, epi_n)]
        if epi.keep_blocks:
            # The tile's one block first: it is stored wherever a hidden chunk is (pipe.store_chunk's order rule).
            return [(kept_smem, acc_gmem[0], ni * bn, cols), *hidden]
        for f, h in zip(range(0, bn // 2, epi_n), hidden, strict=True):
            targets += [(out_smem, dst, ni * bn + col, cols) for dst in acc_gmem for col in packed_cols(f)]
            targets.append(h)
        return targets

    def prepare(acc):
        if epi.backward:
            return pipe.column_chunks(acc, epi_n)  # d_h before the row scale, f32
        scale = None
        if epi.row_scale:
            plgpu.barrier_wait(loaded.at[wg])
            scale = plgpu.load(row_scale_smem.at[wg], layout=row_vector)
        values = forward_values(acc, scale)
        # Values that ride the loop carry are computed now. Otherwise each is computed in its store's branch: its
        # temporaries then live next to the accumulator one value at a time (all at once, gpt_oss's kept
        # pre-activation and clamps spilled registers at 256 columns).
        return tuple(value() for value in values) if overlap else values

    def stores(values, mi, ni, wg_row0, wg_first, wg_rows, ring_step):
        rows = (wg_row0, wg_first, wg_rows)
        if not epi.backward:
            targets = forward_targets(ni)
            chunks = values[: len(targets)]
            stored = [
                functools.partial(pipe.store_chunk, c, value, buffer, wg, dst, *rows, col, num_cols)
                for c, (value, (buffer, dst, col, num_cols)) in enumerate(zip(chunks, targets, strict=True))
            ]
            if epi.keep_blocks:
                stored.append(functools.partial(store_block_scales, values[-1], mi, ni, wg_rows))
            return stored
        return [functools.partial(backward_store, c, d_h, mi, ni, rows, ring_step) for c, d_h in enumerate(values)]

    def store_block_scales(block_scale, mi, ni, wg_rows):
        """The tile's kept block scales [wg_block_m] (keep_blocks), after its other stores: the first of those waited
        for every earlier store, so the buffer's previous store has read it."""
        kept_scales_smem.at[wg][...] = block_scale
        _store_partial(kept_scales_smem.at[wg], out_gmems[2].at[ni, mi, pl.ds(wg * wg_m, wg_m)], wg_rows)

    def gate_up_chunk(c, gate_col, up_col, ring_step):
        """This consumer's rows of chunk c's gate and up blocks, [wg_block_m, epilogue_n] each in their dtype (f32,
        dequantized, for an FP8 pre-activation)."""
        if not gate_up_in_ring:
            tiles = [gate_up_smem.at[wg, :, pl.ds(col, epi_n)] for col in (gate_col, up_col)]
            values = [plgpu.load(tile, layout=plgpu.Layout.WGMMA) for tile in tiles]
            if not epi.scaled_gate_up:
                return values
            scale = plgpu.load(gate_up_scales_smem.at[wg, gate_col // SCALED_GATE_UP_BLOCK], layout=row_vector)
            return [scaled(value.astype(jnp.float32), scale) for value in values]
        x_smem, w_smem, produced, consumed = ring
        slot = lax.rem(ring_step + c, cfg.num_stages)  # gate in the x buffer, up in the weights' (see the producer)
        plgpu.barrier_wait(produced.at[slot])
        own_rows = pl.ds(pl.multiple_of(wg * wg_m, wg_m), wg_m)
        gate, up = (plgpu.load(buf.at[slot, own_rows], layout=plgpu.Layout.WGMMA) for buf in (x_smem, w_smem))
        # The values are in registers; once those generic-proxy reads are ordered before the async proxy's next
        # write (commit_smem's fence), the slot can take the producer's next load.
        plgpu.commit_smem()
        plgpu.barrier_arrive(consumed.at[slot])
        return gate, up

    def backward_store(c, d_h_unscaled, mi, ni, rows, ring_step):
        """Hidden column chunk c: d_gate, d_up and h * row_scale from d_h and the packed pre-activation, and this
        chunk's share of the row-scale gradient's partial sums (accumulated in shared memory, stored after the last
        chunk)."""
        d_gate_up_gmem, hidden_gmem, *partials_gmem = out_gmems
        if c == 0 and self_loads:
            plgpu.barrier_wait(loaded.at[wg])
        scale = plgpu.load(row_scale_smem.at[wg], layout=row_vector) if epi.row_scale else None
        f = c * epi_n
        gate_col, up_col = packed_cols(f)
        gate, up = gate_up_chunk(c, gate_col, up_col, ring_step)

        def grads():
            """(h, d_gate, d_up) of the chunk, f32."""
            d_h = scaled(d_h_unscaled, scale)
            return epi.activation_grad(gate.astype(jnp.float32), up.astype(jnp.float32), d_h)

        computed = None if epi.recompute_grads else grads()

        def grad(i):
            """Output i of grads(): with recompute_grads computed where it is called (a store's branch)."""
            return grads()[i] if computed is None else computed[i]

        def hidden_out():
            """h * row_scale for the store; with a row scale, the chunk's h · d_h row sums also join the partial
            sums here (a chunk wholly past C stores nothing and adds nothing)."""
            hidden = grad(0)
            if epi.row_scale:
                add_partial(c, hidden * d_h_unscaled, ni * bn + f)
            return scaled(hidden, scale).astype(out_dtype)

        outputs = [
            (lambda: grad(1).astype(out_dtype), d_gate_up_gmem, 2 * ni * bn + gate_col, 2 * cols),
            (lambda: grad(2).astype(out_dtype), d_gate_up_gmem, 2 * ni * bn + up_col, 2 * cols),
            (hidden_out, hidden_gmem, ni * bn + f, cols),
        ]
        for i, (value, dst, col, num_cols) in enumerate(outputs):
            pipe.store_chunk(3 * c + i, value, out_smem, wg, dst, *rows, col, num_cols)
        if epi.row_scale and c == bn // epi_n - 1:
            _store_partial(partial_smem.at[wg], partials_gmem[0].at[ni, mi, pl.ds(wg * wg_m, wg_m)], rows[2])

    def add_partial(c, contribution, col0):
        """Adds the row sums of chunk c's h · d_h [wg_block_m, epilogue_n] (its first column col0) to the
        consumer's partial sums in shared memory (chunk 0 starts them)."""
        if cols % epi_n:
            # The chunk may run past C (a chunk wholly past it stores nothing and adds nothing): its TMA-loaded
            # values there are not data (NaN under the interpreter), keep them out of the sum.
            col = col0 + plgpu.broadcasted_iota(jnp.int32, contribution.shape, 1, layout=plgpu.Layout.WGMMA)
            contribution = jnp.where(col < cols, contribution, 0.0)
        partial = jnp.sum(contribution, axis=1)
        if c > 0:
            # (Chunk 0's stores waited for every earlier store, so the buffer's previous store has read it.)
            partial = partial + plgpu.load(partial_smem.at[wg], layout=row_vector)
        partial_smem.at[wg][...] = partial

    def empty():
        if epi.backward:
            return pipe.empty_chunks(bn // epi_n, wg_m, epi_n, jnp.float32)
        return pipe.empty_chunks(len(forward_targets(0)), wg_m, epi_n, out_dtype)

    return _EpilogueFns(prefetch, epi.backward, prepare, stores, empty)


def _kept_block(chunks, rounded) -> tuple[Callable, jax.Array]:
    """(a function computing the tile's kept block [R, SCALED_GATE_UP_BLOCK] in FP8, each row's block scale [R] f32)
    from ``chunks``, the tile's (gate, up) [R, epilogue_n] f32 accumulator chunks, and ``rounded(gate, up)``, the
    kept values before quantization. The block leaves as one chunk of 128 one-byte columns: its rows are 128 bytes,
    as the bf16 chunks' are, so a partial store's one-row TMA boxes start on 128-byte boundaries (64-column FP8
    chunks would start them on 64-byte ones, a misaligned-address fault on the GPU). Each value is rounded where it is
    used (for the amax, then in the store's branch), so no rounded copy of the tile stays in registers."""

    def block():
        """The tile's rounded values in packed order ([gate | up] of its pack = epilogue_n columns each), f32."""
        pairs = [rounded(gate, up) for gate, up in chunks]
        return [gate for gate, _ in pairs] + [up for _, up in pairs]

    amax = None
    for value in block():
        chunk_amax = jnp.max(jnp.abs(value), axis=1)
        amax = chunk_amax if amax is None else jnp.maximum(amax, chunk_amax)
    block_scale = quant_reference.scales_from_amax(amax, KEPT_BLOCKS_DTYPE, pow2_scales=False)
    reciprocal = quant_reference.reciprocals(block_scale)

    def quantized():
        values = plgpu.layout_cast(lax.concatenate(block(), 1), plgpu.Layout.WGMMA)
        per_element = lax.broadcast_in_dim(reciprocal, values.shape, [0])
        return quant_reference.scaled_values(values, per_element, KEPT_BLOCKS_DTYPE)

    return quantized, block_scale


def _store_partial(partial_smem, dst_gmem, wg_rows) -> None:
    """Stores one consumer's [wg_block_m] partial sums (none when it stores no rows: nobody reads those)."""

    @pl.when(wg_rows > 0)
    def _():
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(partial_smem, dst_gmem, commit_group=False)
        plgpu.commit_smem_to_gmem_group()
