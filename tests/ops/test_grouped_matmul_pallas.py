"""The sm90 grouped-matmul kernels (fwd, dgrad, wgrad) under the Mosaic GPU interpreter against the reference.

The interpreter detects races and poisons uninitialised memory with NaN, so a row the kernels forget to write, a
buffer read before its TMA landed or a neighbour's row leaking into a masked wgrad chunk shows up as NaN or a large
error. Shapes are small (a few 128x128 tiles on 4 simulated SMs) but cross every ragged edge: empty groups, sizes
off multiples of 8, a group covering a whole tile and one covering two warpgroups partly, rows past the sum, M off
the tile and off 8 (the padding path), G = 1, one hot expert, both rhs layouts, bf16 and f32 outputs.

Tolerances (relative-norm error against the f32 reference on the same bf16 inputs): BF16_OUT_TOL for results
rounded to bf16 (~2^-9 relative rounding), F32_OUT_TOL for f32 results (only the reference's summation order
differs). GRAD_TOL: both sides take the same bf16 cotangent and round f32 sums to bf16, so they differ by summation
order and the odd rounding flip (measured 0-1e-4); 1e-3 leaves headroom and still fails a bf16 accumulation.
GLU_GRAD_TOL: through a fused activation the kernel's backward starts from the pre-activation kept in bf16, the
reference's from f32 (measured 3.3e-3).
"""

import dataclasses
import functools
from contextlib import nullcontext
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.ops.grouped_matmul import config, glu, launch, reference, schedule
from tests import oracle
from tests.helpers import checked_interpreter, grouped_matmul_inputs, jitted_vjp

BF16_OUT_TOL = 5e-3
F32_OUT_TOL = 1e-5
GRAD_TOL = 1e-3
GLU_GRAD_TOL = 1e-2

# (M, K, N, group sizes): each row is one ragged situation. The heuristic gives "ragged" (42 rows a group on average)
# one consumer warpgroup on 64-row tiles and the others two on 128-row tiles (config.TINY_GROUP_ROWS);
# test_forward_matches_reference also runs every case on the other tiling.
CASES = {
    "ragged": (296, 128, 192, [100, 0, 37, 3, 61, 64, 2]),  # empty, tiny, sizes off 8; rows 267.. past the sum
    "hot expert": (256, 64, 128, [0, 256, 0]),  # one group takes every row: two full tiles
    "tail tiles": (300, 64, 128, [129, 65, 70]),  # M off 8 (padded) and off the tile; a 1-row and 65-row tail
    "single group": (136, 128, 64, [130]),  # G = 1 with 6 rows past the sum
}


def _inputs(seed, m, k, n, sizes, transpose_rhs):
    lhs, rhs = grouped_matmul_inputs(np.random.default_rng(seed), m, k, n, len(sizes), transpose_rhs)
    return jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16), jnp.asarray(sizes, jnp.int32)


def _jitted_reference(lhs, rhs, group_sizes, transpose_rhs=False):
    """The reference's f32 product as one jitted program (op by op, each operation would compile on its own)."""
    fn = functools.partial(reference.grouped_matmul, transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32)
    return jax.jit(fn)(lhs, rhs, group_sizes)


@pytest.fixture
def interpret():
    """Runs the test's kernels under the checking interpreter and fails it on any detected race."""
    with checked_interpreter():
        yield


def _other_tiling(get_config):
    """get_config with the fwd / dgrad tiles the heuristic would not give the shape: 64 rows on one consumer
    warpgroup where it gives 128 on two, and the other way round."""

    def swapped(kind, **shape):
        c = get_config(kind, **shape)
        if kind not in ("fwd", "dgrad"):
            return c
        other = (128, 2) if c.num_compute_wgs == 1 else (64, 1)
        return dataclasses.replace(c, block_m=other[0], num_compute_wgs=other[1])

    return swapped


# Every case on both tilings, each with one of the two layouts (rhs [G, K, N] and a bf16 output, or [G, N, K] and f32),
# alternating so that every pair of case, layout and tiling runs; the other half of the cross-product is `slow`.
LAYOUTS = [(False, jnp.bfloat16), (True, jnp.float32)]
FORWARD_CASES = [
    pytest.param(
        case,
        *layout,
        tiling,
        id=f"{tiling}-{'k_major-f32' if layout[0] else 'bf16'}-{case}",
        marks=() if (index + (tiling == "other")) % 2 == LAYOUTS.index(layout) else pytest.mark.slow,
    )
    for index, case in enumerate(CASES)
    for tiling in ("heuristic", "other")
    for layout in LAYOUTS
]


