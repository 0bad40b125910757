"""The composed layer (backend "xla") against the NumPy float64 oracle; jit-once; gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_jax
from tests import oracle
from tests.helpers import moe_layer_inputs

TOL = 1e-5  # f32 end to end


def _layer(seed, num_tokens=24, d_model=16, d_ff=8, num_experts=6, dtype=np.float32):
    inputs = moe_layer_inputs(np.random.default_rng(seed), num_tokens, d_model, d_ff, num_experts)
    return tuple(inputs[name].astype(dtype) for name in ("x", "router_kernel", "w_gate_up", "w_down"))


@pytest.mark.parametrize(
    "options",
    [
        dict(top_k=2, activation="swiglu"),
        dict(top_k=1, activation="geglu", score="sigmoid", renormalize=False, scale=2.0),
        dict(top_k=3, activation="gpt_oss", score="sigmoid", num_groups=3, top_groups=2),
        dict(top_k=2, activation="swiglu", capacity_factor=0.75),
        dict(top_k=6, activation="swiglu", capacity_factor=1.0),
        dict(top_k=1, activation="swiglu", score="sigmoid", capacity_factor=1.3),
    ],
    ids=["swiglu", "geglu-sigmoid", "gpt_oss-grouped", "capacity-0.75", "k=E-capacity-1", "capacity-fractional"],
)
def test_matches_token_by_token_oracle(options):
    x, router_kernel, w_gate_up, w_down = _layer(0)
    bias = np.linspace(-0.2, 0.2, 6).astype(np.float32) if options.get("num_groups") else None
    # One jitted program: op by op, the layer would compile one small program per operation and shape.
    layer = jax.jit(functools.partial(moe_jax.moe_ffn, backend="xla", **options))
    y, aux = layer(
        *map(jnp.asarray, (x, router_kernel, w_gate_up, w_down)), bias=None if bias is None else jnp.asarray(bias)
    )
    expected_y, expected_aux = oracle.moe_ffn(x, router_kernel, w_gate_up, w_down, bias=bias, **options)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert oracle.relative_error(y, expected_y) < TOL
    np.testing.assert_allclose(aux.load_balancing_loss, expected_aux["load_balancing_loss"], rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, expected_aux["z_loss"], rtol=1e-5)
    np.testing.assert_array_equal(aux.expert_counts, expected_aux["expert_counts"])


def test_bf16_layer_is_close_to_the_f32_oracle():
    x, router_kernel, w_gate_up, w_down = _layer(1)
    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (x, w_gate_up, w_down)]
    y, _ = moe_jax.moe_ffn(bf16[0], jnp.asarray(router_kernel), bf16[1], bf16[2], top_k=2)
    # Routing decisions are taken on the bf16-rounded input, so the oracle gets the same rounded values.
    rounded = [np.asarray(a, np.float64) for a in bf16]
    expected, _ = oracle.moe_ffn(rounded[0], router_kernel, rounded[1], rounded[2], top_k=2)
    assert y.dtype == jnp.bfloat16
    assert oracle.relative_error(y, expected) < 1e-2


def test_one_compilation_serves_every_routing():
    x, router_kernel, w_gate_up, w_down = _layer(2)
    traces = []

    @jax.jit
    def layer(x, router_kernel):
        traces.append(1)
        return moe_jax.moe_ffn(x, router_kernel, w_gate_up, w_down, top_k=2, backend="xla")

    counts = set()
    for seed in range(4):
        kernel = np.random.default_rng(100 + seed).normal(size=router_kernel.shape).astype(np.float32) * (seed + 1)
        _, aux = layer(jnp.asarray(x), jnp.asarray(kernel))
        counts.add(tuple(np.asarray(aux.expert_counts)))
    assert len(traces) == 1
    assert len(counts) > 1, "the routings did not differ"


def test_no_host_transfer_inside_the_layer():
    x, router_kernel, w_gate_up, w_down = _layer(3)
    with jax.transfer_guard("disallow"):
        args = [jax.device_put(a) for a in (x, router_kernel, w_gate_up, w_down)]
        jax.jit(lambda *a: moe_jax.moe_ffn(*a, top_k=2, capacity_factor=1.0))(*args)[0].block_until_ready()


def test_gradients_float64():
    x, router_kernel, w_gate_up, w_down = _layer(4, num_tokens=8, d_model=6, d_ff=4, num_experts=4, dtype=np.float64)

    def loss(x, router_kernel, w_gate_up, w_down):
        y, aux = moe_jax.moe_ffn(x, router_kernel, w_gate_up, w_down, top_k=2, backend="xla")
        return jnp.sum(y**2) + aux.load_balancing_loss + 0.1 * aux.z_loss

    with jax.enable_x64(True):
        args = tuple(map(jnp.asarray, (x, router_kernel, w_gate_up, w_down)))
        check_grads(jax.jit(loss), args, order=1, modes=("rev",), eps=1e-6)  # jitted: as above
