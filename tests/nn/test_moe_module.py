"""Flax NNX modules: init, apply, gradients and an optax step under nnx.jit; aux values; the balancing bias."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import moe_jax
from moe_jax.ops.grouped_matmul.packing import gate_up_block
from tests import oracle

# The modules' calls as jitted programs: op by op, each call would compile one small program per operation and shape.
_apply = nnx.jit(lambda module, x: module(x))
_capture = nnx.jit(lambda module, x: nnx.capture(module, nnx.Intermediate)(x))


def _moe(**overrides):
    options = dict(activation="swiglu", rngs=nnx.Rngs(0)) | overrides
    return moe_jax.nn.MoE(16, 8, 6, 2, **options)


def _gate_up_halves(w_gate_up) -> np.ndarray:
    """The module's packed [E, D, 2F] gate/up parameter as [gate | up] (what the oracle reads)."""
    packed = moe_jax.PackedGateUp(w_gate_up, gate_up_block(w_gate_up.shape[2] // 2))
    return np.asarray(moe_jax.unpack_gate_up(packed))


def _oracle_arrays(model, x) -> list[np.ndarray]:
    """(x, router kernel, [gate | up] weights, down weights) as the oracle takes them."""
    return [
        np.asarray(x),
        np.asarray(model.router.kernel[...]),
        _gate_up_halves(model.w_gate_up[...]),
        np.asarray(model.w_down[...]),
    ]


def _routed_oracle(model, x, **options) -> np.ndarray:
    """The NumPy oracle's routed-expert output [T, D] for [T, D] tokens x under the module's parameters."""
    expected, _ = oracle.moe_ffn(*_oracle_arrays(model, x), top_k=model.router.top_k, **options)
    return expected


@pytest.mark.parametrize("d_ff", [8, 64])  # F = 64: gate and up columns interleaved in blocks of 64; F = 8: not
def test_module_applies_moe_ffn_to_its_parameters(d_ff):
    model = moe_jax.nn.MoE(16, d_ff, 6, 2, activation="swiglu", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 5, 16))
    y = _apply(model, x)
    assert y.shape == x.shape
    expected = _routed_oracle(model, np.asarray(x).reshape(15, 16))
    assert oracle.relative_error(np.asarray(y).reshape(15, 16), expected) < 1e-5


def test_gate_up_weights_are_stored_packed():
    model = moe_jax.nn.MoE(16, 128, 4, 2, num_shared_experts=1, rngs=nnx.Rngs(0))
    for stored in (model.w_gate_up[...], model.shared.w_gate_up[...]):
        halves = _gate_up_halves(stored)
        np.testing.assert_array_equal(moe_jax.pack_gate_up(jnp.asarray(halves)).array, stored)
        assert not np.array_equal(halves, np.asarray(stored)), "F = 128: packing moves columns"


def test_parameter_shapes_dtypes_and_sharding_names():
    model = _moe(param_dtype=jnp.bfloat16, num_shared_experts=2)
    assert model.router.kernel[...].shape == (16, 6)
    assert model.w_gate_up[...].shape == (6, 16, 16) and model.w_gate_up[...].dtype == jnp.bfloat16
    assert model.w_down[...].shape == (6, 8, 16)
    assert model.w_gate_up.get_metadata()["out_sharding"] == ("expert", None, None)
    assert model.shared.w_gate_up[...].shape == (1, 16, 32)
    # Fan-in scaled init: entries of a [D, 2F] expert slice have std about 1/sqrt(D).
    std = float(jnp.std(model.w_gate_up[...].astype(jnp.float32)))
    assert 0.5 / 4 < std < 1.5 / 4


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
def test_shared_experts_add_an_always_on_glu_mlp(activation):
    model = _moe(activation=activation, num_shared_experts=2, rngs=nnx.Rngs(4))
    x = jax.random.normal(jax.random.key(2), (7, 16))
    routed = _routed_oracle(model, x, activation=activation)
    shared_gate_up = _gate_up_halves(model.shared.w_gate_up[...])[0]  # [D, 2 * 2F]: two experts' width
    shared_down = np.asarray(model.shared.w_down[...])[0]
    gate_up = np.asarray(x, np.float64) @ shared_gate_up
    half = gate_up.shape[1] // 2
    shared = oracle.gated_activation(gate_up[:, :half], gate_up[:, half:], activation) @ shared_down
    assert oracle.relative_error(_apply(model, x), routed + shared) < 1e-5


def test_compute_dtype():
    """dtype=bf16: f32 parameters and input are cast, the output is bf16 and close to the f32 layer (bf16 rounding
    of x, the weights and the hidden activations: 2e-2)."""
    model = _moe(dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(2), (12, 16))
    y = _apply(model, x)
    assert y.dtype == jnp.bfloat16 and model.w_gate_up[...].dtype == jnp.float32
    assert oracle.relative_error(y, _routed_oracle(model, x)) < 2e-2


def test_aux_values_are_sown_and_captured():
    """The sown MoEAux against the oracle's: expert counts exactly, the losses to f32 rounding (1e-5). With a balancing
    bias, which moves the selection (so the counts) and never the scores the load-balancing loss averages."""
    model = _moe(balance_bias=True)
    bias = np.linspace(-0.3, 0.3, 6, dtype=np.float32)
    model.router.bias[...] = jnp.asarray(bias)
    x = jax.random.normal(jax.random.key(3), (10, 16))
    _, intermediates = _capture(model, x)
    (aux,) = intermediates["moe_aux"].get_value()
    assert isinstance(aux, moe_jax.MoEAux)
    assert int(aux.expert_counts.sum()) == 20
    assert float(aux.load_balancing_loss) > 0 and float(aux.z_loss) > 0
    _, expected = oracle.moe_ffn(*_oracle_arrays(model, x), top_k=2, bias=bias)
    np.testing.assert_array_equal(aux.expert_counts, expected["expert_counts"])
    np.testing.assert_allclose(aux.load_balancing_loss, expected["load_balancing_loss"], rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, expected["z_loss"], rtol=1e-5)


def test_optax_step_under_nnx_jit_lowers_the_loss_and_leaves_the_bias_alone():
    model = _moe(balance_bias=True)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)

    def loss_fn(model):
        y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
        (aux,) = intermediates["moe_aux"].get_value()
        return jnp.mean((y - target) ** 2) + 1e-2 * aux.load_balancing_loss, aux

    @nnx.jit
    def train_step(model, optimizer):
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        model.update_bias(aux.expert_counts, 1e-3)
        return loss, aux.expert_counts

    losses, expected_bias = [], np.zeros(6)
    for _ in range(8):
        loss, counts = train_step(model, optimizer)
        losses.append(float(loss))
        # Over-loaded experts (more than the mean count) lowered by the rate, under-loaded ones raised.
        counts = np.asarray(counts)
        expected_bias += 1e-3 * np.sign(counts.mean() - counts)
    assert losses[-1] < losses[0]
    # Only the balancing rule moved the bias: 8 steps of +-1e-3 at most.
    bias = np.asarray(model.router.bias[...])
    assert np.abs(bias).max() <= 8e-3 + 1e-9 and np.abs(bias).max() > 0
    np.testing.assert_allclose(bias, expected_bias, atol=1e-7)


