"""The whole layer with backend="pallas" under the Mosaic GPU interpreter (races detected, memory NaN-poisoned) against
backend="xla", the reference composition: forward (y and the aux outputs) and the gradients of
``sum(y * cotangent) + load_balancing_loss + 0.1 * z_loss`` with respect to x, router_kernel, w_gate_up and w_down.

One forward + backward runs eleven interpreted kernels (routing, permute, the GLU MLP, combine and their backwards), so
the layer is small: ci/layer (T = 64, D = 128, E = 4, k = 2) with F = 128 rather than 64, so that the packed gate/up
layout (blocks of 64 gate columns, each followed by its 64 up columns) is two blocks and differs from [gate | up] (at
F = 64 the two layouts coincide). The interpreter simulates 2 SMs (more than one CTA sharing a persistent tile loop;
its time grows with the SMs). Cases: dropless swiglu with the gate/up weights passed packed; capacity_factor = 0.75
(every expert keeps at most 24 of its ~32 rows) with gpt_oss and plain weights (packed per call), at D = 192: like
gpt-oss's 2880 no multiple of 128, so the permute / combine kernels' last register chunk overlaps the one before.

Inputs are bf16 (the router kernel f32, as ``moe_jax.nn.MoE`` keeps it). Routing runs on the same f32 logits in both
backends, so the expert counts must agree exactly. Tolerances are relative-norm errors: OUT_TOL for the bf16 output
(both backends accumulate in f32 and round once to bf16, so the error is at most about one bf16 ulp, 2^-8 relative);
GRAD_TOL for the gradients, where the kernels round intermediates to bf16 at other points than the reference (e.g.
the gate/up pre-activation the backward reads: kept in bf16 by the kernels, f32 inside the reference's matmul): a few
bf16 roundings, measured 2e-3 to 5e-3.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from tests import oracle
from tests.helpers import checked_interpreter, moe_layer_inputs, simulated_sms

OUT_TOL = 5e-3
GRAD_TOL = 1e-2
NUM_SMS = 2
LAYER = dataclasses.replace(shapes.LAYER_SHAPES["ci/layer"], f=128)  # see the docstring


def _inputs(seed: int, d: int) -> dict:
    rng = np.random.default_rng(seed)
    inputs = moe_layer_inputs(rng, LAYER.t, d, LAYER.f, LAYER.e)
    inputs["cotangent"] = rng.normal(size=(LAYER.t, d))
    dtypes = dict(router_kernel=jnp.float32)  # as moe_jax.nn.MoE keeps it
    return {name: jnp.asarray(value, dtypes.get(name, jnp.bfloat16)) for name, value in inputs.items()}


def _forward_and_gradients(inputs, w_gate_up, backend, **options):
    """((y, MoEAux), (d_x, d_router_kernel, d_w_gate_up, d_w_down))."""

    def objective(x, router_kernel, w_gate_up, w_down):
        y, aux = moe_jax.moe_ffn(x, router_kernel, w_gate_up, w_down, top_k=LAYER.top_k, backend=backend, **options)
        loss = jnp.sum(y.astype(jnp.float32) * inputs["cotangent"].astype(jnp.float32))
        return loss + aux.load_balancing_loss + 0.1 * aux.z_loss, (y, aux)

    args = (inputs["x"], inputs["router_kernel"], w_gate_up, inputs["w_down"])
    (_, outputs), grads = jax.value_and_grad(objective, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    return outputs, grads


@pytest.mark.parametrize(
    "seed, d_model, activation, capacity_factor, packed",
    [(1, LAYER.d, "swiglu", None, True), (2, 192, "gpt_oss", 0.75, False)],
    ids=["dropless-swiglu-packed", "capacity-0.75-gpt_oss-plain-d192"],
)
def test_moe_ffn_forward_and_gradients_match_xla(seed, d_model, activation, capacity_factor, packed):
    inputs = _inputs(seed, d_model)
    options = dict(activation=activation, capacity_factor=capacity_factor)
    w_gate_up = moe_jax.pack_gate_up(inputs["w_gate_up"]) if packed else inputs["w_gate_up"]
    with simulated_sms(NUM_SMS), checked_interpreter():
        (y, aux), grads = jax.block_until_ready(_forward_and_gradients(inputs, w_gate_up, "pallas", **options))
    (expected_y, expected_aux), expected_grads = _forward_and_gradients(inputs, inputs["w_gate_up"], "xla", **options)

    assert y.shape == expected_y.shape and y.dtype == jnp.bfloat16
    assert oracle.relative_error(y, expected_y) < OUT_TOL
    np.testing.assert_array_equal(aux.expert_counts, expected_aux.expert_counts)
    np.testing.assert_allclose(aux.load_balancing_loss, expected_aux.load_balancing_loss, rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, expected_aux.z_loss, rtol=1e-5)

    assert isinstance(grads[2], moe_jax.PackedGateUp) == packed
    grads = (grads[0], grads[1], moe_jax.unpack_gate_up(grads[2]) if packed else grads[2], grads[3])
    names = ("d_x", "d_router_kernel", "d_w_gate_up", "d_w_down")
    for name, actual, expected in zip(names, grads, expected_grads, strict=True):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert oracle.relative_error(actual, expected) < GRAD_TOL, name

    if capacity_factor is not None:
        capacity = oracle.expert_capacity(LAYER.t, LAYER.top_k, LAYER.e, capacity_factor)
        kept = int(np.minimum(np.asarray(aux.expert_counts), capacity).sum())
        assert kept < LAYER.t * LAYER.top_k, "no row was dropped: the capacity path was not exercised"
