"""The sm90 routing, permute and combine kernels on the device against the XLA reference on the same device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_routing_gpu.py``. Selection, counts and
the permutation must equal the reference's exactly; rows moved by permute are bit-identical; sums agree to one
rounding of their dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.routing import reference as routing_reference
from tests.oracle import relative_error

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
    # Issue #5's largest sizes: T = 256k tokens, E up to 512, k up to 16.
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


@pytest.mark.parametrize("with_positions", [False, True])  # inverting sort_indices, or Routing.positions
@pytest.mark.parametrize("name", [s.name for s in shapes.layer_shapes("bench")])
def test_permute_combine_and_gradients(name, with_positions):
    # The benchmark layers' widths and k at fewer tokens.
    num_tokens, d_model, top_k = 1024, shapes.LAYER_SHAPES[name].d, shapes.LAYER_SHAPES[name].top_k
    routing = jax.jit(lambda x: moe_jax.route(x, top_k, backend="xla"))(
        jax.random.normal(jax.random.key(3), (num_tokens, 128), jnp.float32)
    )
    keys = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(keys[0], (num_tokens, d_model), jnp.bfloat16)
    y_sorted = jax.random.normal(keys[1], (num_tokens * top_k, d_model), jnp.bfloat16)
    cotangents = (
        jax.random.normal(keys[2], (num_tokens * top_k, d_model), jnp.bfloat16),
        jax.random.normal(keys[3], (num_tokens, d_model), jnp.bfloat16),
    )

    # A combine of the first rows only (the rest NaN, as left unwritten by a grouped matmul with zero_tail=False).
    num_rows = num_tokens * top_k * 3 // 5
    positions = routing.positions if with_positions else None
    y_first = jnp.where(jnp.arange(num_tokens * top_k)[:, None] < num_rows, y_sorted, jnp.nan)

    def layer(backend):
        def apply(x, y_sorted, y_first, weights):
            rows = moe_jax.permute(x, routing.sort_indices, top_k, positions=positions, backend=backend)
            y = moe_jax.combine(y_sorted, routing.sort_indices, top_k, weights, positions=positions, backend=backend)
            first = moe_jax.combine(
                y_first, routing.sort_indices, top_k, num_rows=num_rows, positions=positions, backend=backend
            )
            return rows, y, first

        return jax.jit(lambda *args: jax.vjp(apply, *args)[1]((*cotangents, cotangents[1])) + apply(*args))

    got = layer("pallas")(x, y_sorted, y_first, routing.weights)
    expected = layer("xla")(x, y_sorted, y_first, routing.weights)
    # Moved rows and w * dy are bit-identical; sums differ by their order (dx: the reference adds k bf16 rows in bf16).
    tolerances = {"dx": 1.6e-2, "dy_sorted": 0.0, "dy_first": 0.0, "dweights": 1e-5, "rows": 0.0, "y": 8e-3}
    tolerances["y_first"] = 8e-3
    for (name, tol), g, e in zip(tolerances.items(), got, expected, strict=True):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert relative_error(g, e) <= tol, name


def test_permute_combine_at_256k_tokens():
    # T * k = 2M expert-sorted rows of D = 512: [T * k, D] arrays of 2 GiB; the combine reads all but the last rows.
    num_tokens, num_experts, top_k, d_model = 262144, 128, 8, 512
    keys = jax.random.split(jax.random.key(6), 3)
    logits = jax.random.normal(keys[0], (num_tokens, num_experts), jnp.float32)
    routing = jax.jit(lambda x: moe_jax.route(x, top_k, backend="xla"))(logits)
    x = jax.random.normal(keys[1], (num_tokens, d_model), jnp.bfloat16)
    y_sorted = jax.random.normal(keys[2], (num_tokens * top_k, d_model), jnp.bfloat16)
    num_rows = num_tokens * top_k - 12345

    def glue(backend):
        def apply(x, y_sorted, weights):
            rows = moe_jax.permute(x, routing.sort_indices, top_k, backend=backend)
            y = moe_jax.combine(y_sorted, routing.sort_indices, top_k, weights, num_rows=num_rows, backend=backend)
            return rows, y

        return jax.jit(apply)

    got = glue("pallas")(x, y_sorted, routing.weights)
    expected = glue("xla")(x, y_sorted, routing.weights)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]))
    assert relative_error(got[1], expected[1]) <= 8e-3