@pytest.mark.parametrize("case, transpose_rhs, out_dtype, tiling", FORWARD_CASES)
@pytest.mark.usefixtures("interpret")
def test_forward_matches_reference(case, transpose_rhs, out_dtype, tiling):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _inputs(list(CASES).index(case), m, k, n, sizes, transpose_rhs)
    patch = (
        mock.patch.object(launch, "get_config", _other_tiling(launch.get_config))
        if tiling == "other"
        else nullcontext()
    )
    kernel = functools.partial(
        moe_jax.grouped_matmul, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype, backend="pallas"
    )
    with patch:
        out = jax.jit(kernel)(lhs, rhs, group_sizes)
    expected = _jitted_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    assert out.shape == (m, n) and out.dtype == out_dtype
    tol = F32_OUT_TOL if out_dtype == jnp.float32 else BF16_OUT_TOL
    assert oracle.relative_error(out, expected) < tol
    np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(sizes) :], 0.0)


@pytest.mark.parametrize("case, transpose_rhs", [("ragged", False), ("tail tiles", True)])
@pytest.mark.usefixtures("interpret")
def test_gradients_match_reference(case, transpose_rhs):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _inputs(7, m, k, n, sizes, transpose_rhs)
    cotangent = jnp.asarray(np.random.default_rng(8).normal(size=(m, n)), jnp.bfloat16)

    def vjp(fn):
        return jitted_vjp(lambda a, b: fn(a, b, group_sizes, transpose_rhs=transpose_rhs), (lhs, rhs), cotangent)

    kernel = vjp(lambda *a, **kw: moe_jax.grouped_matmul(*a, backend="pallas", **kw))
    expected = vjp(reference.grouped_matmul)
    for name, actual, exact in zip(("out", "d_lhs", "d_rhs"), kernel, expected, strict=True):
        assert actual.shape == exact.shape and actual.dtype == exact.dtype, name
        assert oracle.relative_error(actual, exact) < GRAD_TOL, name
    # Rows past the sum get no gradient; every d_rhs entry of an empty group is exactly zero.
    np.testing.assert_array_equal(np.asarray(kernel[1], np.float32)[sum(sizes) :], 0.0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        np.testing.assert_array_equal(np.asarray(kernel[2][g], np.float32), 0.0)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.usefixtures("interpret")
def test_negative_sizes_and_sizes_past_m(transpose_rhs):
    """A negative size counts as 0 and rows past M are dropped (api docstring): [-5, 100, 60] over M = 136 rows must
    give what the sizes [0, 100, 36] give, forward and both gradients (fwd, dgrad and wgrad kernels)."""
    m, k, n = 136, 64, 128
    lhs, rhs, _ = _inputs(5, m, k, n, [0, 0, 0], transpose_rhs)
    cotangent = jnp.asarray(np.random.default_rng(6).normal(size=(m, n)), jnp.bfloat16)

    def vjp(sizes, backend):
        group_sizes = jnp.asarray(sizes, jnp.int32)
        fn = lambda a, b: moe_jax.grouped_matmul(a, b, group_sizes, transpose_rhs=transpose_rhs, backend=backend)
        return jitted_vjp(fn, (lhs, rhs), cotangent)

    kernel = vjp([-5, 100, 60], "pallas")
    expected = vjp([0, 100, 36], "xla")
    for name, actual, exact in zip(("out", "d_lhs", "d_rhs"), kernel, expected, strict=True):
        assert oracle.relative_error(actual, exact) < GRAD_TOL, name
    np.testing.assert_array_equal(np.asarray(kernel[2][0], np.float32), 0.0)


# The overlapped epilogue stores a tile's outputs during the next tile's first steps: 128-column tiles with 64-column
# stores give two stores per consumer tile, interleaved with steps 0 and 1 of the next tile (K = 64 has one step
# only, so there the second runs after it), and each CTA walks several tiles (4 simulated SMs).
OVERLAPPED = config.Config(block_m=128, block_n=128, epilogue_n=64, overlap_epilogue=True)


# fwd and dgrad are one kernel (dgrad reads the rhs transposed): every case runs fwd and wgrad, dgrad runs two of them
# by default and the other two are `slow`.
@pytest.mark.parametrize(
    "case, kind",
    [(case, kind) for case in CASES for kind in ("fwd", "wgrad")]
    + [("ragged", "dgrad"), ("tail tiles", "dgrad")]
    + [pytest.param(case, "dgrad", marks=pytest.mark.slow) for case in ("hot expert", "single group")],
)
@pytest.mark.usefixtures("interpret")
def test_overlapped_epilogue_matches_reference(case, kind):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _inputs(31, m, k, n, sizes, False)
    dout = jnp.asarray(np.random.default_rng(32).normal(size=(m, n)), jnp.bfloat16)
    bf16 = jnp.bfloat16
    if kind == "wgrad":
        wgrad = functools.partial(launch.run_wgrad_kernel, out_dtype=bf16, config=OVERLAPPED)
        out = jax.jit(wgrad)(lhs, dout, group_sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        a, b = (np.asarray(v, np.float64) for v in (lhs, dout))
        expected = np.stack([a[s:e].T @ b[s:e] for s, e in zip(offsets[:-1], offsets[1:], strict=True)])
    else:
        x, transposed = (lhs, False) if kind == "fwd" else (dout, True)
        rows = functools.partial(
            launch.run_rows_kernel, kind, w_transposed=transposed, out_dtype=bf16, config=OVERLAPPED
        )
        out = jax.jit(rows)(x, rhs, group_sizes)
        expected = _jitted_reference(x, rhs, group_sizes, transpose_rhs=transposed)
        np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(sizes) :], 0.0)
    assert oracle.relative_error(out, expected) < BF16_OUT_TOL


