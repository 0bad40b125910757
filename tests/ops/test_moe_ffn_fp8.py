"""The FP8 layer: ``moe_ffn`` / ``glu_mlp`` / ``nn.MoE`` with ``quantization=`` (backend "xla") against the float64
oracle on the unquantized weights, and the checks of its arguments.

Tolerances are the recipe's: e4m3 keeps 3 fraction bits (~2.6 % relative per quantized operand); the layer quantizes
four operands on the way to y (x, the gate_up weights, the hidden activations, the down weights), so y lies within
``Y_TOL`` of the unquantized layer, and the gradients, whose GEMMs quantize their own operands again, within
``GRAD_TOL``. ``MIN_QUANTIZATION_ERROR`` is the floor that shows the operands were quantized at all.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from tests import oracle
from tests.helpers import moe_layer_inputs

Y_TOL = 8e-2
GRAD_TOL = 1.5e-1
MIN_QUANTIZATION_ERROR = 5e-3
QUANTIZATIONS = ["fp8_block", "mxfp8"]

# The fp8_block layer (k = 2, XLA) as one jitted program: op by op, each operation would compile on its own.
_fp8_block_layer = jax.jit(functools.partial(moe_jax.moe_ffn, top_k=2, backend="xla", quantization="fp8_block"))


def _layer(seed, num_tokens=64, d_model=256, d_ff=128, num_experts=4):
    inputs = moe_layer_inputs(np.random.default_rng(seed), num_tokens, d_model, d_ff, num_experts)
    return tuple(inputs[name].astype(np.float32) for name in ("x", "router_kernel", "w_gate_up", "w_down"))


@pytest.mark.parametrize(
    "quantization, options",
    [
        ("fp8_block", dict(top_k=2)),
        ("fp8_block", dict(top_k=1, activation="geglu", score="sigmoid", renormalize=False)),
        ("mxfp8", dict(top_k=2)),
    ],
)
def test_layer_and_gradients_are_close_to_the_unquantized_oracle(quantization, options):
    x, router_kernel, w_gate_up, w_down = _layer(0)
    cotangent = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)

    def loss(*arrays):
        y, _ = moe_jax.moe_ffn(*arrays, backend="xla", quantization=quantization, **options)
        return jnp.sum(y * cotangent), y

    arrays = tuple(map(jnp.asarray, (x, router_kernel, w_gate_up, w_down)))
    grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*arrays)
    expected_y, _ = oracle.moe_ffn(x, router_kernel, w_gate_up, w_down, **options)
    error = oracle.relative_error(y, expected_y)
    assert MIN_QUANTIZATION_ERROR < error < Y_TOL
    expected = oracle.moe_ffn_gradients(
        x, router_kernel, w_gate_up, w_down, cotangent, load_balancing_weight=0.0, **options
    )
    for name, grad in zip(("x", "router_kernel", "w_gate_up", "w_down"), grads, strict=True):
        assert oracle.relative_error(grad, expected[name]) < GRAD_TOL, name


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_glu_mlp_is_close_to_the_unquantized_oracle(quantization):
    rng = np.random.default_rng(2)
    _, _, w_gate_up, w_down = _layer(3)
    sizes = np.array([0, 40, 1, 19], np.int32)  # an empty group, a one-row group, 4 rows past the sum
    x = rng.normal(size=(64, 256)).astype(np.float32)
    row_scale = rng.uniform(0.2, 1.0, size=64).astype(np.float32)
    layer = functools.partial(moe_jax.glu_mlp, backend="xla", quantization=quantization)
    y = jax.jit(layer)(*map(jnp.asarray, (x, w_gate_up, w_down, sizes)), row_scale=jnp.asarray(row_scale))
    hidden = oracle.grouped_matmul(x, w_gate_up, sizes, activation="swiglu")
    expected = oracle.grouped_matmul(hidden, w_down, sizes, row_scale=row_scale)
    assert MIN_QUANTIZATION_ERROR < oracle.relative_error(y, expected) < Y_TOL
    assert float(jnp.max(jnp.abs(y[sizes.sum() :]))) == 0.0


def test_pre_quantized_weights_give_the_same_layer():
    x, router_kernel, w_gate_up, w_down = map(jnp.asarray, _layer(4))
    packed = moe_jax.pack_gate_up(w_gate_up)
    quantized = [jax.jit(moe_jax.ops.grouped_matmul.api.quantize_weights)(w) for w in (packed, w_down)]
    y, _ = _fp8_block_layer(x, router_kernel, packed, w_down)
    y_quantized, _ = _fp8_block_layer(x, router_kernel, *quantized)
    np.testing.assert_array_equal(y_quantized, y)


def test_quantization_arguments_are_checked():
    x, router_kernel, w_gate_up, w_down = map(jnp.asarray, _layer(5))
    with pytest.raises(ValueError, match="quantization"):
        moe_jax.moe_ffn(x, router_kernel, w_gate_up, w_down, top_k=2, quantization="fp4")
    w_down_fp8 = moe_jax.ops.grouped_matmul.api.quantize_weights(w_down)
    with pytest.raises(TypeError, match="w_down is a BlockScaled"):
        moe_jax.moe_ffn(x, router_kernel, w_gate_up, w_down_fp8, top_k=2)
    with pytest.raises(TypeError, match="w_down is a QuantizedMaster"):
        moe_jax.moe_ffn(x, router_kernel, w_gate_up, moe_jax.quantize_master(w_down), top_k=2)
    with pytest.raises(TypeError, match="x: glu_mlp quantizes x itself"):
        moe_jax.glu_mlp(
            moe_jax.quantize_blockwise(x, (1, 128)),
            w_gate_up,
            w_down,
            jnp.array([64, 0, 0, 0], jnp.int32),
            quantization="fp8_block",
        )


def test_nn_moe_with_quantization_is_moe_ffn_with_it():
    layer = moe_jax.nn.MoE(256, 128, 4, 2, quantization="fp8_block", backend="xla", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 16, 256)), jnp.float32)
    w_gate_up = moe_jax.PackedGateUp(layer.w_gate_up[...], moe_jax.ops.grouped_matmul.packing.gate_up_block(128))
    expected, _ = _fp8_block_layer(x.reshape(-1, 256), layer.router.kernel[...], w_gate_up, layer.w_down[...])
    np.testing.assert_array_equal(nnx.jit(lambda layer, x: layer(x))(layer, x).reshape(-1, 256), expected)
