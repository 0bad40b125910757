"""The sm90 permute / combine kernels under the Mosaic GPU interpreter (races detected, outputs NaN-poisoned).

Permute moves rows without arithmetic: exactly the reference. Combine sums k rows in f32 in its own order: within
one rounding of the output dtype. Gradients against ``jax.vjp`` of the reference.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.permute import reference, sm90
from moe_jax.ops.permute.config import Config, heuristic_config
from tests.helpers import checked_interpreter, cuda_lowering, jitted_vjp, normal, random_routing
from tests.oracle import relative_error

# One rounding to the output dtype of an f32 sum (the reference rounds once too, from another summation order).
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3}


def _rows(seed: int, shape, dtype) -> jax.Array:
    return jnp.asarray(normal(seed, shape), dtype)


# The references called outside a kernel's jitted program: jitted too (op by op, each op compiles).
reference_permute = jax.jit(reference.permute, static_argnums=2)
reference_combine = jax.jit(reference.combine, static_argnums=2)


def _interpreted(fn, *args):
    """fn(*args) as one jitted program under the checking interpreter (op by op, its glue would compile per op)."""
    with checked_interpreter():
        return jax.block_until_ready(jax.jit(fn)(*args))


# (T, D, E, k, dtype): D picks the register chunk (bf16 1024 -> one 16-byte chunk; 384 -> three 2-byte chunks).
# Where no chunk divides D the last one overlaps the one before: gpt-oss's 2880 (16-byte chunks at 0, 1024, 1856),
# 320 bf16 and 192 f32 (128-column chunks, the last at 192 / 64).
CASES = [
    (21, 256, 6, 3, jnp.bfloat16),  # T off the 8-token block
    (16, 1024, 4, 2, jnp.bfloat16),
    (9, 384, 5, 4, jnp.bfloat16),
    (12, 512, 8, 8, jnp.float32),  # k = E
    (7, 2880, 6, 4, jnp.bfloat16),
    (10, 320, 5, 2, jnp.bfloat16),
    (5, 192, 3, 3, jnp.float32),
]


@pytest.mark.parametrize("num_tokens, d_model, num_experts, top_k, dtype", CASES)
def test_permute_matches_reference_exactly(num_tokens, d_model, num_experts, top_k, dtype):
    routing = random_routing(num_tokens, num_tokens, num_experts, top_k)
    x = _rows(1, (num_tokens, d_model), dtype)
    rows = _interpreted(lambda x: moe_jax.permute(x, routing.sort_indices, top_k, backend="pallas"), x)
    assert rows.dtype == dtype
    np.testing.assert_array_equal(rows, reference_permute(x, routing.sort_indices, top_k))


# FP8 rows move as pairs of bytes: every bit pattern (NaNs, infinities and subnormals of a 16-bit float among them)
# must arrive as it was. D = 2880 (1440 words) overlaps its last chunk.
@pytest.mark.parametrize("d_model", [256, 2880])
def test_permute_moves_fp8_rows_bit_exactly(d_model):
    rng = np.random.default_rng(d_model)
    num_tokens, top_k = 13, 3
    raw = rng.integers(0, 256, size=(num_tokens, d_model), dtype=np.uint8)
    x = jax.lax.bitcast_convert_type(jnp.asarray(raw), jnp.float8_e4m3fn)
    sort_indices = jnp.asarray(rng.permutation(num_tokens * top_k), jnp.int32)
    moved = _interpreted(lambda x: moe_jax.permute(x, sort_indices, top_k, backend="pallas"), x)
    assert moved.dtype == x.dtype
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(moved, jnp.uint8)), raw[np.asarray(sort_indices) // top_k]
    )


@pytest.mark.parametrize("num_tokens, d_model, num_experts, top_k, dtype", CASES)
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_matches_reference(num_tokens, d_model, num_experts, top_k, dtype, weighted):
    routing = random_routing(num_tokens + 1, num_tokens, num_experts, top_k)
    y_sorted = _rows(2, (num_tokens * top_k, d_model), dtype)
    weights = routing.weights if weighted else None
    y = _interpreted(lambda y: moe_jax.combine(y, routing.sort_indices, top_k, weights, backend="pallas"), y_sorted)
    assert y.dtype == dtype
    expected = reference_combine(y_sorted, routing.sort_indices, top_k, weights)
    assert relative_error(y, expected) < TOL[dtype]


def test_combine_after_capacity_drops():
    # Dropped assignments sit past sum(group_sizes); their rows (zeros from the grouped matmul) are still summed.
    routing = random_routing(3, 24, 4, 2)
    _, sort_indices = moe_jax.apply_capacity(routing, 0.5)
    y_sorted = _rows(4, (48, 256), jnp.bfloat16)
    y = _interpreted(lambda y: moe_jax.combine(y, sort_indices, 2, routing.weights, backend="pallas"), y_sorted)
    assert relative_error(y, reference_combine(y_sorted, sort_indices, 2, routing.weights)) < TOL[jnp.bfloat16]
    rows = _interpreted(lambda y: moe_jax.permute(y, sort_indices, 2, backend="pallas"), y)
    np.testing.assert_array_equal(rows, reference_permute(y, sort_indices, 2))


def test_the_routings_positions_move_the_same_rows_without_a_scatter():
    num_tokens, d_model, top_k = 19, 256, 3
    routing = random_routing(6, num_tokens, 6, top_k)
    x = _rows(7, (num_tokens, d_model), jnp.bfloat16)
    y_sorted = _rows(8, (num_tokens * top_k, d_model), jnp.bfloat16)

    def moved(x, y_sorted, positions):
        rows = moe_jax.permute(x, routing.sort_indices, top_k, positions=positions, backend="pallas")
        y = moe_jax.combine(
            y_sorted, routing.sort_indices, top_k, routing.weights, positions=positions, backend="pallas"
        )
        return rows, y

    rows, y = _interpreted(moved, x, y_sorted, routing.positions)
    np.testing.assert_array_equal(rows, reference_permute(x, routing.sort_indices, top_k))
    assert (
        relative_error(y, reference_combine(y_sorted, routing.sort_indices, top_k, routing.weights)) < TOL[jnp.bfloat16]
    )

    # Given positions, neither op inverts sort_indices (the scatter they save).
    def scatters(positions) -> int:
        return len(re.findall(r"\bscatter\[", str(jax.make_jaxpr(moved)(x, y_sorted, positions))))

    assert scatters(routing.positions) == 0 and scatters(None) == 2


# The weights' gradient is a dot product over D: with overlapping chunks (192, 2880) the overlap counts once.
@pytest.mark.parametrize(
    "dtype, d_model", [(jnp.float32, 256), (jnp.bfloat16, 256), (jnp.float32, 192), (jnp.bfloat16, 2880)]
)
def test_gradients_match_reference(dtype, d_model):
    num_tokens, top_k = 13, 3
    routing = random_routing(5, num_tokens, 5, top_k)
    x = _rows(6, (num_tokens, d_model), dtype)
    y_sorted = _rows(7, (num_tokens * top_k, d_model), dtype)
    d_rows = _rows(8, (num_tokens * top_k, d_model), dtype)
    d_y = _rows(9, (num_tokens, d_model), dtype)

    def layer(permute, combine):
        def apply(x, y_sorted, weights):
            return permute(x), combine(y_sorted, weights), combine(y_sorted, None)

        return apply

    kernel = layer(
        lambda x: moe_jax.permute(x, routing.sort_indices, top_k, backend="pallas"),
        lambda y, w: moe_jax.combine(y, routing.sort_indices, top_k, w, backend="pallas"),
    )
    expected = layer(
        lambda x: reference.permute(x, routing.sort_indices, top_k),
        lambda y, w: reference.combine(y, routing.sort_indices, top_k, w),
    )
    primals, cotangents = (x, y_sorted, routing.weights), (d_rows, d_y, d_y)
    with checked_interpreter():
        _, *got = jax.block_until_ready(jitted_vjp(kernel, primals, cotangents))
    _, *wanted = jitted_vjp(expected, primals, cotangents)
    for name, g, e in zip(("dx", "dy_sorted", "dweights"), got, wanted, strict=True):
        assert g.dtype == e.dtype, name
        # The reference's dx sums k bf16 rows in bf16 (scatter-add), the kernel in f32: two roundings apart.
        tol = 2 * TOL[dtype] if name == "dx" else TOL[dtype]
        assert relative_error(g, e) < tol, name


# num_rows: none of the T * k = 39 sorted rows, some, all but the last, all.
@pytest.mark.parametrize("num_rows, weighted", [(0, True), (25, True), (25, False), (38, False), (39, True)])
def test_combine_of_the_first_rows_matches_reference(num_rows, weighted):
    """num_rows (traced): the kernels skip the later rows, filled here with NaN / Inf, and give them zero gradients."""
    num_tokens, d_model, top_k = 13, 256, 3
    routing = random_routing(12, num_tokens, 5, top_k)
    y_sorted = np.array(_rows(13, (num_tokens * top_k, d_model), jnp.float32))
    y_sorted[num_rows:] = np.where(np.arange(d_model) % 2, np.nan, np.inf)
    y_sorted = jnp.asarray(y_sorted, jnp.bfloat16)
    d_y = _rows(14, (num_tokens, d_model), jnp.bfloat16)
    weights = routing.weights if weighted else None

    def combined(combine):
        @jax.jit
        def run(y, w, n):
            return jax.vjp(lambda y, w: combine(y, routing.sort_indices, top_k, w, num_rows=n), y, w)

        y, pullback = run(y_sorted, weights, jnp.int32(num_rows))
        return y, *pullback(d_y)

    with checked_interpreter():
        got = jax.block_until_ready(combined(lambda *a, **kw: moe_jax.combine(*a, **kw, backend="pallas")))
    expected = combined(reference.combine)
    for name, g, e in zip(("y", "dy_sorted", "dweights"), got, expected, strict=True):
        if e is None:
            continue
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"{name} (num_rows={num_rows})"
        assert relative_error(g, e) < TOL[jnp.bfloat16], f"{name} (num_rows={num_rows})"
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[num_rows:], 0)


def test_unsupported_width_falls_back_or_raises():
    routing = random_routing(10, 8, 4, 2)
    x = _rows(11, (8, 100), jnp.float32)  # D = 100: narrower than the 128 lanes of a warpgroup
    with pytest.raises(NotImplementedError, match="D >= 128"):
        moe_jax.permute(x, routing.sort_indices, 2, backend="pallas")
    np.testing.assert_array_equal(
        moe_jax.permute(x, routing.sort_indices, 2, backend="auto"), reference_permute(x, routing.sort_indices, 2)
    )


@pytest.mark.smoke
def test_heuristic_config_picks_the_widest_access():
    assert heuristic_config(2048, jnp.bfloat16, "scatter_rows") == Config(vec_size=8, tokens_per_block=8)
    assert heuristic_config(7168, jnp.bfloat16, "scatter_rows") == Config(vec_size=8, tokens_per_block=2)
    assert heuristic_config(384, jnp.bfloat16, "scatter_rows") == Config(vec_size=1, tokens_per_block=5)
    assert heuristic_config(512, jnp.float32, "scatter_rows") == Config(vec_size=4, tokens_per_block=8)
    # No chunk divides D: the widest whose overlap is at most D / 8 (2880: 3072 columns moved; 1152: 1280).
    assert heuristic_config(2880, jnp.bfloat16, "scatter_rows") == Config(vec_size=8, tokens_per_block=5)
    assert heuristic_config(1152, jnp.bfloat16, "scatter_rows") == Config(vec_size=2, tokens_per_block=3)
    # The gather keeps one token's k rows in flight: one token per CTA, at the same access width.
    assert heuristic_config(2048, jnp.bfloat16, "gather_rows") == Config(vec_size=8, tokens_per_block=1)
    assert heuristic_config(1152, jnp.bfloat16, "gather_rows") == Config(vec_size=2, tokens_per_block=1)
    assert Config(vec_size=8, tokens_per_block=1).chunk_starts(2880) == (0, 1024, 1856)
    with pytest.raises(ValueError, match="at least the chunk width"):
        Config(vec_size=8, tokens_per_block=1).chunk_starts(1000)
    with pytest.raises(ValueError, match="vec_size"):
        Config(vec_size=3, tokens_per_block=1)
    with pytest.raises(ValueError, match="kernel must be one of"):
        heuristic_config(2048, jnp.bfloat16, "combine")


def test_gather_rows_with_several_tokens_per_block():
    # The heuristic gives gather_rows one token per CTA; with three, T = 11 leaves the last CTA one token short (it
    # repeats token T - 1), and D = 320 overlaps the last 128-column chunk: the same sums as the reference's.
    num_tokens, d_model, top_k = 11, 320, 3
    routing = random_routing(15, num_tokens, 5, top_k)
    y_sorted = _rows(16, (num_tokens * top_k, d_model), jnp.bfloat16)
    config = Config(vec_size=1, tokens_per_block=3)
    y = _interpreted(lambda y: sm90.gather_rows(y, routing.positions, routing.weights, config=config), y_sorted)
    expected = reference_combine(y_sorted, routing.sort_indices, top_k, routing.weights)
    assert relative_error(y, expected) < TOL[jnp.bfloat16]


# Shipped layer widths: (T, D, k) of the benchmark layers. Lowering runs the whole Mosaic GPU pipeline up to the
# custom calls.
SHIPPED = {s.name: (s.t, s.d, s.top_k) for s in shapes.layer_shapes("bench")}


@pytest.mark.smoke
@pytest.mark.parametrize("name", list(SHIPPED))
def test_lowers_for_cuda(name):
    num_tokens, d_model, top_k = SHIPPED[name]
    x = jax.ShapeDtypeStruct((num_tokens, d_model), jnp.bfloat16)
    y_sorted = jax.ShapeDtypeStruct((num_tokens * top_k, d_model), jnp.bfloat16)
    sort_indices = jax.ShapeDtypeStruct((num_tokens * top_k,), jnp.int32)
    weights = jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32)

    def forward_and_backward(x, y_sorted, weights, sort_indices):
        def apply(x, y_sorted, weights):
            rows = moe_jax.permute(x, sort_indices, top_k, backend="pallas")
            y = moe_jax.combine(y_sorted, sort_indices, top_k, weights, backend="pallas")
            return jnp.sum(rows.astype(jnp.float32)) + jnp.sum(y.astype(jnp.float32))

        return jax.value_and_grad(apply, argnums=(0, 1, 2))(x, y_sorted, weights)

    lowered = cuda_lowering(forward_and_backward, x, y_sorted, weights, sort_indices)
    assert lowered.count("custom_call @mosaic_gpu") == 4  # permute and combine forward, their two backward kernels
