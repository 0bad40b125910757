"""The sm90 permute and combine kernels on the device against the XLA reference on the same device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_permute_gpu.py``. Rows moved by permute
are bit-identical; sums agree to one rounding of their dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from tests.oracle import relative_error

pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize("name", [s.name for s in shapes.layer_shapes("bench")])
def test_permute_moves_fp8_rows_bit_exactly(name):
    # Every byte pattern (as 16-bit words: NaNs and infinities of f16 among them) arrives as it was.
    num_tokens, d_model, top_k = 1024, shapes.LAYER_SHAPES[name].d, shapes.LAYER_SHAPES[name].top_k
    routing = jax.jit(lambda x: moe_jax.route(x, top_k, backend="xla"))(
        jax.random.normal(jax.random.key(7), (num_tokens, 128), jnp.float32)
    )
    raw = jax.random.randint(jax.random.key(8), (num_tokens, d_model), 0, 256, jnp.int32).astype(jnp.uint8)
    x = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    moved = jax.jit(lambda x: moe_jax.permute(x, routing.sort_indices, top_k, backend="pallas"))(x)
    expected = np.asarray(raw)[np.asarray(routing.sort_indices) // top_k]
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(moved, jnp.uint8)), expected)


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
