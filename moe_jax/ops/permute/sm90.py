"""Mosaic GPU (sm90) row movement between token order [T, D] and expert order [M = T * k, D].

Both kernels are indexed by *token*, through ``positions[t, j]``: the expert-sorted row of assignment (t, j), i.e.
the inverse of ``Routing.sort_indices``. So every token row is read once and every expert-sorted row is touched
once, whichever way the data flows:

  scatter_rows  out[positions[t, j]] = w[t, j] * x[t]          permute (w = 1) and the backward of combine
                (optionally dw[t, j] = <x[t], dot_rows[positions[t, j]]>: the weight gradient of combine)
  gather_rows   out[t] = sum_j w[t, j] * rows[positions[t, j]]  combine and the backward of permute (w = 1)

A position may be *absent* (``combine`` over the first ``num_rows`` rows only): it is stored as ``-1 - p`` for row p.
gather_rows adds zero for it and reads row 0 in its place (one cached row, not row p); scatter_rows writes zeros to
row p and a zero dot product (reading row 0 for it), so that the gradient of an absent row is exactly zero.

A CTA owns ``tokens_per_block`` consecutive tokens (the last CTA repeats token T - 1 instead of branching: it rewrites
the same rows with the same values). A row is moved as register chunks of ``128 * vec_size`` columns in the
warpgroup-strided layout: lane l holds columns [l * vec_size, (l + 1) * vec_size) of the chunk, so each access is
16 bytes per lane and a warp covers whole cache lines. Where the chunk does not divide D the last chunk ends at D and
overlaps the one before (``Config.chunk_starts``): stores write the overlap twice with equal values, and the weight
gradient's dot product leaves the overlap out of the last chunk. There is no shared memory and no TMA: a row's
destination differs per (token, slot), and plain vector loads and stores need no descriptor per row. Latency is
hidden by issuing all of a CTA's loads before its stores (the compiler cannot hoist a load above a store to another
buffer) and by running many small CTAs per SM. Sums are in f32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.permute.config import MAX_CHUNKS_IN_FLIGHT, Config

# No thread reads what another wrote (no shared memory), so the warpgroup barriers Mosaic puts around every store
# would only serialise the stores.
_COMPILER_PARAMS = plgpu.CompilerParams(
    lowering_semantics=plgpu.LoweringSemantics.Lane,
    unsafe_no_auto_barriers=True,
)


def _block_tokens(num_tokens: int, config: Config) -> list:
    """The tokens of this CTA, clamped to T - 1 (the tail CTA repeats the last token rather than branching)."""
    first = lax.axis_index("block") * config.tokens_per_block
    return [jnp.minimum(first + u, num_tokens - 1) for u in range(config.tokens_per_block)]


def _layout(config: Config):
    return plgpu.Layout.WG_STRIDED((config.chunk,), vec_size=config.vec_size)


def _load_chunk(ref, row, start: int, config: Config):
    return plgpu.load(ref.at[row, pl.ds(start, config.chunk)], layout=_layout(config))


def _store_chunk(ref, row, start: int, value, config: Config) -> None:
    ref[row, pl.ds(start, config.chunk)] = value.astype(ref.dtype)


def _without_overlap(products: list, starts: tuple[int, ...], config: Config) -> list:
    """The per-chunk products with the last chunk's columns that the chunk before it covers set to zero."""
    overlap = (len(starts) - 1) * config.chunk - starts[-1]
    if overlap == 0:
        return products
    column = plgpu.broadcasted_iota(jnp.int32, (config.chunk,), 0, layout=_layout(config))
    return products[:-1] + [jnp.where(column >= overlap, products[-1], jnp.zeros_like(products[-1]))]


def _present(value, position):
    """``value`` where ``position`` is present (>= 0), zeros where it is absent (a select: NaN or Inf cannot leak)."""
    return jnp.where(position >= 0, value, jnp.zeros_like(value))


