"""Mosaic GPU (sm90) gating kernel: router logits -> scores, top-k selection, weights and counting-sort ranks.

One CTA (one warpgroup) gates a block of 64 tokens, reading their [64, E] logits into registers in the wgmma
layout (thread i holds two rows and E/4 columns of them; a reduction along E is a few in-register steps and two
shuffles). Past a few hundred experts the row no longer fits the registers, and ``config.chunk_experts`` splits it:
each [64, C] chunk is read again from L2 in each pass (the softmax's max and sum, the group scores, the selection,
the selected scores) and gives its own top k; the same top-k rounds over all chunks' candidates then give the top k
of the row (the top k of a union is the top k of the parts' top k's, under the same order). It writes, for block b:

  probs   [64, E] f32  softmax probabilities, or sigmoid scores divided by their row sum
  experts [64, k]      selected experts, best first, ties to the lower id
  weights [64, k]      selected (unbiased) scores, renormalised and scaled
  ranks   [64, k]      for assignment (t, j) with expert e: the tokens before t *in this block* that also chose e
  counts  [E]          row b of the per-block histogram
and, with ``statistics`` (what the aux losses average, so that they need no pass over [T, E] of their own):

  logsumexp [64] f32   each token's logsumexp of its logits (what the z-loss squares), as jax.nn.logsumexp computes it
  prob_sums [E] f32    row b of the per-block column sums of probs over real tokens (the load-balancing loss's mean)

The caller finishes the counting sort: an exclusive cumsum of ``counts`` over blocks and experts gives each block's
first row per expert, and ``position = first[b, e] + rank`` is the stable expert-sorted row of the assignment (within
an expert, by token; a token picks an expert at most once, so by token then slot).

Selection follows the reference (reference.py; docs/design.md) step by step: ``s = score + bias``; NaN becomes -inf (so
a NaN never wins and an expert id is always in range); with groups, each group scores the sum of its two best, the
``top_groups`` best groups stay eligible and the rest become -inf; then k rounds of "the largest untaken value, the
lowest id among equals", compared as int32 keys in the order of the f32 values (``_order_key``) so that a taken expert
can sit below -inf. Every step compares exact f32 values, so the result is the reference's whenever the f32 scores are.

The in-block ranks are one matmul: with S[t, e] = 1 when token t chose e (bf16, exact) and L the strictly lower
triangular [64, 64] matrix of ones, (L @ S)[t, e] counts the earlier tokens that chose e, exactly in the f32
accumulator; wgmma does it in chunks of at most 256 experts. A block's rank of (t, j) is then row t of that product
read at column e_tj (a masked row sum).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.routing.config import BLOCK_TOKENS, Config

_LAYOUT = plgpu.Layout.WGMMA
_ROW = _LAYOUT.reduce(1)  # [64] per-token vectors
_COL = _LAYOUT.reduce(0)  # [E] per-expert vectors
_LAYOUT_COLUMNS = 8  # columns of one register tile of the layout
_TAKEN = jnp.iinfo(jnp.int32).min  # the order key of an expert already selected


def _rows_to_tile(vector, num_cols: int):
    """[64] per-token vector -> [64, num_cols], constant along the row."""
    return plgpu.layout_cast(lax.broadcast_in_dim(vector, (BLOCK_TOKENS, num_cols), (0,)), _LAYOUT)


def _cols_to_tile(vector):
    """[E] per-expert vector -> [64, E], constant down a column."""
    return plgpu.layout_cast(lax.broadcast_in_dim(vector, (BLOCK_TOKENS, vector.shape[0]), (1,)), _LAYOUT)


def _masked(mask, value):
    return jnp.where(mask, value, -jnp.inf)


def _order_key(values):
    """f32 -> int32 keys with the same order (-0.0 equal to +0.0); NaN must be gone. No key equals _TAKEN."""
    # An f32's bits read as int32 order the non-negative floats; the negative ones order backwards, so their 31
    # value bits are flipped. -inf maps to 0x807FFFFF, above _TAKEN; only a NaN could map to _TAKEN itself.
    bits = lax.bitcast_convert_type(values + 0.0, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _false(shape, layout):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.bool_), layout)


def gating(
    logits: jax.Array,
    bias: jax.Array | None,
    *,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    score: str,
    renormalize: bool,
    num_groups: int,
    top_groups: int,
    scale: float,
    config: Config,
    statistics: bool,
    interpret=None,
):
    """Runs the gating kernel over T (padded to a multiple of 64) tokens.

    Args:
      logits: [T_pad, E_pad] f32, T_pad a multiple of 64 and E_pad = ``config.padded_experts``; padding is -inf.
      bias: optional [E_pad] f32 selection bias.
      num_tokens, num_experts: the real T and E (rows past T are gated but not counted).
      top_k, score, renormalize, num_groups, top_groups, scale: as in ``moe_jax.route``.
      config: see ``Config``.
      statistics: also return logsumexp and prob_sums.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      (probs [T_pad, E_pad] f32, experts [T_pad, k] int32, weights [T_pad, k] f32, ranks [T_pad, k] int32,
      counts [T_pad / 64, E_pad] int32), with ``statistics`` followed by logsumexp [T_pad] f32 and prob_sums
      [T_pad / 64, E_pad] f32, as the module docstring defines them.
    """
    padded_tokens, padded_experts = logits.shape
    num_blocks = padded_tokens // BLOCK_TOKENS
    chunk = config.chunk_experts
    num_chunks = padded_experts // chunk
    has_bias = bias is not None
    group_width = num_experts // num_groups
    if num_chunks > 1 and (top_k > chunk or (num_groups > 1 and chunk % group_width)):
        raise ValueError(
            f"config.chunk_experts={chunk} must be >= top_k={top_k} and hold whole groups of {group_width} experts"
        )

    candidate_columns = -(-num_chunks * top_k // _LAYOUT_COLUMNS) * _LAYOUT_COLUMNS

    def chunk_columns(c: int):
        return pl.ds(c * chunk, chunk)

    def chunk_ids(c: int):
        """[64, C] expert ids of chunk c's columns."""
        return c * chunk + plgpu.broadcasted_iota(jnp.int32, (BLOCK_TOKENS, chunk), 1, layout=_LAYOUT)

    def row_statistics(logits_chunk):
        """Over all chunks: (peak, sum of exp(x - shift(peak))) for softmax, (None, sum of sigmoid(x)) for sigmoid."""
        # Generators, so that a chunk's tile dies once it is reduced.
        if score == "softmax":
            peak = functools.reduce(jnp.maximum, (jnp.max(logits_chunk(c), axis=1) for c in range(num_chunks)))
            terms = (jnp.exp(logits_chunk(c) - _rows_to_tile(shift(peak), chunk)) for c in range(num_chunks))
        else:
            peak = None
            terms = (jax.nn.sigmoid(logits_chunk(c)) for c in range(num_chunks))
        return peak, functools.reduce(lax.add, (jnp.sum(term, axis=1) for term in terms))

    def finite(values):
        return (values > -jnp.inf) & (values < jnp.inf)

    def shift(peak):
        """jax.nn.logsumexp's shift: the peak where it is finite, else 0 (a row of -inf then sums to 0, log -inf)."""
        return jnp.where(finite(peak), peak, 0.0)

    def exp_sum(x):
        """(peak, sum of exp(x - shift(peak))) of a [64, C] tile's rows."""
        peak = jnp.max(x, axis=1)
        return peak, jnp.sum(jnp.exp(x - _rows_to_tile(shift(peak), x.shape[1])), axis=1)

    def logsumexp(chunk_exp_sums):
        """A row's logsumexp from its chunks' ``exp_sum``s, rescaled to the row's shift (the same arithmetic as
        jax.nn.logsumexp's for one chunk; a chunk of only -inf adds 0 whatever the shift)."""
        row_shift = shift(functools.reduce(jnp.maximum, (peak for peak, _ in chunk_exp_sums)))
        terms = (jnp.where(s == 0.0, 0.0, s * jnp.exp(shift(peak) - row_shift)) for peak, s in chunk_exp_sums)
        return jnp.log(functools.reduce(lax.add, terms)) + row_shift

    def chunk_scores(x, peak, total):
        """(scores, probs) of one chunk's logits: jax.nn.softmax's arithmetic (max, exp, sum, divide), or sigmoid."""
        if score == "softmax":
            # A non-finite peak (a +inf or NaN in the row, or only -inf) makes jax.nn.softmax's row all NaN.
            divisor = jnp.where(finite(peak), total, jnp.nan)
            scores = jnp.exp(x - _rows_to_tile(shift(peak), chunk)) / _rows_to_tile(divisor, chunk)
            return scores, scores
        scores = jax.nn.sigmoid(x)
        return scores, scores / _rows_to_tile(total, chunk)

    def chunk_groups(c: int) -> range:
        """The groups whose columns lie in chunk c (a chunk holds whole groups)."""
        return range(c * chunk // group_width, min(num_groups, (c + 1) * chunk // group_width))

    def group_columns(selection, expert_id, g: int, c: int):
        """Group g's selection values and expert ids within chunk c: its own columns where a group is whole register
        tiles of the layout (the slice is register renaming, and the group's reductions touch E / num_groups
        columns), else the chunk's tile with -inf and the id E_pad outside the group."""
        first, end = g * group_width - c * chunk, (g + 1) * group_width - c * chunk
        if group_width % _LAYOUT_COLUMNS == 0:
            return selection[:, first:end], expert_id[:, first:end]
        member = (expert_id >= g * group_width) & (expert_id < (g + 1) * group_width)
        return _masked(member, selection), jnp.where(member, expert_id, padded_experts)

    def group_score(selection, expert_id, g: int, c: int):
        """Per token: the sum of group g's two best selection values (NaN -> -inf)."""
        values, ids = group_columns(selection, expert_id, g, c)
        best = jnp.max(values, axis=1)
        if group_width > 1:
            at = _rows_to_tile(best, values.shape[1])
            first = jnp.min(jnp.where(values == at, ids, padded_experts), axis=1)
            best = best + jnp.max(_masked(ids != _rows_to_tile(first, values.shape[1]), values), axis=1)
        return jnp.where(best != best, -jnp.inf, best)

    def top_groups_chosen(group_scores):
        """Per group, whether it is among the token's ``top_groups`` best (ties to the lower group id)."""
        chosen = [_false((BLOCK_TOKENS,), _ROW)] * num_groups
        for _ in range(top_groups):
            best = _masked(~chosen[0], group_scores[0])
            for g in range(1, num_groups):
                best = jnp.maximum(best, _masked(~chosen[g], group_scores[g]))
            found = _false((BLOCK_TOKENS,), _ROW)
            for g in range(num_groups):
                pick = ~chosen[g] & ~found & (group_scores[g] == best)
                chosen[g] = chosen[g] | pick
                found = found | pick
        return chosen

    def eligible(chosen_groups, expert_id, c: int):
        # From each column's group id rather than from the masks of group_columns: reusing those would keep
        # num_groups [64, C] bool tiles live until here (a tile is C / 2 registers per thread; the kernel spilled).
        group_id = lax.div(expert_id, jnp.int32(group_width))
        mask = _false(expert_id.shape, _LAYOUT)
        for g in chunk_groups(c):
            mask = mask | ((group_id == g) & _rows_to_tile(chosen_groups[g], chunk))
        return mask

    def top_k_rounds(key, expert_id, write):
        """k rounds over a [64, N] tile of order keys and the ids of their experts: round j passes its best key and
        that key's expert (the lowest id among equal keys) to ``write(j, best, expert)``."""
        # The rounds compare int32 order keys (``_order_key``): a taken expert's key becomes _TAKEN, below every
        # other key, -inf's included, so one [64, N] tile carries both the values and what was taken (the kernel is
        # register-bound; one such tile is N / 2 registers per thread). A loop, not k unrolled copies: unrolled, the
        # kernel's straight-line code overflowed the instruction cache and its warps mostly waited for instructions.
        width = key.shape[1]

        def one_round(j, key):
            best = jnp.max(key, axis=1)
            expert = jnp.min(jnp.where(key == _rows_to_tile(best, width), expert_id, padded_experts), axis=1)
            write(j, best, expert)
            # The constant goes in the false branch: with a constant true branch, jax 0.11.2's Mosaic GPU `select`
            # takes its result's signedness from the (unsigned) predicate, and the next max would compare unsigned.
            return jnp.where(expert_id != _rows_to_tile(expert, width), key, _TAKEN)

        lax.fori_loop(0, top_k, one_round, key)

    def load_row(ref):
        return plgpu.load(ref, layout=_ROW, optimized=False)

    def row_of(value):
        return plgpu.layout_cast(jnp.full((BLOCK_TOKENS,), value, jnp.int32), _ROW)

    def add_slot_sums(tile, expert_id, picks, sums, first: bool, mark_picked: bool):
        """For each slot j, adds to ``sums[j]`` [64] the row sums of ``tile`` [64, C] at the column of the slot's
        expert (zero where ``expert_id``, the tile's column ids, does not hold it; ``first`` starts the sums).

        Returns, with ``mark_picked``, the [64, C] tile of picked columns (1.0 or 0.0), else None."""
        width = tile.shape[1]

        def slot(j, picked):
            hit = expert_id == _rows_to_tile(load_row(picks.at[j]), width)
            row_sum = jnp.sum(jnp.where(hit, tile, 0.0), axis=1)
            sums[j] = row_sum if first else load_row(sums.at[j]) + row_sum
            return jnp.where(hit, 1.0, picked) if mark_picked else picked

        no_picks = plgpu.layout_cast(jnp.zeros(tile.shape, jnp.float32), _LAYOUT) if mark_picked else None
        return lax.fori_loop(0, top_k, slot, no_picks)

    def block_ranks(chosen_smem, lower_smem, picks, slot_ranks):
        """Writes per slot the earlier tokens of the block that chose the same expert (module docstring) to
        ``slot_ranks`` [k, 64] f32 (exact integers)."""
        row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_TOKENS, BLOCK_TOKENS), 0, layout=_LAYOUT)
        col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_TOKENS, BLOCK_TOKENS), 1, layout=_LAYOUT)
        lower_smem[...] = jnp.where(col < row, 1.0, 0.0).astype(jnp.bfloat16)
        plgpu.commit_smem()
        rank_chunk = config.rank_chunk
        for first in range(0, padded_experts, rank_chunk):

            def prefix_counts(acc_ref, first=first):
                plgpu.wgmma(acc_ref, lower_smem, chosen_smem.at[:, pl.ds(first, rank_chunk)])
                return acc_ref[...]

            earlier = pl.run_scoped(prefix_counts, plgpu.ACC((BLOCK_TOKENS, rank_chunk), jnp.float32))
            expert_id = first + plgpu.broadcasted_iota(jnp.int32, (BLOCK_TOKENS, rank_chunk), 1, layout=_LAYOUT)
            add_slot_sums(earlier, expert_id, picks, slot_ranks, first=first == 0, mark_picked=False)

    def write_slots(rows, picks, slot_weights, slot_ranks, experts_gmem, weights_gmem, ranks_gmem):
        """Renormalises and scales the weights (summed in slot order) and writes the block's [64, k] outputs."""
        if renormalize:
            zeros = plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS,), jnp.float32), _ROW)
            total = lax.fori_loop(0, top_k, lambda j, total: total + load_row(slot_weights.at[j]), zeros)

        def slot(j, carry):
            weight = load_row(slot_weights.at[j])
            experts_gmem[rows, j] = load_row(picks.at[j])
            weights_gmem[rows, j] = (weight / total if renormalize else weight) * scale
            ranks_gmem[rows, j] = load_row(slot_ranks.at[j]).astype(jnp.int32)
            return carry

        lax.fori_loop(0, top_k, slot, None)

    def body(logits_gmem, *refs):
        refs = list(refs)
        bias_gmem = refs.pop(0) if has_bias else None
        probs_gmem, experts_gmem, weights_gmem, ranks_gmem, counts_gmem = refs[:5]
        statistics_gmem = refs[5:7] if statistics else None
        chosen_smem, lower_smem, picks, slot_weights, slot_ranks, *candidates = refs[7 if statistics else 5 :]
        block = lax.axis_index("block")
        rows = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)

        def load_chunk(c: int):
            return plgpu.load(logits_gmem.at[rows, chunk_columns(c)], layout=_LAYOUT, optimized=False)

        # One chunk stays in registers from its one load; several are loaded again where used (from L2), so that
        # only one chunk's tiles are live at a time.
        whole = load_chunk(0) if num_chunks == 1 else None
        logits_chunk = (lambda c: whole) if num_chunks == 1 else load_chunk

        def selection_of(c: int, scores, expert_id):
            selection = scores
            if has_bias:
                bias_chunk = plgpu.load(bias_gmem.at[chunk_columns(c)], layout=_COL, optimized=False)
                selection = selection + _cols_to_tile(bias_chunk)
            # NaN never wins (it becomes -inf); padding experts are never eligible.
            return _masked((selection == selection) & (expert_id < num_experts), selection)

        peak, total = row_statistics(logits_chunk)
        if num_groups > 1:
            group_scores = []
            for c in range(num_chunks):
                expert_id = chunk_ids(c)
                selection = selection_of(c, chunk_scores(logits_chunk(c), peak, total)[0], expert_id)
                group_scores += [group_score(selection, expert_id, g, c) for g in chunk_groups(c)]
            chosen_groups = top_groups_chosen(group_scores)

        def write_pick(j, best, expert):
            del best
            picks[j] = expert

        def real_tokens_only(tile):
            """Zeros the rows of padding tokens (past T): they are gated, but neither counted nor averaged."""
            if num_tokens == padded_tokens:
                return tile
            token = block * BLOCK_TOKENS + plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=_LAYOUT)
            return jnp.where(token < num_tokens, tile, 0.0)

        for c in range(num_chunks):
            expert_id = chunk_ids(c)
            scores, probs = chunk_scores(logits_chunk(c), peak, total)
            probs_gmem[rows, chunk_columns(c)] = probs
            selection = selection_of(c, scores, expert_id)
            if num_groups > 1:
                selection = _masked(eligible(chosen_groups, expert_id, c), selection)
            if num_chunks == 1:
                top_k_rounds(_order_key(selection), expert_id, write_pick)
                continue

            def write_candidate(j, best, expert, c=c):
                candidates[0][:, c * top_k + j] = best
                candidates[1][:, c * top_k + j] = expert

            top_k_rounds(_order_key(selection), expert_id, write_candidate)
        if num_chunks > 1:
            # The top k of all experts is the top k of the chunks' top k's: the same rounds over the [64, chunks * k]
            # candidates (padded to whole register tiles with taken keys), their ids read back with them.
            for column in range(num_chunks * top_k, candidates[0].shape[1]):
                candidates[0][:, column] = row_of(_TAKEN)
                candidates[1][:, column] = row_of(padded_experts)
            keys, ids = (plgpu.load(ref, layout=_LAYOUT, optimized=False) for ref in candidates)
            top_k_rounds(keys, ids, write_pick)

        # The selected scores and the choice per expert, chunk by chunk. With several chunks the scores are computed
        # again from the logits (the same arithmetic, so the same bits) rather than kept live across the selection;
        # with one they are the same values.
        for c in range(num_chunks):
            expert_id = chunk_ids(c)
            scores, _ = chunk_scores(logits_chunk(c), peak, total)
            # Each slot's selected score: exactly one chunk holds its expert, the others add zeros.
            chosen = add_slot_sums(scores, expert_id, picks, slot_weights, first=c == 0, mark_picked=True)
            chosen = real_tokens_only(chosen)
            counts_gmem[block, chunk_columns(c)] = jnp.sum(chosen, axis=0).astype(jnp.int32)
            chosen_smem[:, chunk_columns(c)] = chosen.astype(jnp.bfloat16)
        block_ranks(chosen_smem, lower_smem, picks, slot_ranks)
        write_slots(rows, picks, slot_weights, slot_ranks, experts_gmem, weights_gmem, ranks_gmem)
        if not statistics:
            return
        # The block's logsumexps and column sums of probs come last, when the selection's registers are free: inside
        # the passes above these reductions make the kernel spill (deepseek-v3's router runs 39% slower so on an
        # H100); here they cost reading the chunks once more.
        logsumexp_gmem, prob_sums_gmem = statistics_gmem
        chunk_exp_sums = []
        for c in range(num_chunks):
            x = logits_chunk(c)
            probs = chunk_scores(x, peak, total)[1]
            prob_sums_gmem[block, chunk_columns(c)] = jnp.sum(real_tokens_only(probs), axis=0)
            if score == "sigmoid":
                chunk_exp_sums.append(exp_sum(x))
        # The softmax's total is already logsumexp's sum.
        logsumexp_gmem[rows] = jnp.log(total) + shift(peak) if score == "softmax" else logsumexp(chunk_exp_sums)

    def swizzled(swizzle: int):
        return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    per_token = (padded_tokens, top_k)
    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((padded_tokens, padded_experts), jnp.float32),
            jax.ShapeDtypeStruct(per_token, jnp.int32),
            jax.ShapeDtypeStruct(per_token, jnp.float32),
            jax.ShapeDtypeStruct(per_token, jnp.int32),
            jax.ShapeDtypeStruct((num_blocks, padded_experts), jnp.int32),
            *(
                [
                    jax.ShapeDtypeStruct((padded_tokens,), jnp.float32),
                    jax.ShapeDtypeStruct((num_blocks, padded_experts), jnp.float32),
                ]
                if statistics
                else []
            ),
        ),
        scratch_types=[
            plgpu.SMEM((BLOCK_TOKENS, padded_experts), jnp.bfloat16, transforms=swizzled(config.swizzle)),
            plgpu.SMEM((BLOCK_TOKENS, BLOCK_TOKENS), jnp.bfloat16, transforms=swizzled(config.swizzle)),
            plgpu.SMEM((top_k, BLOCK_TOKENS), jnp.int32),  # per slot: the expert
            plgpu.SMEM((top_k, BLOCK_TOKENS), jnp.float32),  # per slot: the selected score
            plgpu.SMEM((top_k, BLOCK_TOKENS), jnp.float32),  # per slot: the in-block rank
            # with several chunks, their candidates: keys and experts, [64, chunks * k] padded to whole register tiles
            *([plgpu.SMEM((BLOCK_TOKENS, candidate_columns), jnp.int32)] * 2 if num_chunks > 1 else []),
        ],
        grid=(num_blocks,),
        grid_names=("block",),
        kernel_name="moe_gating",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return kernel(logits, *([bias] if has_bias else []))
