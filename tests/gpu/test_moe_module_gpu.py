"""The NNX ``moe_jax.nn.MoE`` on the device: backend "pallas" against backend "xla", gradients of every parameter.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_moe_module_gpu.py``. Tolerance:
relative-norm error ``TOL`` for the loss, ``2 * TOL`` for the gradients (bf16 compute, f32 accumulation).
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import moe_jax
from tests.oracle import relative_error

pytestmark = pytest.mark.gpu
TOL = 1e-2


def test_moe_module_pallas_matches_xla_with_gradients():
    def build(backend):
        return moe_jax.nn.MoE(
            512, 256, 16, 4, num_shared_experts=1, dtype=jnp.bfloat16, backend=backend, rngs=nnx.Rngs(7)
        )

    x = jax.random.normal(jax.random.key(8), (4, 512, 512), jnp.float32)

    def loss_and_grads(model):
        return nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))))(model)

    (loss_pallas, grads_pallas), (loss_xla, grads_xla) = (nnx.jit(loss_and_grads)(build(b)) for b in ("pallas", "xla"))
    assert relative_error(loss_pallas, loss_xla) < TOL
    for (path, actual), (_, exact) in zip(nnx.to_flat_state(grads_pallas), nnx.to_flat_state(grads_xla), strict=True):
        assert relative_error(actual[...], exact[...]) < 2 * TOL, path