def scatter_rows(
    x: jax.Array,
    positions: jax.Array,
    weights: jax.Array | None = None,
    dot_rows: jax.Array | None = None,
    *,
    config: Config,
    interpret=None,
):
    """``out[positions[t, j]] = weights[t, j] * x[t]``, and the dot products with ``dot_rows`` when given.

    Args:
      x: [T, D] token rows.
      positions: [T, k] int32, a permutation of [0, T * k) (every output row is written exactly once); an absent
        row p given as ``-1 - p`` is written as zeros.
      weights: optional [T, k] f32 row scales (the product is rounded once to x.dtype).
      dot_rows: optional [T * k, D] expert-sorted rows.
      config: see ``Config``; D must be at least ``128 * vec_size`` and a multiple of ``vec_size``.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      [T * k, D] in x.dtype; with ``dot_rows`` also [T, k] f32 ``dw[t, j] = sum_d x[t, d] * dot_rows[p, d]``.
    """
    num_tokens, d_model = x.shape
    top_k = positions.shape[1]
    starts = config.chunk_starts(d_model)
    weighted, with_dot = weights is not None, dot_rows is not None

    def body(*refs):
        x_gmem, pos_gmem, *refs = refs
        w_gmem = refs.pop(0) if weighted else None
        dot_gmem = refs.pop(0) if with_dot else None
        out_gmem, *refs = refs
        dw_gmem = refs.pop(0) if with_dot else None
        tokens = _block_tokens(num_tokens, config)
        # Every load of the block first: a load written after a store cannot be moved above it.
        rows = [[_load_chunk(x_gmem, t, start, config) for start in starts] for t in tokens]
        for t, chunks in zip(tokens, rows, strict=True):
            if weighted or with_dot:
                chunks = [chunk.astype(jnp.float32) for chunk in chunks]
            for j in range(top_k):
                position = pos_gmem[t, j]
                row = jnp.where(position >= 0, position, -1 - position)
                scale = w_gmem[t, j] if weighted else None
                for start, chunk in zip(starts, chunks, strict=True):
                    value = _present(chunk if scale is None else chunk * scale, position)
                    _store_chunk(out_gmem, row, start, value, config)
                if with_dot:
                    products = [
                        chunk * _load_chunk(dot_gmem, jnp.maximum(position, 0), start, config).astype(jnp.float32)
                        for start, chunk in zip(starts, chunks, strict=True)
                    ]
                    products = _without_overlap(products, starts, config)
                    dw_gmem[t, j] = _present(jnp.sum(functools.reduce(lax.add, products)), position)

    out_type = [jax.ShapeDtypeStruct((num_tokens * top_k, d_model), x.dtype)]
    if with_dot:
        out_type.append(jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32))
    kernel = plgpu.kernel(
        body,
        out_type=tuple(out_type) if with_dot else out_type[0],
        grid=(pl.cdiv(num_tokens, config.tokens_per_block),),
        grid_names=("block",),
        kernel_name="moe_scatter_rows",
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )
    operands = [x, positions] + ([weights] if weighted else []) + ([dot_rows] if with_dot else [])
    return kernel(*operands)


def gather_rows(
    rows: jax.Array,
    positions: jax.Array,
    weights: jax.Array | None = None,
    *,
    out_dtype=None,
    config: Config,
    interpret=None,
) -> jax.Array:
    """``out[t] = sum_j weights[t, j] * rows[positions[t, j]]`` (plain sum without weights), accumulated in f32.

    Args:
      rows: [T * k, D] expert-sorted rows.
      positions: [T, k] int32 row of each assignment (rows in [0, T * k); any may repeat); ``-1 - p``: absent,
        adds zero.
      weights: optional [T, k] f32.
      out_dtype: result dtype (default rows.dtype).
      config: see ``Config``; D must be at least ``128 * vec_size`` and a multiple of ``vec_size``.
      interpret: Mosaic GPU interpreter parameters, or None on a GPU.

    Returns:
      [T, D].
    """
    num_tokens, top_k = positions.shape
    d_model = rows.shape[1]
    starts = config.chunk_starts(d_model)
    # A token's k rows of ``batch`` chunks are loaded together: MAX_CHUNKS_IN_FLIGHT register chunks at most.
    batch = max(1, min(len(starts), MAX_CHUNKS_IN_FLIGHT // top_k))
    weighted = weights is not None

    def body(*refs):
        rows_gmem, pos_gmem, *refs = refs
        w_gmem = refs.pop(0) if weighted else None
        (out_gmem,) = refs
        for t in _block_tokens(num_tokens, config):
            positions = [pos_gmem[t, j] for j in range(top_k)]
            sources = [jnp.maximum(p, 0) for p in positions]
            scales = [w_gmem[t, j] for j in range(top_k)] if weighted else None
            for first in range(0, len(starts), batch):
                batch_starts = starts[first : first + batch]
                loaded = [[_load_chunk(rows_gmem, p, start, config) for p in sources] for start in batch_starts]
                for start, per_slot in zip(batch_starts, loaded, strict=True):
                    terms = [_present(v.astype(jnp.float32), p) for v, p in zip(per_slot, positions, strict=True)]
                    if weighted:
                        terms = [v * s for v, s in zip(terms, scales, strict=True)]
                    _store_chunk(out_gmem, t, start, functools.reduce(lax.add, terms), config)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_tokens, d_model), out_dtype or rows.dtype),
        grid=(pl.cdiv(num_tokens, config.tokens_per_block),),
        grid_names=("block",),
        kernel_name="moe_gather_rows",
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )
    return kernel(rows, positions, *([weights] if weighted else []))
