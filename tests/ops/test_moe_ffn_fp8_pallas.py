"""The FP8 layer's kernel path (``moe_ffn(quantization="fp8_block", backend="pallas")``: the routing and permute
kernels, the FP8 forward and dgrad kernels) under the checking Mosaic GPU interpreter against backend="xla" with the
same quantization, forward and the gradients of ``sum(y * cotangent)``.

Both paths quantize the same operands the same way; they differ where an f32 sum is rounded to bf16 (the hidden
activations, the output), and a rare such flip that meets an e4m3 rounding boundary when the hidden activations or a
gradient are quantized again moves one element by a whole e4m3 step (2^-4 relative): ``TOL`` covers a few of those
in the relative norm. The gradients get ``GRAD_TOL`` (test_glu_mlp_fp8_pallas.py's ``MLP_GRAD_TOL``: under the
interpreter the kernel may quantize the kept pre-activation from f32 values, not their bf16 rounding).
``MIN_QUANTIZATION_ERROR`` against the unquantized bf16 layer shows the kernels quantized.
Shapes: T = 64, D = 128, F = 128, E = 4, k = 2 on 2 simulated SMs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from tests import oracle
from tests.helpers import checked_interpreter, moe_layer_inputs, simulated_sms

TOL = 2e-2
GRAD_TOL = 3e-2
MIN_QUANTIZATION_ERROR = 5e-3
NUM_SMS = 2


def test_kernel_path_matches_the_xla_path():
    inputs = moe_layer_inputs(np.random.default_rng(0), 64, 128, 128, 4)
    x, w_gate_up, w_down = (jnp.asarray(inputs[n], jnp.bfloat16) for n in ("x", "w_gate_up", "w_down"))
    router_kernel = jnp.asarray(inputs["router_kernel"], jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.bfloat16)

    def run(backend, quantization="fp8_block"):
        def loss(*arrays):
            y, _ = moe_jax.moe_ffn(*arrays, top_k=2, backend=backend, quantization=quantization)
            return jnp.sum(y.astype(jnp.float32) * cotangent), y

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, router_kernel, w_gate_up, w_down)

    with checked_interpreter(), simulated_sms(NUM_SMS):
        kernel_grads, kernel_y = run("pallas")
    xla_grads, xla_y = run("xla")
    unquantized_y = run("xla", None)[1]
    assert oracle.relative_error(kernel_y, xla_y) < TOL
    assert oracle.relative_error(kernel_y, unquantized_y) > MIN_QUANTIZATION_ERROR
    for name, actual, expected in zip(
        ("x", "router_kernel", "w_gate_up", "w_down"), kernel_grads, xla_grads, strict=True
    ):
        assert oracle.relative_error(actual, expected) < GRAD_TOL, name


def test_pallas_backend_refuses_shapes_the_fp8_kernel_cannot_take():
    inputs = moe_layer_inputs(np.random.default_rng(2), 16, 96, 64, 4)  # D = 96: down's N, no multiple of 64
    arrays = [jnp.asarray(inputs[n], jnp.bfloat16) for n in ("x", "router_kernel", "w_gate_up", "w_down")]
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        moe_jax.moe_ffn(*arrays, top_k=2, backend="pallas", quantization="fp8_block")
