"""The whole layer with backend="pallas" under the Mosaic GPU interpreter (races detected, memory NaN-poisoned) against
the float64 oracle (``moe_ffn`` / ``moe_ffn_gradients`` of tests/oracle.py, which share no code with the
layer's composition) and against backend="xla": forward (y and the aux outputs) and the gradients of
``sum(y * cotangent) + load_balancing_loss + 0.1 * z_loss`` with respect to x, router_kernel, w_gate_up and w_down.

One forward + backward runs eleven interpreted kernels (routing, permute, the GLU MLP, combine and their backwards), so
the layer is small: ci/layer (T = 64, D = 128, E = 4, k = 2) with F = 128 rather than 64, so that the packed gate/up
layout (blocks of 64 gate columns, each followed by its 64 up columns) is two blocks and differs from [gate | up] (at
F = 64 the two layouts coincide). The interpreter simulates 2 SMs (more than one CTA sharing a persistent tile loop;
its time grows with the SMs). Cases: dropless swiglu with the gate/up weights passed packed; a capacity (every expert
keeps at most 18 of its ~32 rows) with gpt_oss and plain weights (packed per call), at D = 192: like gpt-oss's 2880 no
multiple of 128, so the permute / combine kernels' last register chunk overlaps the one before.

Inputs are bf16 (the router kernel f32, as ``moe_jax.nn.MoE`` keeps it). Token COPIES[0] is repeated exactly and the
capacity cuts through its copies' tied scores (``capacity_factor_splitting``: the earlier two keep their first expert,
the later two lose it); x on a grid of 1/8 and the router kernel on one of 1/64 make the logits exact in f32, so equal
tokens tie on every backend and the float64 oracle routes as the layer does. Routing runs on the same f32 logits in
both backends, so the expert counts must agree exactly. Tolerances are relative-norm errors. Against the oracle:
ORACLE_TOL, the bf16 layer's tolerance against the oracle in test_moe_ffn.py (the XLA path measured 2.5e-3 to 3.3e-3
here, y and gradients: bf16 rounding of x's products, the hidden activations and the output). Against XLA: OUT_TOL
for the bf16 output (both backends accumulate in f32 and round once to bf16, so the error is at most about one bf16
ulp, 2^-8 relative); GRAD_TOL for the gradients, where the kernels round intermediates to bf16 at other points than
the reference (e.g. the gate/up pre-activation the backward reads: kept in bf16 by the kernels, f32 inside the
reference's matmul): a few bf16 roundings, measured 2e-3 to 5e-3.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from tests import oracle
from tests.helpers import checked_interpreter, simulated_sms

OUT_TOL = 5e-3
GRAD_TOL = 1e-2
ORACLE_TOL = 1e-2
NUM_SMS = 2
LAYER = dataclasses.replace(shapes.LAYER_SHAPES["ci/layer"], f=128)  # see the docstring
COPIES = [5, 20, 21, 40]


def _inputs(seed: int, d: int) -> dict:
    rng = np.random.default_rng(seed)
    t, f, e = LAYER.t, LAYER.f, LAYER.e
    x = np.round(rng.normal(size=(t, d)) * 8) / 8
    x[COPIES] = x[COPIES[0]]
    return dict(
        x=jnp.asarray(x, jnp.bfloat16),
        router_kernel=jnp.asarray(np.round(rng.normal(size=(d, e)) / np.sqrt(d) * 64) / 64, jnp.float32),
        w_gate_up=jnp.asarray(rng.normal(size=(e, d, 2 * f)) / np.sqrt(d), jnp.bfloat16),
        w_down=jnp.asarray(rng.normal(size=(e, f, d)) / np.sqrt(f), jnp.bfloat16),
        cotangent=jnp.asarray(rng.normal(size=(t, d)), jnp.bfloat16),
    )


def _forward_and_gradients(inputs, w_gate_up, backend, **options):
    """((y, MoEAux), (d_x, d_router_kernel, d_w_gate_up, d_w_down))."""

    def objective(x, router_kernel, w_gate_up, w_down):
        y, aux = moe_jax.moe_ffn(x, router_kernel, w_gate_up, w_down, top_k=LAYER.top_k, backend=backend, **options)
        loss = jnp.sum(y.astype(jnp.float32) * inputs["cotangent"].astype(jnp.float32))
        return loss + aux.load_balancing_loss + 0.1 * aux.z_loss, (y, aux)

    args = (inputs["x"], inputs["router_kernel"], w_gate_up, inputs["w_down"])
    # One program: dispatched op by op, the layer's glue would compile one small program per operation.
    (_, outputs), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    return outputs, grads


def _float64(inputs) -> dict[str, np.ndarray]:
    return {name: np.asarray(value, np.float64) for name, value in inputs.items()}


def _tie_splitting_capacity_factor(inputs) -> float:
    exact = _float64(inputs)
    routed = oracle.route(exact["x"] @ exact["router_kernel"], LAYER.top_k)
    tied = [copy * LAYER.top_k for copy in COPIES]
    return oracle.capacity_factor_splitting(routed["experts"], routed["selected_scores"], tied, LAYER.e)


@pytest.mark.parametrize(
    "seed, d_model, activation, capacity, packed",
    [(1, LAYER.d, "swiglu", False, True), (2, 192, "gpt_oss", True, False)],
    ids=["dropless-swiglu-packed", "capacity-tie-gpt_oss-plain-d192"],
)
def test_moe_ffn_forward_and_gradients_match_the_oracle_and_xla(seed, d_model, activation, capacity, packed):
    inputs = _inputs(seed, d_model)
    capacity_factor = _tie_splitting_capacity_factor(inputs) if capacity else None
    options = dict(activation=activation, capacity_factor=capacity_factor)
    w_gate_up = moe_jax.pack_gate_up(inputs["w_gate_up"]) if packed else inputs["w_gate_up"]
    with simulated_sms(NUM_SMS), checked_interpreter():
        (y, aux), grads = jax.block_until_ready(_forward_and_gradients(inputs, w_gate_up, "pallas", **options))
    (expected_y, expected_aux), expected_grads = _forward_and_gradients(inputs, inputs["w_gate_up"], "xla", **options)

    exact = _float64(inputs)
    arrays = [exact[name] for name in ("x", "router_kernel", "w_gate_up", "w_down")]
    exact_y, exact_aux = oracle.moe_ffn(*arrays, top_k=LAYER.top_k, **options)
    exact_grads = oracle.moe_ffn_gradients(
        *arrays, exact["cotangent"], top_k=LAYER.top_k, z_loss_weight=0.1, **options
    ).values()
    if capacity:  # the premise: the cut runs through the copies' tie
        np.testing.assert_array_equal(exact_aux["keep"][COPIES, 0], [True, True, False, False])

    assert y.shape == expected_y.shape and y.dtype == jnp.bfloat16
    assert oracle.relative_error(y, exact_y) < ORACLE_TOL
    assert oracle.relative_error(y, expected_y) < OUT_TOL
    np.testing.assert_array_equal(aux.expert_counts, exact_aux["expert_counts"])
    np.testing.assert_array_equal(aux.expert_counts, expected_aux.expert_counts)
    np.testing.assert_allclose(aux.load_balancing_loss, exact_aux["load_balancing_loss"], rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, exact_aux["z_loss"], rtol=1e-5)
    np.testing.assert_allclose(aux.load_balancing_loss, expected_aux.load_balancing_loss, rtol=1e-5)
    np.testing.assert_allclose(aux.z_loss, expected_aux.z_loss, rtol=1e-5)

    assert isinstance(grads[2], moe_jax.PackedGateUp) == packed
    grads = (grads[0], grads[1], moe_jax.unpack_gate_up(grads[2]) if packed else grads[2], grads[3])
    names = ("d_x", "d_router_kernel", "d_w_gate_up", "d_w_down")
    for name, actual, expected, exact_grad in zip(names, grads, expected_grads, exact_grads, strict=True):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert oracle.relative_error(actual, exact_grad) < ORACLE_TOL, name
        assert oracle.relative_error(actual, expected) < GRAD_TOL, name

    if capacity:
        rows_per_expert = oracle.expert_capacity(LAYER.t, LAYER.top_k, LAYER.e, capacity_factor)
        kept = int(np.minimum(np.asarray(aux.expert_counts), rows_per_expert).sum())
        assert kept < LAYER.t * LAYER.top_k, "no row was dropped: the capacity path was not exercised"