# keep_ctas_in_step: a warpgroup with no row to store still runs its MMAs, over rows of the next group or past the
# sum. Rows past the sum are NaN here, so a computed row that reached a stored one (or a stored zero) would show.
# Each case on one kind by default (one kernel, as above), on the other `slow`.
@pytest.mark.parametrize(
    "case, kind",
    [
        ("ragged", "fwd"),
        ("tail tiles", "dgrad"),
        pytest.param("ragged", "dgrad", marks=pytest.mark.slow),
        pytest.param("tail tiles", "fwd", marks=pytest.mark.slow),
    ],
)
@pytest.mark.usefixtures("interpret")
def test_tail_tiles_kept_in_step_match_reference(case, kind):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _inputs(51, m, k, n, sizes, False)
    total = sum(sizes)
    dout = jnp.asarray(np.random.default_rng(52).normal(size=(m, n)), jnp.bfloat16)
    x, transposed = (lhs, False) if kind == "fwd" else (dout, True)
    in_step = config.Config(block_m=128, block_n=64, keep_ctas_in_step=True)
    rows = functools.partial(
        launch.run_rows_kernel, kind, w_transposed=transposed, out_dtype=jnp.float32, config=in_step
    )
    out = jax.jit(rows)(x.at[total:].set(jnp.nan), rhs, group_sizes)
    expected = _jitted_reference(x, rhs, group_sizes, transpose_rhs=transposed)
    assert oracle.relative_error(out, expected) < F32_OUT_TOL
    np.testing.assert_array_equal(np.asarray(out)[total:], 0.0)


# grid_minor="g": row tiles walked in bands that never mix groups (schedule.row_tile_bands), with bands narrower than a
# group (width 1: every row tile its own band; width 2: a group of three tiles splits), so the table's every field is
# read; and as GROUP_BANDS walks them (the table's and the heuristic's fwd / dgrad past 256 rows a group): CTAs in
# step, each tile stored while the next one's first steps run.
@pytest.mark.parametrize("case", ["ragged", "hot expert", "tail tiles"])
@pytest.mark.parametrize("grid_width, in_step", [(1, False), (2, False), (16, True)])
@pytest.mark.usefixtures("interpret")
def test_group_bands_match_reference(case, grid_width, in_step):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _inputs(61, m, k, n, sizes, False)
    banded = config.Config(
        block_m=128,
        block_n=64,
        grid_minor="g",
        grid_width=grid_width,
        overlap_epilogue=in_step,
        keep_ctas_in_step=in_step,
    )
    rows = functools.partial(launch.run_rows_kernel, "fwd", w_transposed=False, out_dtype=jnp.float32, config=banded)
    out = jax.jit(rows)(lhs, rhs, group_sizes)
    expected = _jitted_reference(lhs, rhs, group_sizes)
    assert oracle.relative_error(out, expected) < F32_OUT_TOL
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes) :], 0.0)


def test_wgrad_rejects_group_bands():
    """A group's wgrad tiles are [K, N] blocks of one group: "g" (bands of row tiles by group) means nothing there."""
    x, y = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    banded = config.Config(grid_minor="g")
    with pytest.raises(ValueError, match="grid_minor must be 'm' or 'n'"):
        launch.run_wgrad_kernel(x, y, jnp.asarray([64], jnp.int32), out_dtype=jnp.bfloat16, config=banded)


# Gathered rows (sm90_gather.py): row r of the product is x[row_tokens[r]] for tokens drawn with repeats from the odd
# rows of x; the even rows are NaN, so a row gathered from the wrong token (or a stale buffer) poisons the output.
# The interpreter copies each gathered row on its own, for every K step and column tile: "single group" (K = 128)
# gathers over two K steps and the others over two column tiles (N = 128), so "ragged" keeps its group sizes at
# K = 64, N = 128 here, a third of its tiles' copies.
GATHER_CASES = CASES | {"ragged": (CASES["ragged"][0], 64, 128, CASES["ragged"][3])}


