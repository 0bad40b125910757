"""moe_jax.compile_lowered on the device: a layer's forward + backward compiled with its kernels in parallel computes
what the plainly compiled program computes (the kernels are the same modules, only compiled elsewhere). Tolerance:
relative-norm error ``TOL``, room for atomic accumulations' order only.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_compilation_gpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.compilation import kernel_programs
from tests.oracle import relative_error

pytestmark = pytest.mark.gpu
T, D, F, E, K = 2048, 512, 256, 8, 2
TOL = 1e-5


def _loss(x, router_kernel, w_gate_up, w_down):
    y, aux = moe_jax.moe_ffn(x, router_kernel, moe_jax.pack_gate_up(w_gate_up), w_down, top_k=K, backend="pallas")
    return y.astype(jnp.float32).sum() + aux.load_balancing_loss


def test_a_layer_compiled_with_parallel_kernels_matches_the_plain_compilation():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    router_kernel = jnp.asarray(rng.normal(size=(D, E)) / np.sqrt(D), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(E, D, 2 * F)) / np.sqrt(D), jnp.bfloat16)
    w_down = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.bfloat16)
    args = (x, router_kernel, w_gate_up, w_down)
    step = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3))
    lowered = jax.jit(step).trace(*args).lower()
    assert len(kernel_programs(lowered)) >= 8
    parallel = moe_jax.compile_lowered(lowered)(*args)
    plain = jax.jit(step).trace(*args).lower().compile()(*args)
    for actual, expected in zip(jax.tree.leaves(parallel), jax.tree.leaves(plain), strict=True):
        assert relative_error(actual, expected) < TOL
