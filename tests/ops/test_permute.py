"""Reference permute / combine against NumPy, with gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_jax
from moe_jax.ops.permute import reference
from tests.helpers import random_routing


@pytest.mark.parametrize("top_k", [1, 3])
def test_permute_gathers_each_assignment_in_expert_order(top_k):
    routing = random_routing(0, 17, 6, top_k)
    x = np.random.default_rng(1).normal(size=(17, 5)).astype(np.float32)
    rows = moe_jax.permute(jnp.asarray(x), routing.sort_indices, top_k)
    experts = np.asarray(routing.experts)
    expected, expert_of_row = [], []
    for e in range(6):
        for t in range(17):
            for j in range(top_k):
                if experts[t, j] == e:
                    expected.append(x[t])
                    expert_of_row.append(e)
    np.testing.assert_array_equal(rows, np.stack(expected))
    assert expert_of_row == sorted(expert_of_row)


@pytest.mark.parametrize("weighted", [True, False])
def test_combine_sums_each_tokens_rows(weighted):
    top_k = 3
    routing = random_routing(2, 11, 5, top_k)
    y_sorted = np.random.default_rng(3).normal(size=(33, 4)).astype(np.float32)
    weights = routing.weights if weighted else None
    y = moe_jax.combine(jnp.asarray(y_sorted), routing.sort_indices, top_k, weights)
    expected = np.zeros((11, 4))
    for position, assignment in enumerate(np.asarray(routing.sort_indices)):
        t, j = divmod(int(assignment), top_k)
        w = float(routing.weights[t, j]) if weighted else 1.0
        expected[t] += w * y_sorted[position]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_rows", [0, 13, 33])
def test_combine_of_the_first_rows_ignores_the_rest(num_rows):
    """num_rows: rows at or past it add nothing, even NaN / Inf ones, and get a zero gradient."""
    top_k = 3
    routing = random_routing(8, 11, 5, top_k)
    rng = np.random.default_rng(num_rows)
    y_sorted = rng.normal(size=(33, 4)).astype(np.float32)
    y_sorted[num_rows:] = np.where(rng.uniform(size=(33 - num_rows, 4)) < 0.5, np.nan, np.inf)
    weights = np.asarray(routing.weights)

    def combined(y, w):
        return moe_jax.combine(y, routing.sort_indices, top_k, w, num_rows=jnp.int32(num_rows))

    y = combined(jnp.asarray(y_sorted), routing.weights)
    expected = np.zeros((11, 4))
    for position, assignment in enumerate(np.asarray(routing.sort_indices)[:num_rows]):
        t, j = divmod(int(assignment), top_k)
        expected[t] += weights[t, j] * y_sorted[position]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)

    d_y = jnp.asarray(rng.normal(size=(11, 4)), jnp.float32)
    d_sorted, d_weights = jax.vjp(combined, jnp.asarray(y_sorted), routing.weights)[1](d_y)
    assert np.all(np.asarray(d_sorted)[num_rows:] == 0)
    absent = np.zeros(33, bool)
    absent[np.asarray(routing.sort_indices)[num_rows:]] = True
    assert np.all(np.asarray(d_weights).reshape(-1)[absent] == 0)
    assert np.all(np.isfinite(d_sorted)) and np.all(np.isfinite(d_weights))


def test_combine_rejects_a_num_rows_that_is_not_an_integer_scalar():
    routing = random_routing(9, 4, 3, 2)
    y_sorted = jnp.zeros((8, 2))
    with pytest.raises(ValueError, match="num_rows must be an integer scalar"):
        moe_jax.combine(y_sorted, routing.sort_indices, 2, num_rows=jnp.array([3]))
    with pytest.raises(ValueError, match="num_rows must be an integer scalar"):
        moe_jax.combine(y_sorted, routing.sort_indices, 2, num_rows=2.5)


def test_combine_inverts_permute():
    top_k = 2
    routing = random_routing(4, 9, 4, top_k)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(9, 3)), jnp.float32)
    rows = moe_jax.permute(x, routing.sort_indices, top_k)
    np.testing.assert_allclose(moe_jax.combine(rows, routing.sort_indices, top_k), top_k * x, rtol=1e-6)


@pytest.mark.parametrize("num_rows", [None, 10])
def test_combine_by_the_routings_positions_is_combine_by_sort_indices(num_rows):
    top_k = 3
    routing = random_routing(9, 8, 5, top_k)
    y_sorted = jnp.asarray(np.random.default_rng(10).normal(size=(24, 4)), jnp.float32)
    by_positions = moe_jax.combine(
        y_sorted, routing.sort_indices, top_k, routing.weights, num_rows=num_rows, positions=routing.positions
    )
    expected = moe_jax.combine(y_sorted, routing.sort_indices, top_k, routing.weights, num_rows=num_rows)
    np.testing.assert_array_equal(by_positions, expected)


def test_gradients():
    top_k = 2
    routing = random_routing(6, 7, 4, top_k)
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(7, 3)))
        y_sorted = jnp.asarray(rng.normal(size=(14, 3)))
        weights = jnp.asarray(rng.uniform(size=(7, 2)))
        # Jitted: op by op, each operation would compile a program of its own.
        check_grads(jax.jit(lambda x: reference.permute(x, routing.sort_indices, top_k)), (x,), order=1, modes=("rev",))
        check_grads(
            jax.jit(lambda y, w: reference.combine(y, routing.sort_indices, top_k, w)),
            (y_sorted, weights),
            order=1,
            modes=("rev",),
        )