@pytest.mark.parametrize("case", list(GATHER_CASES))
@pytest.mark.usefixtures("interpret")
def test_gathered_rows_match_reference(case):
    m, k, n, sizes = GATHER_CASES[case]
    rng = np.random.default_rng(41)
    num_tokens = m // 2 + 3
    x = rng.normal(size=(num_tokens, k)).astype(np.float32)
    x[0::2] = np.nan
    row_tokens = 2 * rng.integers(0, num_tokens // 2, size=m) + 1
    _, rhs, group_sizes = _inputs(42, m, k, n, sizes, False)
    x = jnp.asarray(x, jnp.bfloat16)
    cfg = config.Config(block_m=128, block_n=64)
    rows = functools.partial(launch.run_rows_kernel, "fwd", w_transposed=False, out_dtype=jnp.float32, config=cfg)
    out = jax.jit(rows)(x, rhs, group_sizes, row_tokens=jnp.asarray(row_tokens, jnp.int32))
    expected = oracle.grouped_matmul(np.asarray(x, np.float32)[row_tokens], rhs, sizes)
    assert out.shape == (m, n)
    assert oracle.relative_error(out, expected) < F32_OUT_TOL
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes) :], 0.0)


# One activation by default: the kernels' code is the same for all three but for the epilogue's GLU, whose math
# test_glu_mlp.py checks for each against jax.vjp, and which test_glu_mlp_pallas.py runs in these kernels for each.
ONE_ACTIVATION_BY_DEFAULT = [pytest.param(a, marks=() if a == "gpt_oss" else pytest.mark.slow) for a in glu.ACTIVATIONS]


@pytest.mark.parametrize("activation", ONE_ACTIVATION_BY_DEFAULT)
@pytest.mark.usefixtures("interpret")
def test_jax_grad_through_gated_activation_and_row_scale(activation):
    m, k, n, sizes = 160, 64, 128, [3, 77, 0, 40]
    lhs, rhs, group_sizes = _inputs(11, m, k, n, sizes, False)
    lhs = lhs * 5  # pre-activations ~N(0, 25): gpt_oss clamps about a sixth of them at +-7
    row_scale = jnp.asarray(np.random.default_rng(12).uniform(size=m), jnp.float32)

    def loss(backend):
        def fn(a, b, scale):
            out = moe_jax.grouped_matmul(a, b, group_sizes, activation=activation, row_scale=scale, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

        return jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))(lhs, rhs, row_scale)

    kernel, kernel_out = loss("pallas")
    # The forward the gradient's residuals come from, against the float64 oracle.
    exact_out = oracle.grouped_matmul(lhs, rhs, sizes, activation=activation, row_scale=row_scale)
    assert oracle.relative_error(kernel_out, exact_out) < BF16_OUT_TOL
    for actual, exact in zip(kernel, loss("xla")[0], strict=True):
        assert oracle.relative_error(actual, exact) < GLU_GRAD_TOL
    np.testing.assert_array_equal(np.asarray(kernel[0], np.float32)[sum(sizes) :], 0.0)  # rows past the sum


# The forward that keeps the pre-activation (for the GLU backward) stores between tiles: its kept values do not fit
# the overlapped epilogue's registers. On 256-column tiles a tile holds two hidden chunks, each of whose three values
# (kept gate, kept up, h) is computed in its own store's branch; N = 384 leaves the second tile's second chunk wholly
# past N.
@pytest.mark.parametrize("activation", ONE_ACTIVATION_BY_DEFAULT)
@pytest.mark.usefixtures("interpret")
def test_forward_keeping_the_pre_activation_on_256_column_tiles(activation):
    m, k, n, sizes = 136, 64, 384, [0, 61, 3, 0, 40]
    lhs, rhs, group_sizes = _inputs(13, m, k, n, sizes, False)
    lhs = lhs * 5  # gpt_oss clamps about a sixth of the pre-activations
    row_scale = jnp.asarray(np.random.default_rng(14).uniform(size=m), jnp.float32)
    packed = moe_jax.pack_gate_up(rhs).array
    wide = config.Config(block_n=256, num_stages=2)
    args = (lhs, packed, group_sizes, row_scale, activation, jnp.bfloat16, False)
    with mock.patch.object(launch, "get_config", lambda *_, **__: wide):
        out, kept = launch.run_forward_kernel(*args, keep=True)
    past = sum(sizes)
    expected = reference.grouped_matmul(lhs, rhs, group_sizes, activation=activation, row_scale=row_scale)
    pre_activation = reference.grouped_matmul(lhs, packed, group_sizes, preferred_element_type=jnp.float32)
    assert oracle.relative_error(out[:past], expected[:past]) < BF16_OUT_TOL
    assert oracle.relative_error(kept[:past], pre_activation[:past]) < BF16_OUT_TOL
    for value in (out, kept):
        np.testing.assert_array_equal(np.asarray(value, np.float32)[past:], 0.0)


