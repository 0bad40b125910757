"""Reference routing against the NumPy float64 oracle (tests/oracle.py)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_jax
from moe_jax.ops.routing import reference
from moe_jax.ops.routing.api import router_logits
from tests import oracle
from tests.helpers import jitted_vjp, normal, pairwise_by_default

WEIGHT_TOL = 1e-5  # f32 scores against float64: a few ulps


def _assert_routing_equal(routing, expected) -> None:
    np.testing.assert_array_equal(routing.experts, expected["experts"])
    np.testing.assert_array_equal(routing.group_sizes, expected["group_sizes"])
    np.testing.assert_array_equal(routing.sort_indices, expected["sort_indices"])
    np.testing.assert_allclose(routing.weights, expected["weights"], rtol=WEIGHT_TOL, atol=WEIGHT_TOL)
    np.testing.assert_allclose(routing.probs, expected["probs"], rtol=WEIGHT_TOL, atol=1e-7)
    np.testing.assert_allclose(routing.selected_scores, expected["selected_scores"], rtol=WEIGHT_TOL, atol=1e-7)
    # positions inverts sort_indices: assignment t * k + j sits at expert-sorted row positions[t, j].
    assert routing.positions.shape == routing.experts.shape and routing.positions.dtype == jnp.int32
    num_assignments = routing.experts.size
    sorted_assignments = np.asarray(expected["sort_indices"])[np.asarray(routing.positions).reshape(-1)]
    np.testing.assert_array_equal(sorted_assignments, np.arange(num_assignments))


@pytest.mark.parametrize(
    "top_k, num_groups, top_groups, use_bias, renormalize, score",
    pairwise_by_default(
        [(1, 1, 1, False), (2, 1, 1, True), (4, 4, 2, False), (3, 8, 3, True), (12, 1, 1, False)],
        [True, False],
        ["softmax", "sigmoid"],
    ),
)
def test_route_matches_oracle(score, renormalize, top_k, num_groups, top_groups, use_bias):
    seed = zlib.crc32(repr((score, renormalize, top_k, num_groups)).encode())
    logits = normal(seed, (33, 16), 2.0)
    bias = np.random.default_rng(seed + 1).normal(size=16).astype(np.float32) * 0.3 if use_bias else None
    options = dict(score=score, renormalize=renormalize, num_groups=num_groups, top_groups=top_groups, scale=1.5)
    route = jax.jit(lambda logits, bias: moe_jax.route(logits, top_k, bias=bias, **options))
    routing = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias))
    _assert_routing_equal(routing, oracle.route(logits, top_k, bias=bias, **options))


def test_k_equals_e_selects_every_expert_in_score_order():
    logits = normal(3, (9, 6), 2.0)
    routing = moe_jax.route(jnp.asarray(logits), 6)
    _assert_routing_equal(routing, oracle.route(logits, 6))
    np.testing.assert_array_equal(routing.group_sizes, np.full(6, 9))


def test_ties_go_to_the_lower_expert_index():
    # Many exact ties: logits drawn from three values, so scores tie exactly in f32 and float64 alike.
    rng = np.random.default_rng(11)
    logits = rng.choice(np.array([-1.0, 0.0, 2.0], np.float32), size=(40, 12))
    # Jitted: op by op, each operation would compile a program of its own.
    route = jax.jit(moe_jax.route, static_argnums=1, static_argnames=("score", "num_groups", "top_groups"))
    for score in ("softmax", "sigmoid"):
        routing = route(jnp.asarray(logits), 3, score=score, num_groups=4, top_groups=2)
        _assert_routing_equal(routing, oracle.route(logits, 3, score=score, num_groups=4, top_groups=2))
    all_equal = moe_jax.route(jnp.zeros((2, 5)), 3)
    np.testing.assert_array_equal(all_equal.experts, [[0, 1, 2], [0, 1, 2]])


def test_group_limit_excludes_the_best_single_expert():
    # Expert 0 has the best score but its group {0, 1} sums lower than group {2, 3}.
    logits = jnp.asarray([[5.0, -5.0, 4.0, 4.0]])
    routing = moe_jax.route(logits, 2, score="sigmoid", num_groups=2, top_groups=1)
    np.testing.assert_array_equal(routing.experts, [[2, 3]])
    ungrouped = moe_jax.route(logits, 2, score="sigmoid")
    np.testing.assert_array_equal(ungrouped.experts, [[0, 2]])


def test_bias_changes_selection_but_not_weights():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    bias = jnp.asarray([0.0, 0.0, 0.0, 10.0])
    plain = moe_jax.route(logits, 2, renormalize=False)
    biased = moe_jax.route(logits, 2, renormalize=False, bias=bias)
    np.testing.assert_array_equal(plain.experts, [[0, 1]])
    np.testing.assert_array_equal(biased.experts, [[3, 0]])
    probs = jax.nn.softmax(logits[0])
    np.testing.assert_allclose(biased.weights, [[probs[3], probs[0]]], rtol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_losses_match_oracle(score):
    logits = normal(5, (50, 8), 2.0)
    routing = moe_jax.route(jnp.asarray(logits), 2, score=score)
    expected = oracle.route(logits, 2, score=score)
    lb = moe_jax.load_balancing_loss(routing)
    assert lb.dtype == jnp.float32
    np.testing.assert_allclose(lb, oracle.load_balancing_loss(expected["probs"], expected["experts"]), rtol=1e-5)
    np.testing.assert_allclose(moe_jax.z_loss(jnp.asarray(logits)), oracle.z_loss(logits), rtol=1e-5)
    np.testing.assert_allclose(moe_jax.z_loss(routing), oracle.z_loss(logits), rtol=1e-5)


def test_perfectly_balanced_load_balancing_loss_is_one():
    # Uniform scores and every expert chosen equally often: E * sum_e (1/E)(1/E) = 1.
    routing = moe_jax.route(jnp.zeros((8, 4)), 4)
    np.testing.assert_allclose(moe_jax.load_balancing_loss(routing), 1.0, rtol=1e-6)


@pytest.mark.parametrize(
    "num_tokens, top_k, score, capacity_factor",
    [(40, 2, "softmax", 0.5), (40, 2, "sigmoid", 1.0), (40, 2, "softmax", 1.25), (10, 1, "sigmoid", 1.25)],
)
def test_apply_capacity_matches_oracle(num_tokens, top_k, score, capacity_factor):
    logits = normal(7, (num_tokens, 8), 2.0)
    logits[:, 0] += 3.0  # make expert 0 overflow

    def route_with_capacity(logits):
        return moe_jax.apply_capacity(moe_jax.route(logits, top_k, score=score), capacity_factor)

    group_sizes, sort_indices = jax.jit(route_with_capacity)(jnp.asarray(logits))
    capacity = oracle.expert_capacity(num_tokens, top_k, 8, capacity_factor)
    expected = oracle.route(logits, top_k, score=score)
    keep = oracle.capacity_keep(expected["experts"], expected["selected_scores"], capacity).reshape(-1)
    flat_experts = expected["experts"].reshape(-1)
    num_assignments = flat_experts.size
    kept = [a for a in sorted(range(num_assignments), key=lambda a: (flat_experts[a], a)) if keep[a]]
    dropped = [a for a in range(num_assignments) if not keep[a]]
    np.testing.assert_array_equal(sort_indices, kept + dropped)
    np.testing.assert_array_equal(group_sizes, np.bincount(flat_experts[keep], minlength=8))
    assert int(group_sizes.max()) == capacity, "no expert reached the capacity: the test exercises nothing"


def test_capacity_drops_by_score_not_by_renormalised_weight():
    # Token 0 gives expert 0 a low score but, renormalised over weak alternatives, the larger weight;
    # token 1 gives it a high score and the smaller weight. With room for one row, the higher score stays.
    logits = jnp.asarray([[-2.0, -6.0, -6.0], [2.0, 3.0, -6.0]])
    routing = moe_jax.route(logits, 2, score="sigmoid")
    assert routing.weights[0, 0] > routing.weights[1, 1]
    assert routing.selected_scores[0, 0] < routing.selected_scores[1, 1]
    group_sizes, sort_indices = reference.apply_capacity(routing, 1)
    np.testing.assert_array_equal(group_sizes, [1, 1, 0])
    # Kept: expert 0 <- token 1's slot 1 (assignment 3), expert 1 <- token 1's slot 0 (assignment 2).
    np.testing.assert_array_equal(sort_indices[:2], [3, 2])


def test_balancing_bias_update_moves_toward_the_mean():
    counts = jnp.asarray([10, 2, 6, 6])
    bias = moe_jax.ops.routing.api.balancing_bias_update(jnp.zeros(4), counts, 0.1)
    np.testing.assert_allclose(bias, [-0.1, 0.1, 0.0, 0.0])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_weight_and_aux_gradients(score):
    logits = normal(9, (6, 8), 2.0).astype(np.float64)

    def objective(logits):
        routing = reference.route(logits, 3, score=score, num_groups=2, top_groups=2)
        return (
            jnp.sum(routing.weights * jnp.arange(1.0, 4.0)[None, :])
            + reference.load_balancing_loss(routing)
            + reference.z_loss(logits)
            + reference.z_loss_from(routing.logsumexp)
        )

    with jax.enable_x64(True):  # jitted, as above
        check_grads(jax.jit(objective), (jnp.asarray(logits),), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


# 16-bit operands multiply as they are (their products are exact in f32) and accumulate in f32; mixed dtypes
# convert first. Against the float64 product of the same values; the gradients against float64 too (rounded to the
# operands' dtypes).
@pytest.mark.parametrize("x_dtype, kernel_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_router_logits_are_f32_products_of_the_inputs(x_dtype, kernel_dtype):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(48, 256)), x_dtype)
    kernel = jnp.asarray(rng.normal(size=(256, 24)) / 16, kernel_dtype)
    cotangent = rng.normal(size=(48, 24)).astype(np.float32)
    logits, d_x, d_kernel = jitted_vjp(router_logits, (x, kernel), jnp.asarray(cotangent))
    x64, kernel64 = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    assert logits.dtype == jnp.float32 and d_x.dtype == x.dtype and d_kernel.dtype == kernel.dtype
    np.testing.assert_allclose(np.asarray(logits), x64 @ kernel64, rtol=1e-5, atol=1e-5)
    assert oracle.relative_error(d_x, cotangent @ kernel64.T) < 1e-2
    assert oracle.relative_error(d_kernel, x64.T @ cotangent) < 1e-2
