"""The sm90 gating kernel under the Mosaic GPU interpreter (races detected, scratch NaN-poisoned) against the reference.

Selection, counts and the permutation must be exactly the reference's; weights and probs agree to f32 rounding
(the kernel sums the k weights and the softmax normaliser in its own order). Shapes are small: each case interprets
one to three CTAs of 64 tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.routing import config as routing_config
from moe_jax.ops.routing import reference
from tests import oracle
from tests.helpers import checked_interpreter, cuda_lowering, normal

TOL = 1e-6  # f32 weights / probs: a few ulps of values in [0, scale]


def _route(logits, top_k, bias=None, **options):
    """The kernel's routing (NumPy arrays) and the reference's of ``logits``, each as one jitted program."""
    args = (jnp.asarray(logits), None if bias is None else jnp.asarray(bias))
    with checked_interpreter():
        kernel = jax.jit(lambda x, b: moe_jax.route(x, top_k, bias=b, backend="pallas", **options))(*args)
        kernel = jax.tree.map(np.asarray, kernel)
    expected = jax.jit(lambda x, b: reference.route(x, top_k, bias=b, **options))(*args)
    return kernel, expected


def _assert_same_routing(kernel, expected) -> None:
    num_experts = expected.probs.shape[1]
    assert kernel.experts.dtype == np.int32 and kernel.sort_indices.dtype == np.int32
    assert kernel.experts.min() >= 0 and kernel.experts.max() < num_experts
    np.testing.assert_array_equal(kernel.experts, expected.experts)
    np.testing.assert_array_equal(kernel.group_sizes, expected.group_sizes)
    np.testing.assert_array_equal(kernel.sort_indices, expected.sort_indices)
    assert kernel.positions.dtype == np.int32
    np.testing.assert_array_equal(kernel.positions, expected.positions)
    np.testing.assert_allclose(kernel.weights, expected.weights, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(kernel.probs, expected.probs, rtol=TOL, atol=1e-8)
    np.testing.assert_allclose(kernel.selected_scores, expected.selected_scores, rtol=TOL, atol=1e-8)
    np.testing.assert_allclose(kernel.mean_probs, expected.mean_probs, rtol=TOL, atol=1e-8)
    np.testing.assert_allclose(kernel.logsumexp, expected.logsumexp, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, options",
    [
        (100, 16, 3, dict(score="softmax")),  # T off the 64-token block
        (70, 24, 4, dict(score="sigmoid", num_groups=4, top_groups=2, bias=True)),  # E padded to 32
        (64, 8, 8, dict(score="softmax", renormalize=False)),  # k = E
        (130, 20, 2, dict(score="sigmoid", renormalize=False, scale=2.5)),  # three blocks, a ragged one
        (64, 96, 5, dict(score="sigmoid", num_groups=8, top_groups=3, bias=True, scale=2.5)),  # DeepSeek-like, E = 96
        (100, 256, 8, dict(score="sigmoid", num_groups=8, top_groups=4, bias=True, scale=2.5)),  # DeepSeek-V3's
        (64, 40, 4, dict(score="softmax", num_groups=5, top_groups=2, bias=True)),  # 8-wide groups, E padded to 48
        (64, 512, 16, dict(score="softmax")),  # the largest E and k: two prefix-sum chunks of 256 experts
        (70, 384, 8, dict(score="sigmoid", bias=True)),  # three expert chunks of 128, their candidates ranked again
        (64, 320, 6, dict(score="softmax", num_groups=10, top_groups=3, bias=True)),  # chunks of 64: 2 groups each
        (64, 448, 8, dict(score="softmax")),  # seven ungrouped chunks of 64 (128 does not divide 448)
    ],
)
def test_random_logits_match_reference(num_tokens, num_experts, top_k, options):
    seed = num_tokens * 1000 + num_experts
    options = dict(options)
    bias = normal(seed + 1, (num_experts,), 0.3) if options.pop("bias", False) else None
    kernel, expected = _route(normal(seed, (num_tokens, num_experts), 2.0), top_k, bias=bias, **options)
    _assert_same_routing(kernel, expected)


def test_matches_float64_oracle():
    logits = normal(5, (80, 16), 2.0)
    kernel, _ = _route(logits, 4, score="sigmoid", num_groups=4, top_groups=2)
    expected = oracle.route(logits, 4, score="sigmoid", num_groups=4, top_groups=2)
    np.testing.assert_array_equal(kernel.experts, expected["experts"])
    np.testing.assert_array_equal(kernel.sort_indices, expected["sort_indices"])
    np.testing.assert_allclose(kernel.weights, expected["weights"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_experts", [12, 32, 512])  # groups of 3, of 8, and of 128 in four chunks of 128
def test_ties_go_to_the_lower_expert_index(score, num_experts):
    # Logits from three values: scores tie exactly, within groups and across them.
    logits = np.random.default_rng(11).choice(np.array([-1.0, 0.0, 2.0], np.float32), size=(64, num_experts))
    kernel, expected = _route(logits, 3, score=score, num_groups=4, top_groups=2)
    _assert_same_routing(kernel, expected)
    kernel, expected = _route(np.zeros((3, 5), np.float32), 3, score=score)
    np.testing.assert_array_equal(kernel.experts, [[0, 1, 2]] * 3)


def _adversarial_logits(seed: int, num_experts: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(64, num_experts)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.2] = -np.inf  # scattered -inf
    logits[3] = -np.inf  # a row of -inf: softmax is NaN, sigmoid is 0
    logits[5, 7] = np.nan  # one NaN
    logits[6] = np.nan  # a row of NaN
    logits[7, 2] = np.inf  # +inf: softmax row is NaN, sigmoid saturates
    logits[8] *= 1e30  # huge magnitudes
    logits[9] = 3e38  # equal huge values
    logits[10, ::2] = -3e38
    return logits


# num_groups: ungrouped; groups of E / 8 and of E / 4 experts. num_experts: the whole row in registers; four chunks of
# 128 experts. The scores alternate so that every pair of score, grouping and width runs; the rest is `slow`.
NONFINITE_CASES = [
    pytest.param(
        score,
        num_groups,
        num_experts,
        marks=() if (g + e) % 2 == ("softmax", "sigmoid").index(score) else pytest.mark.slow,
    )
    for e, num_experts in enumerate([32, 512])
    for g, num_groups in enumerate([1, 8, 4])
    for score in ("softmax", "sigmoid")
]


@pytest.mark.parametrize("score, num_groups, num_experts", NONFINITE_CASES)
def test_nan_and_infinite_logits_select_in_range_experts(score, num_groups, num_experts):
    logits = _adversarial_logits(17, num_experts)
    bias = normal(18, (num_experts,), 1.0)
    bias[4] = np.inf  # a group score of inf + (-inf) = NaN ranks as -inf
    grouped = num_groups > 1
    options = dict(score=score, num_groups=num_groups, top_groups=3, bias=bias) if grouped else dict(score=score)
    kernel, expected = _route(logits, 5, **options)
    np.testing.assert_array_equal(kernel.experts, expected.experts)
    np.testing.assert_array_equal(kernel.group_sizes, expected.group_sizes)
    np.testing.assert_array_equal(kernel.sort_indices, expected.sort_indices)
    assert kernel.positions.dtype == np.int32
    np.testing.assert_array_equal(kernel.positions, expected.positions)
    np.testing.assert_allclose(kernel.weights, expected.weights, rtol=TOL, atol=TOL, equal_nan=True)
    # The aux losses' statistics as jax.nn computes them: logsumexp -inf for a row of -inf, +inf with a +inf, NaN
    # with a NaN; the mean of probs NaN in every column that a NaN prob reaches.
    np.testing.assert_allclose(kernel.logsumexp, expected.logsumexp, rtol=TOL, atol=TOL, equal_nan=True)
    assert np.isneginf(kernel.logsumexp[3]) and np.isposinf(kernel.logsumexp[7]) and np.isnan(kernel.logsumexp[6])
    np.testing.assert_allclose(kernel.mean_probs, expected.mean_probs, rtol=TOL, atol=1e-8, equal_nan=True)
    assert kernel.experts.min() >= 0 and kernel.experts.max() < num_experts
    # A NaN row selects the lowest ids, as a row of -inf would (the documented definition).
    if not grouped:
        np.testing.assert_array_equal(kernel.experts[6], np.arange(5))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_aux_losses", [True, False])  # without: logsumexp and probs get no cotangent
def test_gradients_match_reference(score, with_aux_losses):
    logits = normal(23, (70, 16), 2.0)
    bias = normal(24, (16,), 0.3)
    cotangent = normal(25, (70, 3), 1.0)
    options = dict(score=score, num_groups=4, top_groups=2, bias=jnp.asarray(bias), scale=1.5)

    def objective(route_fn, x):
        routing = route_fn(x)
        loss = jnp.sum(routing.weights * cotangent)
        if with_aux_losses:
            loss += moe_jax.load_balancing_loss(routing) + moe_jax.z_loss(routing)
        return loss

    with checked_interpreter():
        kernel = jax.jit(jax.grad(lambda x: objective(lambda y: moe_jax.route(y, 3, backend="pallas", **options), x)))(
            jnp.asarray(logits)
        )
    expected = jax.jit(jax.grad(lambda x: objective(lambda y: reference.route(y, 3, **options), x)))(
        jnp.asarray(logits)
    )
    np.testing.assert_allclose(kernel, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "num_tokens, num_experts, options",
    [
        (70, 24, dict(num_groups=4, top_groups=2)),  # the whole row, a ragged block
        (100, 256, dict(num_groups=8, top_groups=4)),  # DeepSeek-V3's: two chunks of 128
    ],
)
def test_sigmoid_statistics_from_the_kernel(monkeypatch, num_tokens, num_experts, options):
    # ``kernel_statistics`` leaves a sigmoid router's statistics to XLA; the kernel computes them when asked.
    monkeypatch.setattr(routing_config, "kernel_statistics", lambda score: True)
    logits = normal(31, (num_tokens, num_experts), 2.0)
    kernel, expected = _route(logits, 4, score="sigmoid", **options)
    _assert_same_routing(kernel, expected)
    adversarial = _adversarial_logits(32, num_experts)
    kernel, expected = _route(adversarial, 4, score="sigmoid", **options)
    np.testing.assert_allclose(kernel.logsumexp, expected.logsumexp, rtol=TOL, atol=TOL, equal_nan=True)
    assert np.isneginf(kernel.logsumexp[3]) and np.isposinf(kernel.logsumexp[7]) and np.isnan(kernel.logsumexp[6])
    np.testing.assert_allclose(kernel.mean_probs, expected.mean_probs, rtol=TOL, atol=1e-8, equal_nan=True)

    def aux_losses(route_fn, x):
        routing = route_fn(x)
        return moe_jax.load_balancing_loss(routing) + moe_jax.z_loss(routing)

    with checked_interpreter():
        grad = jax.grad(
            lambda x: aux_losses(lambda y: moe_jax.route(y, 4, score="sigmoid", backend="pallas", **options), x)
        )
        got = jax.jit(grad)(jnp.asarray(logits))
    expected = jax.jit(jax.grad(lambda x: aux_losses(lambda y: reference.route(y, 4, score="sigmoid", **options), x)))
    np.testing.assert_allclose(got, expected(jnp.asarray(logits)), rtol=1e-5, atol=1e-6)


def test_bf16_logits_route_like_their_f32_values():
    logits = normal(29, (64, 16), 2.0).astype(jnp.bfloat16)
    kernel, expected = _route(logits, 2)
    _assert_same_routing(kernel, expected)


@pytest.mark.smoke
def test_heuristic_chunks_wide_expert_axes_only_where_chunks_fit():
    assert routing_config.heuristic_config(128, top_k=8).chunk_experts == 128  # the whole row
    assert routing_config.heuristic_config(256, top_k=8, num_groups=8).chunk_experts == 128
    assert routing_config.heuristic_config(192, top_k=8).chunk_experts == 64
    assert routing_config.heuristic_config(256, top_k=17).chunk_experts == 256  # k past MAX_CHUNKED_TOP_K
    assert routing_config.heuristic_config(160, top_k=6).chunk_experts == 160  # no chunk of 64 or 128 divides 160
    assert routing_config.heuristic_config(384, top_k=8).chunk_experts == 128
    assert routing_config.heuristic_config(320, top_k=8).chunk_experts == 64
    assert routing_config.heuristic_config(448, top_k=8).chunk_experts == 64
    assert routing_config.heuristic_config(512, top_k=17).chunk_experts == 512  # k past MAX_CHUNKED_TOP_K
    assert routing_config.heuristic_config(384, top_k=6, num_groups=8).chunk_experts == 384  # groups of 48 straddle


@pytest.mark.smoke
def test_auto_takes_the_kernel_only_where_it_measured_faster():
    assert routing_config.prefers_kernel(256, 8, 8)  # chunks of 128
    assert routing_config.prefers_kernel(256, 17, 1)  # the whole row
    assert routing_config.prefers_kernel(384, 8, 1)  # chunks of 128
    assert not routing_config.prefers_kernel(384, 6, 8)  # groups of 48 straddle chunks: the (slow) whole row
    assert not routing_config.prefers_kernel(288, 8, 1)  # no chunk of 64 or 128 divides 288
    assert routing_config.prefers_kernel(512, 10, 1)  # chunks of 128 at a wide k: 1.8x XLA's route
    assert not routing_config.prefers_kernel(512, 16, 1)  # chunked, but a tie with XLA's route (1.02x): left to XLA
    assert not routing_config.prefers_kernel(512, 17, 1)  # past MAX_CHUNKED_TOP_K: the (slow) whole row


def test_config_rejects_a_chunk_off_the_swizzle_tile():
    with pytest.raises(ValueError, match="chunk_experts must divide"):
        routing_config.Config(padded_experts=256, rank_chunk=256, chunk_experts=32)


# Shipped configurations: (T, E, k, options) of the benchmark layers' routers, and the extremes of E and k. Lowering
# runs the whole Mosaic GPU pipeline up to the custom call.
SHIPPED = {
    **{
        s.name: (s.t, s.e, s.top_k, dict(s.route_options(), bias=s.selection_bias))
        for s in shapes.layer_shapes("bench")
    },
    "e512-k16": (4096, 512, 16, dict(score="softmax")),  # chunks of 128: 4 x 16 candidates ranked again
    "e384-k8-chunks": (4096, 384, 8, dict(score="sigmoid", bias=True)),
    "e448-k8-chunks-of-64": (4096, 448, 8, dict(score="softmax")),
    "e320-grouped-chunks": (4096, 320, 6, dict(score="softmax", num_groups=10, top_groups=3, bias=True)),
    "e60-k4": (1000, 60, 4, dict(score="softmax")),
}


@pytest.mark.smoke
@pytest.mark.parametrize("name", list(SHIPPED))
def test_lowers_for_cuda(name):
    num_tokens, num_experts, top_k, options = SHIPPED[name]
    options = dict(options)
    bias = jax.ShapeDtypeStruct((num_experts,), jnp.float32) if options.pop("bias", False) else None
    logits = jax.ShapeDtypeStruct((num_tokens, num_experts), jnp.float32)

    def forward_and_backward(logits, bias):
        def objective(x):
            routing = moe_jax.route(x, top_k, bias=bias, backend="pallas", **options)
            return jnp.sum(routing.weights) + moe_jax.load_balancing_loss(routing), routing.sort_indices

        return jax.grad(objective, has_aux=True)(logits)

    assert cuda_lowering(forward_and_backward, logits, bias).count("custom_call @mosaic_gpu") == 1