def _wgrad_and_oracle(x, y, sizes, wgrad_config=None):
    """The wgrad kernel on x [M, P], y [M, Q] (f32, rounded to bf16) and its exact per-group oracle [G, P, Q] f64."""
    xb, yb = (jnp.asarray(a, jnp.bfloat16) for a in (x, y))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    wgrad = functools.partial(launch.run_wgrad_kernel, out_dtype=jnp.float32, config=wgrad_config)
    out = jax.jit(wgrad)(xb, yb, group_sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    a, b = (np.asarray(v, np.float64) for v in (xb, yb))
    return out, np.stack([a[s:e].T @ b[s:e] for s, e in zip(offsets[:-1], offsets[1:], strict=True)])


# P = 64 is half of the output tile's 128 rows, Q = 192 one and a half of its columns: both edges are partial tiles.
# Non-finite values past the sum (in x and y), or only in x, or inside group 3 in y, which group 2's chunk shares.
@pytest.mark.parametrize("p, q", [(128, 128), (64, 192)])
@pytest.mark.parametrize("poison", ["past the sum", "x only", "inside a neighbour"])
@pytest.mark.usefixtures("interpret")
def test_wgrad_masks_neighbouring_rows(p, q, poison):
    """Rows outside a group never reach its weight gradient, not even as 0 * NaN."""
    m, sizes = 200, [50, 0, 3, 100]
    rng = np.random.default_rng(13 + p)
    x = rng.normal(size=(m, p)).astype(np.float32)
    y = rng.normal(size=(m, q)).astype(np.float32)
    x[sum(sizes) :] = np.nan
    if poison == "past the sum":
        y[sum(sizes) :] = np.inf
    elif poison == "inside a neighbour":
        y[60, 5] = -np.inf  # row 60 is group 3's; group 2 (rows 50-52) reads rows 48-111
    out, expected = _wgrad_and_oracle(x, y, sizes)
    clean = [0, 1, 2] if poison == "inside a neighbour" else [0, 1, 2, 3]  # group 3's own gradient holds the -inf
    assert not np.isnan(np.asarray(out)[clean]).any()
    assert oracle.relative_error(out[np.asarray(clean)], expected[clean]) < F32_OUT_TOL


# wgrad tile orders. P = 192 on 64-row tiles is 3 P tiles and Q = 192 on 64-column tiles 3 Q tiles, so both snake
# orders turn round. The groups: an empty one, a 3-row one inside its neighbours' chunk, sizes off 8, rows past the
# sum; x and y past the sum and y inside group 3 are non-finite, so a chunk's foreign rows must be masked.
WGRAD_LAYOUTS = [
    config.Config(block_m=64, block_n=64, num_compute_wgs=1),
    config.Config(block_m=64, block_n=64, num_compute_wgs=1, grid_minor="m", grid_width=2),
    config.Config(block_m=128, block_n=128, grid_width=2, overlap_epilogue=True),
]


@pytest.mark.parametrize(
    "layout", WGRAD_LAYOUTS, ids=lambda c: f"{c.block_m}{c.grid_minor}{c.grid_width}{'o' if c.overlap_epilogue else ''}"
)
@pytest.mark.usefixtures("interpret")
def test_wgrad_orders_match_reference(layout):
    m, p, q, sizes = 232, 192, 192, [70, 0, 3, 90, 41]
    rng = np.random.default_rng(41)
    x = rng.normal(size=(m, p)).astype(np.float32)
    y = rng.normal(size=(m, q)).astype(np.float32)
    x[sum(sizes) :], y[sum(sizes) :] = np.nan, np.inf
    y[100, 9] = -np.inf  # group 3's row (73-162); group 2 (rows 70-72) reads rows 64-127
    out, expected = _wgrad_and_oracle(x, y, sizes, layout)
    clean = [0, 1, 2, 4]  # group 3's own gradient holds the -inf
    assert not np.isnan(np.asarray(out)[clean]).any()
    assert oracle.relative_error(out[np.asarray(clean)], expected[clean]) < F32_OUT_TOL
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


# ------------------------------------------------------------------------------------------------ schedule, configs

# The schedule's tables as jitted programs: op by op, each call would compile one small program per operation and shape.
row_tiles = jax.jit(schedule.row_tiles, static_argnums=(1, 2), static_argnames="zero_tail")
row_tile_bands = jax.jit(schedule.row_tile_bands, static_argnums=2)
wgrad_groups = jax.jit(schedule.wgrad_groups, static_argnums=2)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_row_tiles_cover_every_row_once(block_m, zero_tail):
    """Every row of a group stored once by a tile of its group; the rows past the sum by ZERO_TILE tiles, or (without
    zero_tail) by none, except row 0 when no group has a row; each tile's segment bounds are its group's tiles."""
    rng = np.random.default_rng(14)
    for num_groups, num_rows, fill in [(7, 500, 3 / 4), (1, 64, 3 / 4), (16, 1000, 3 / 4), (5, 96, 0)]:
        sizes = oracle.random_group_sizes(rng, num_groups, int(num_rows * fill), "uniform")
        tiles, count = row_tiles(jnp.asarray(sizes), num_rows, block_m, zero_tail=zero_tail)
        tiles = np.asarray(tiles)[:, : int(count[0])]
        owner = np.full(num_rows, -2)
        groups = tiles[schedule.TILE_GROUP]
        for t, (group, box, skip, rows, seg_first, seg_end) in enumerate(tiles.T):
            assert box % schedule.ROW_ALIGN == 0 and rows > 0 and skip + rows <= block_m
            # The segment bounds: the maximal run of this group's tiles around t.
            assert seg_first <= t < seg_end <= len(groups) and (groups[seg_first:seg_end] == group).all()
            assert (seg_first == 0 or groups[seg_first - 1] != group) and (
                seg_end == len(groups) or groups[seg_end] != group
            )
            assert (owner[box + skip : box + skip + rows] == -2).all(), "a row stored twice"
            owner[box + skip : box + skip + rows] = group
        tail = np.full(num_rows - sizes.sum(), -1 if zero_tail else -2)
        if not zero_tail and sizes.sum() == 0:
            tail[0] = -1
        np.testing.assert_array_equal(owner, np.concatenate([np.repeat(np.arange(num_groups), sizes), tail]))
        assert 1 <= count[0] <= schedule.max_row_tiles(num_rows, num_groups, block_m)


def _banded_order_oracle(groups: list[int], n_tiles: int, max_width: int) -> list[tuple[int, int]]:
    """(row tile, column tile) in the "g" order, built as a list: runs of equal groups, each split into the fewest
    bands of at most max_width row tiles (widths within one of each other, narrower first), row tiles fastest, every
    other band of a run with its columns backwards."""
    order, start = [], 0
    for end in range(1, len(groups) + 1):
        if end == len(groups) or groups[end] != groups[start]:
            length = end - start
            count = -(-length // max_width)
            bounds = [start + j * length // count for j in range(count + 1)]
            for b, (a, z) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                columns = range(n_tiles) if b % 2 == 0 else reversed(range(n_tiles))
                order += [(tile, col) for col in columns for tile in range(a, z)]
            start = end
    return order


@pytest.mark.parametrize("max_width", [1, 3, 8])
def test_row_tile_bands_walk_every_item_once_in_group_bands(max_width):
    """The kernel's "g" mapping (sm90.band_item) over schedule.row_tile_bands's table against a list-building oracle."""
    rng = np.random.default_rng(10 + max_width)
    n_tiles, block_m, num_rows = 3, 64, 3000
    for fill in (0.9, 1.0):
        sizes = oracle.random_group_sizes(rng, 9, int(num_rows * fill), "zipf")
        tiles, count = row_tiles(jnp.asarray(sizes), num_rows, block_m)
        table = np.asarray(row_tile_bands(tiles, count, max_width))
        groups = np.asarray(tiles)[schedule.TILE_GROUP, : int(count[0])].tolist()
        order = []
        for lin in range(int(count[0]) * n_tiles):
            first, width, reversed_ = table[:, lin // n_tiles]
            within = lin - first * n_tiles
            col = within // width
            order.append((int(first + within % width), int(n_tiles - 1 - col if reversed_ else col)))
        assert order == _banded_order_oracle(groups, n_tiles, max_width)


def test_wgrad_groups_are_largest_first():
    table = np.asarray(wgrad_groups(jnp.asarray([5, 0, 9, 9, 2]), jnp.zeros((20, 64)), 64))
    np.testing.assert_array_equal(table[schedule.GROUP_ID], [2, 3, 0, 1, 4])
    np.testing.assert_array_equal(table[schedule.GROUP_START], [5, 14, 0, 5, 20])
    np.testing.assert_array_equal(table[schedule.GROUP_SIZE], [9, 6, 5, 0, 0])  # group 3 clipped at M = 20
    np.testing.assert_array_equal(table[schedule.GROUP_B_FINITE], [1] * 5)


@pytest.mark.parametrize("num_rows, block_k", [(600, 64), (40, 128)])  # few rows: one pass over B instead of a gather
def test_wgrad_groups_flag_nonfinite_foreign_rows(num_rows, block_k):
    """GROUP_B_FINITE against a brute force over the rows each group's chunks read (kernel docstring)."""
    rng = np.random.default_rng(num_rows)
    sizes = rng.integers(0, 2 * num_rows // 9, size=12)
    sizes[[2, 7]] = 0
    y = rng.normal(size=(num_rows, 16)).astype(np.float32)
    bad = rng.choice(num_rows, size=8, replace=False)
    y[bad, rng.integers(0, 16, size=8)] = rng.choice([np.nan, np.inf, -np.inf], size=8)
    table = np.asarray(wgrad_groups(jnp.asarray(sizes), jnp.asarray(y, jnp.bfloat16), block_k))
    ends = np.minimum(np.cumsum(sizes), num_rows)
    starts = np.concatenate([[0], ends[:-1]])
    expected = {}
    for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
        box = start // schedule.ROW_ALIGN * schedule.ROW_ALIGN
        read = np.arange(box, box + -(-(end - box) // block_k) * block_k) if end > start else np.arange(0)
        foreign = read[((read < start) | (read >= end)) & (read < num_rows)]
        expected[g] = int(np.isfinite(y[foreign]).all())
    assert 0 < sum(expected.values()) < len(sizes), "the draw should flag some groups and clear others"
    np.testing.assert_array_equal(table[schedule.GROUP_B_FINITE], [expected[g] for g in table[schedule.GROUP_ID]])


@pytest.mark.parametrize(
    "fields",
    [
        dict(block_m=96),
        dict(block_n=320),
        dict(block_k=48),
        dict(num_stages=1),
        dict(epilogue_n=100),
        dict(epilogue_n=32),
    ],
)
def test_config_rejects_bad_fields(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        config.Config(**fields)


def test_wgrad_rejects_a_consumer_split_off_the_swizzle():
    """Two consumers would each zero 96 columns of a 192-wide y tile: not whole 128-byte swizzle rows."""
    lhs, dout = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((64, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_n must be a multiple of 128"):
        launch.run_wgrad_kernel(
            lhs, dout, jnp.array([64], jnp.int32), out_dtype=jnp.bfloat16, config=config.Config(block_n=192)
        )


@pytest.mark.smoke
@pytest.mark.parametrize("kind", config.KINDS)
def test_heuristic_configs_fit_in_shared_memory(kind):
    for m, k, n, g in [(32768, 2048, 1536, 128), (16384, 14336, 4096, 8), (256, 64, 64, 1)]:
        for out_itemsize in (2, 4):
            assert config.heuristic_config(kind, m=m, k=k, n=n, g=g, out_itemsize=out_itemsize).fits(2, out_itemsize)


@pytest.mark.smoke
@pytest.mark.parametrize(
    "m, k, n, g",
    [
        (131072, 2048, 1536, 128),  # the qwen3-30b-a3b layer's gate_up: 1024 rows, 6.3 MB of weights a group
        (131072, 7168, 4096, 256),  # deepseek-v3's: 512 rows, 58.7 MB
        (32768, 512, 1536, 40),  # granite-3b down: 819 rows, 1.6 MB
        (512, 64, 64, 1),  # one group
    ],
)
def test_heuristic_walks_large_groups_in_group_bands_in_step(m, k, n, g):
    """Off the table, where groups average more than SMALL_GROUP_ROWS rows, fwd and dgrad walk group bands with their
    CTAs in step whatever a group's weights; all but the GLU backward overlap their epilogues (it runs slower with the
    overlap)."""
    configs = {kind: config.heuristic_config(kind, m=m, k=k, n=n, g=g) for kind in config.KINDS}
    for kind in ("fwd", "dgrad"):
        assert (configs[kind].grid_minor, configs[kind].keep_ctas_in_step) == ("g", True), kind
    overlaps = {kind: c.overlap_epilogue for kind, c in configs.items()}
    assert overlaps == {"fwd": True, "dgrad": True, "glu_dgrad": False, "wgrad": True}


@pytest.mark.smoke
@pytest.mark.parametrize("m, g", [(32768, 128), (32768 - 8, 128), (256, 1), (1024, 4)])
@pytest.mark.parametrize("k, n", [(2048, 1536), (2880, 5760), (2048, 2048), (2048, 2048 + 64)])
def test_heuristic_walks_small_groups_in_group_bands(m, g, k, n):
    """Groups of 65-256 rows on average (2-3 row tiles of 128) get bands by group for fwd / dgrad / glu_dgrad (fixed
    bands re-read weights there), the fwd / dgrad CTAs kept in step only where a group's weights pass
    IN_STEP_WEIGHT_BYTES (qwen3-30b's 6.3 MB: not; gpt-oss-120b's 33 MB: yes; 8 MB: not; just past it: yes); wgrad
    keeps its row bands."""
    heavy = k * n * 2 > config.IN_STEP_WEIGHT_BYTES
    for kind in ("fwd", "dgrad", "glu_dgrad"):
        c = config.heuristic_config(kind, m=m, k=k, n=n, g=g)
        assert c.grid_minor == "g", kind
        assert c.keep_ctas_in_step == (heavy or kind == "glu_dgrad"), kind
        assert c.overlap_epilogue == (kind != "glu_dgrad"), kind
    assert config.heuristic_config("wgrad", m=m, k=k, n=n, g=g).grid_minor == "m"
    past = config.heuristic_config("fwd", m=config.SMALL_GROUP_ROWS * g + 8, k=k, n=n, g=g)
    assert (past.grid_minor, past.keep_ctas_in_step) == ("g", True)


@pytest.mark.smoke
@pytest.mark.parametrize(
    "m, g, tiny",
    [(1024, 128, True), (8, 128, True), (8192, 128, True), (8192 + 8, 128, False), (64, 1, True), (65, 1, False)],
)
@pytest.mark.parametrize("k, n", [(2048, 1536), (2880, 5760)])  # 6.3 / 33 MB of weights a group
def test_heuristic_takes_64_row_tiles_for_decode_sized_groups(m, g, tiny, k, n):
    """Groups of at most TINY_GROUP_ROWS rows on average (a decode step's batch: qwen3-30b at T = 128 has 8 a group,
    fewer rows than groups too) get fwd / dgrad tiles of 64 rows with one consumer warpgroup, which has no idle half
    to keep in step; past it, 128 rows with two. The GLU backward and wgrad keep two warpgroups on 128 rows."""
    for kind in ("fwd", "dgrad"):
        c = config.heuristic_config(kind, m=m, k=k, n=n, g=g)
        assert (c.block_m, c.num_compute_wgs) == ((64, 1) if tiny else (128, 2)), kind
        assert (c.grid_minor, c.overlap_epilogue, c.num_stages) == ("g", True, 4), kind
        if tiny:
            assert not c.keep_ctas_in_step, kind
    for kind in ("glu_dgrad", "wgrad"):
        c = config.heuristic_config(kind, m=m, k=n // 2, n=k, g=g)
        assert (c.block_m, c.num_compute_wgs) == (128, 2), kind


@pytest.mark.smoke
@pytest.mark.parametrize(
    "m, f, d, g, bands, block_n, stages",
    [
        (131072, 768, 2048, 128, False, 128, 6),  # the qwen3-30b layer: 3.1 MB of weights a group
        (65536, 2880, 2880, 128, True, 128, 6),  # gpt-oss-120b: 16.6 MB
        (131072, 2048, 7168, 256, True, 256, 4),  # deepseek-v3: 29 MB, a long contraction
        (131072, 2048, 2048, 128, False, 128, 6),  # 8 MB exactly
        (131072, 2048, 2048 + 64, 128, True, 128, 6),  # just past GLU_DGRAD_BAND_WEIGHT_BYTES
        (32768, 14336, 4096, 8, True, 128, 5),  # a mixtral layer: 117 MB
        (131072, 2880, 2880 + 64, 64, True, 128, 5),  # just past SHORT_D_MAX
        (131072, 2048, 4096 + 64, 64, True, 256, 4),  # just past MEDIUM_D_MAX
        (131072, 512, 7168, 256, False, 128, 5),  # a long contraction but 7.3 MB a group: "n" bands, 128 wide
    ],
)
def test_heuristic_glu_backward_walks_group_bands_where_weights_are_large(m, f, d, g, bands, block_n, stages):
    """Off the table and past SMALL_GROUP_ROWS rows a group, the GLU backward (w_down [G, F, D]) walks group bands in
    step where a group's weights exceed GLU_DGRAD_BAND_WEIGHT_BYTES, "n" / "m" bands elsewhere. It takes 128 x 128
    tiles with the 6 stages that fit next to a row scale up to a contraction D of SHORT_D_MAX and 5 past it; in group
    bands past MEDIUM_D_MAX, 128 x 256 tiles with 4 stages (which fit next to a row scale)."""
    c = config.heuristic_config("glu_dgrad", m=m, k=f, n=d, g=g, row_scale=True)
    assert (c.grid_minor == "g", c.keep_ctas_in_step) == (bands, bands)
    assert (c.block_n, c.num_stages, c.overlap_epilogue) == (block_n, stages, False)
    assert config.gate_up_ring_slots(c) == block_n // 64  # the gate/up rows ride the ring


@pytest.mark.smoke
@pytest.mark.parametrize(
    "m, g, width",
    [(32768, 128, 16), (16384, 8, 16), (16384, 1, 4), (262144, 1, 1), (64, 1, 16)],
)
def test_heuristic_wgrad_bands_fit_the_l2(m, g, width):
    """wgrad walks each group's tiles in bands of row tiles (K blocks) whose x blocks stay in L2: up to 16 of them,
    fewer where a group's rows make the band larger than WGRAD_BAND_BYTES."""
    c = config.heuristic_config("wgrad", m=m, k=4096, n=28672, g=g)
    assert (c.grid_minor, c.grid_width) == ("m", width)
    assert width == 1 or width * (m // g) * c.block_m * 2 <= config.WGRAD_BAND_BYTES


@pytest.mark.parametrize(
    "lhs_dtype, k, n, match",
    [(jnp.float32, 64, 64, "bfloat16 or float16"), (jnp.bfloat16, 96, 64, "K must be"), (jnp.bfloat16, 64, 40, "N")],
)
def test_pallas_rejects_what_the_kernel_cannot_do(lhs_dtype, k, n, match):
    lhs, rhs = jnp.ones((16, k), lhs_dtype), jnp.ones((2, k, n), lhs_dtype)
    with pytest.raises(NotImplementedError, match=match):
        moe_jax.grouped_matmul(lhs, rhs, jnp.array([8, 8], jnp.int32), backend="pallas")
