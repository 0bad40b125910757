"""The sm90 gating kernel on the device against the XLA reference on the same device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_routing_gpu.py``. Selection, counts and
the permutation must equal the reference's exactly; weights and the aux losses' statistics agree to f32 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.routing import reference as routing_reference

pytestmark = pytest.mark.gpu

# (T, E, k, options): the benchmark layers' routers at a smaller T, and the extremes of E, k and T.
ROUTERS = {
    **{
        s.name: (4096, s.e, s.top_k, dict(s.route_options(), bias=s.selection_bias))
        for s in shapes.layer_shapes("bench")
    },
    "e512-k16": (2048, 512, 16, dict(score="softmax")),
    "e384-chunks": (4096, 384, 8, dict(score="sigmoid", bias=True)),  # three chunks of 128 experts
    "e320-grouped-chunks": (2048, 320, 6, dict(score="softmax", num_groups=10, top_groups=3, bias=True)),  # of 64
    "e448-chunks-of-64": (4096, 448, 8, dict(score="softmax")),  # seven ungrouped chunks of 64 experts
    "e60": (1000, 60, 4, dict(score="sigmoid", renormalize=False)),
    # The largest routing sizes the kernels target: T = 256k tokens, E up to 512, k up to 16.
    "t256k-e128-k8": (262144, 128, 8, dict(score="softmax")),
    "t256k-e256-k8-grouped": (262144, 256, 8, dict(score="sigmoid", num_groups=8, top_groups=4, bias=True)),
    "t256k-e512-k16": (262144, 512, 16, dict(score="softmax")),
}


def _routings(logits, top_k, **options):
    options = dict(options)
    bias = None
    if options.pop("bias", False):
        bias = jnp.asarray(np.random.default_rng(1).normal(size=logits.shape[1]).astype(np.float32) * 0.1)
    kernel = jax.jit(lambda x: moe_jax.route(x, top_k, bias=bias, backend="pallas", **options))(logits)
    expected = jax.jit(lambda x: routing_reference.route(x, top_k, bias=bias, **options))(logits)
    return jax.tree.map(np.asarray, kernel), jax.tree.map(np.asarray, expected)


def _assert_same_routing(kernel, expected) -> None:
    np.testing.assert_array_equal(kernel.experts, expected.experts)
    np.testing.assert_array_equal(kernel.group_sizes, expected.group_sizes)
    np.testing.assert_array_equal(kernel.sort_indices, expected.sort_indices)
    np.testing.assert_array_equal(kernel.positions, expected.positions)
    np.testing.assert_allclose(kernel.weights, expected.weights, rtol=1e-5, atol=1e-6, equal_nan=True)
    # The aux losses' statistics (NaN, -inf and +inf where jax.nn.logsumexp gives them).
    np.testing.assert_allclose(kernel.logsumexp, expected.logsumexp, rtol=1e-5, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(kernel.mean_probs, expected.mean_probs, rtol=1e-5, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_matches_reference(name):
    num_tokens, num_experts, top_k, options = ROUTERS[name]
    logits = jax.random.normal(jax.random.key(0), (num_tokens, num_experts), jnp.float32) * 2
    kernel, expected = _routings(logits, top_k, **options)
    _assert_same_routing(kernel, expected)
    np.testing.assert_allclose(kernel.probs, expected.probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_experts", [128, 512])  # the whole row; chunks of 128 experts
def test_route_adversarial_logits(score, num_experts):
    rng = np.random.default_rng(2)
    logits = rng.choice(np.array([-1.0, 0.0, 2.0], np.float32), size=(256, num_experts))  # exact ties everywhere
    logits[rng.random(logits.shape) < 0.05] = -np.inf
    logits[3] = -np.inf
    logits[5, 7] = np.nan
    logits[6] = np.nan
    logits[7, 2] = np.inf
    logits[8] = rng.normal(size=num_experts) * 1e30
    for options in (dict(score=score), dict(score=score, num_groups=8, top_groups=4, bias=True)):
        kernel, expected = _routings(jnp.asarray(logits), 8, **options)
        _assert_same_routing(kernel, expected)
        assert kernel.experts.min() >= 0 and kernel.experts.max() < num_experts