def test_gradients_reach_every_parameter():
    """The gradients of sum(y^2) against the oracle's at f32 rounding (1e-5): the router's and the routed experts' by
    ``moe_ffn_gradients``, the shared expert's as those of a layer of one expert (k = 1, every weight 1)."""
    model = _moe(num_shared_experts=1)
    x = jax.random.normal(jax.random.key(5), (12, 16))

    def loss(model):
        y = model(x)
        return jnp.sum(y**2), y

    grads, y = nnx.jit(nnx.grad(loss, has_aux=True))(model)
    for path, grad in nnx.to_flat_state(grads):
        assert float(jnp.abs(grad[...]).sum()) > 0, path

    cotangent = 2 * np.asarray(y, np.float64)  # of sum(y^2); y itself is checked against the oracle above
    routed = oracle.moe_ffn_gradients(*_oracle_arrays(model, x), cotangent, top_k=2, load_balancing_weight=0.0)
    shared_weights = (_gate_up_halves(model.shared.w_gate_up[...]), np.asarray(model.shared.w_down[...]))
    one_expert_router = np.zeros((16, 1))
    shared = oracle.moe_ffn_gradients(
        np.asarray(x), one_expert_router, *shared_weights, cotangent, top_k=1, load_balancing_weight=0.0
    )
    expected = {
        ("router", "kernel"): routed["router_kernel"],
        ("w_gate_up",): routed["w_gate_up"],
        ("w_down",): routed["w_down"],
        ("shared", "w_gate_up"): shared["w_gate_up"],
        ("shared", "w_down"): shared["w_down"],
    }
    for path, grad in nnx.to_flat_state(grads):
        actual = _gate_up_halves(grad[...]) if path[-1] == "w_gate_up" else grad[...]
        assert oracle.relative_error(actual, expected[path]) < 1e-5, path


def test_update_balancing_biases_reaches_nested_layers():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([_moe(balance_bias=True, rngs=rngs) for _ in range(2)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Stack(nnx.Rngs(6))
    x = jax.random.normal(jax.random.key(7), (20, 16))
    _, intermediates = _capture(model, x)
    moe_jax.nn.update_balancing_biases(model, intermediates, 0.5)
    for i, layer in enumerate(model.layers):
        assert np.abs(np.asarray(layer.router.bias[...])).max() == pytest.approx(0.5)
        (aux,) = intermediates["layers"][i]["moe_aux"].get_value()
        counts = np.asarray(aux.expert_counts)  # over-loaded experts lowered, under-loaded ones raised
        np.testing.assert_array_equal(layer.router.bias[...], 0.5 * np.sign(counts.mean() - counts))


def test_router_module_returns_a_routing():
    router = moe_jax.nn.Router(16, 6, 2, score="sigmoid", rngs=nnx.Rngs(8))
    x = jax.random.normal(jax.random.key(9), (5, 16))
    routing = _apply(router, x)
    expected = oracle.route(np.asarray(x) @ np.asarray(router.kernel[...]), 2, score="sigmoid")
    np.testing.assert_array_equal(routing.experts, expected["experts"])


@pytest.mark.parametrize("option", [dict(dispatch="all_to_all"), dict(buffer_factor=1.0), dict(num_chunks=2)])
def test_expert_parallel_options_need_expert_parallel(option):
    with pytest.raises(ValueError, match="expert_parallel=True"):
        moe_jax.nn.MoE(16, 8, 4, 2, rngs=nnx.Rngs(0), **option)
