"""moe_jax.compile_lowered and compiling_kernels_while_lowering on the device: a layer's forward + backward compiled
with its kernels in parallel (after the lowering, or from within it) computes what the plainly compiled program
computes (the kernels are the same modules, only compiled elsewhere). Tolerance:
relative-norm error ``TOL``, room for atomic accumulations' order only.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_compilation_gpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.compilation import named_kernel_programs
from tests.oracle import relative_error

pytestmark = pytest.mark.gpu
T, D, F, E, K = 2048, 512, 256, 8, 2
TOL = 1e-5


def _loss(x, router_kernel, w_gate_up, w_down):
    y, aux = moe_jax.moe_ffn(x, router_kernel, moe_jax.pack_gate_up(w_gate_up), w_down, top_k=K, backend="pallas")
    return y.astype(jnp.float32).sum() + aux.load_balancing_loss


def _layer_args():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    router_kernel = jnp.asarray(rng.normal(size=(D, E)) / np.sqrt(D), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(E, D, 2 * F)) / np.sqrt(D), jnp.bfloat16)
    w_down = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.bfloat16)
    return x, router_kernel, w_gate_up, w_down


def _assert_matches_the_plain_compilation(outputs, step, args):
    plain = jax.jit(step).trace(*args).lower().compile()(*args)
    for actual, expected in zip(jax.tree.leaves(outputs), jax.tree.leaves(plain), strict=True):
        assert relative_error(actual, expected) < TOL


def test_a_layer_compiled_with_parallel_kernels_matches_the_plain_compilation():
    args = _layer_args()
    step = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3))
    lowered = jax.jit(step).trace(*args).lower()
    assert len(named_kernel_programs(lowered)) >= 8
    _assert_matches_the_plain_compilation(moe_jax.compile_lowered(lowered)(*args), step, args)


def test_kernels_compiled_while_lowering_match_the_plain_compilation():
    args = _layer_args()
    step = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3))
    with moe_jax.compiling_kernels_while_lowering() as kernels:
        lowered = jax.jit(step).trace(*args).lower()
        assert len(kernels.futures) >= 8  # started before the program's compilation
        compiled = kernels.compile(lowered)
    assert all(future.exception() is None for future in kernels.futures if future.done() and not future.cancelled())
    _assert_matches_the_plain_compilation(compiled(*args), step, args)
