"""Capacity drops against the float64 oracle's own capacity (``capacity_keep``: an assignment is kept when fewer than
``capacity`` assignments to its expert outrank it; of equal scores the earlier assignment outranks the later).

The inputs make what a capacity path can get wrong visible in the output. Token COPIES[0] is repeated exactly, so the
copies' scores tie bit for bit, and the capacity factor (``capacity_factor_splitting``) cuts through that tie: half
the copies keep their first expert, half lose it, so keeping the later of tied assignments shows. k = 2 with real
drops and renormalised softmax (or scaled sigmoid) weights, none equal to another or to 1, so a routing weight
gathered in the pre-capacity order shows. x is on a grid of 1/8 and the router kernel on one of 1/64 (both exact in
bf16), so the logits are exact in f32 in any summation order: equal tokens stay equal on every backend.

Routing: ``apply_capacity`` after ``route`` on both backends (the gating kernel under the checking interpreter): the
group sizes and the kept rows in order exactly, the dropped rows as a set. The layer, ``moe_ffn`` (xla) and
``nn.MoE``: y, the aux outputs and the gradients of ``sum(y * ct) + lb + 0.1 z`` against ``moe_ffn_gradients``. TOL:
f32 end to end against float64, the layer oracle test's (test_moe_ffn.py). The Pallas layer's capacity case is
test_moe_ffn_pallas.py's, the expert-parallel one tests/parallel/test_expert_parallel.py's, both on such inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from moe_jax.ops.grouped_matmul.packing import gate_up_block
from tests import oracle
from tests.helpers import checked_interpreter

TOL = 1e-5
T, D, F, E, K = 16, 8, 4, 4, 2
COPIES = [1, 6, 7, 12]
NAMES = ("x", "router_kernel", "w_gate_up", "w_down")


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(-16, 17, size=(T, D)) / 8
    x[COPIES] = x[COPIES[0]]
    return dict(
        x=x.astype(np.float32),
        router_kernel=(rng.integers(-64, 65, size=(D, E)) / 64).astype(np.float32),
        w_gate_up=(rng.normal(size=(E, D, 2 * F)) / np.sqrt(D)).astype(np.float32),
        w_down=(rng.normal(size=(E, F, D)) / np.sqrt(F)).astype(np.float32),
        cotangent=rng.normal(size=(T, D)).astype(np.float32),
    )


def _splitting_capacity_factor(inputs, **routing) -> float:
    """The capacity factor that keeps the first half of the copies' first-slot assignments (all to one expert)."""
    expected = oracle.route(inputs["x"].astype(np.float64) @ inputs["router_kernel"], K, **routing)
    tied = [copy * K for copy in COPIES]
    return oracle.capacity_factor_splitting(expected["experts"], expected["selected_scores"], tied, E)


def _assert_copies_split(keep) -> None:
    """The test's premise: the cut runs through the tie, keeping the earlier copies' first slots."""
    np.testing.assert_array_equal(np.asarray(keep)[COPIES, 0], [True, True, False, False])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_apply_capacity_keeps_the_earlier_of_tied_assignments(backend, score):
    inputs = _inputs(0)
    logits = jnp.asarray(inputs["x"] @ inputs["router_kernel"])  # exact: see the module docstring
    capacity_factor = _splitting_capacity_factor(inputs, score=score)

    def route_with_capacity(logits):
        routing = moe_jax.route(logits, K, score=score, backend=backend)
        return routing, moe_jax.apply_capacity(routing, capacity_factor)

    with checked_interpreter():
        routing, (group_sizes, sort_indices) = jax.device_get(jax.jit(route_with_capacity)(logits))
    tied = np.asarray(routing.selected_scores)[COPIES, 0]
    assert np.all(tied == tied[0]), f"the copies' scores do not tie exactly: {tied}"

    capacity = oracle.expert_capacity(T, K, E, capacity_factor)
    keep = oracle.capacity_keep(routing.experts, routing.selected_scores, capacity)
    _assert_copies_split(keep)
    expected_sizes, expected_kept, expected_dropped = oracle.capacity_rows(routing.experts, keep, E)
    np.testing.assert_array_equal(group_sizes, expected_sizes)
    kept = int(group_sizes.sum())
    np.testing.assert_array_equal(sort_indices[:kept], expected_kept)
    assert set(sort_indices[kept:].tolist()) == expected_dropped


def _check_layer(y, aux, grads, inputs, options) -> None:
    """y, the aux outputs and the gradients (a dict by NAMES) against the float64 oracle at TOL."""
    arrays = [inputs[name] for name in NAMES]
    expected_y, expected_aux = oracle.moe_ffn(*arrays, top_k=K, **options)
    _assert_copies_split(expected_aux["keep"])
    expected_grads = oracle.moe_ffn_gradients(*arrays, inputs["cotangent"], top_k=K, z_loss_weight=0.1, **options)
    assert oracle.relative_error(y, expected_y) < TOL
    np.testing.assert_array_equal(aux.expert_counts, expected_aux["expert_counts"])
    np.testing.assert_allclose(aux.load_balancing_loss, expected_aux["load_balancing_loss"], rtol=TOL)
    np.testing.assert_allclose(aux.z_loss, expected_aux["z_loss"], rtol=TOL)
    for name in NAMES:
        assert oracle.relative_error(grads[name], expected_grads[name]) < TOL, name


@pytest.mark.parametrize(
    "activation, routing",
    [("swiglu", dict()), ("gpt_oss", dict(score="sigmoid", renormalize=False, scale=2.5))],
    ids=["softmax-swiglu", "sigmoid-gpt_oss-scaled"],
)
def test_moe_ffn_forward_and_gradients_match_the_oracle(activation, routing):
    inputs = _inputs(1)
    options = dict(activation=activation, capacity_factor=_splitting_capacity_factor(inputs, **routing), **routing)
    cotangent = jnp.asarray(inputs["cotangent"])

    def objective(*arrays):
        y, aux = moe_jax.moe_ffn(*arrays, top_k=K, backend="xla", **options)
        return jnp.sum(y * cotangent) + aux.load_balancing_loss + 0.1 * aux.z_loss, (y, aux)

    arrays = [jnp.asarray(inputs[name]) for name in NAMES]
    grads, (y, aux) = jax.jit(jax.grad(objective, argnums=(0, 1, 2, 3), has_aux=True))(*arrays)
    _check_layer(y, aux, dict(zip(NAMES, grads, strict=True)), inputs, options)


def test_nn_moe_forward_and_gradients_match_the_oracle():
    inputs = _inputs(2)
    capacity_factor = _splitting_capacity_factor(inputs)
    model = moe_jax.nn.MoE(D, F, E, K, capacity_factor=capacity_factor, rngs=nnx.Rngs(0))
    model.router.kernel[...] = jnp.asarray(inputs["router_kernel"])
    model.w_gate_up[...] = moe_jax.pack_gate_up(jnp.asarray(inputs["w_gate_up"])).array
    model.w_down[...] = jnp.asarray(inputs["w_down"])
    cotangent = jnp.asarray(inputs["cotangent"])

    def objective(model, x):
        y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
        (aux,) = intermediates["moe_aux"].get_value()
        return jnp.sum(y * cotangent) + aux.load_balancing_loss + 0.1 * aux.z_loss, (y, aux)

    gradients = nnx.jit(nnx.grad(objective, argnums=(0, 1), has_aux=True))
    (param_grads, d_x), (y, aux) = gradients(model, jnp.asarray(inputs["x"]))
    packed = moe_jax.PackedGateUp(param_grads.w_gate_up[...], gate_up_block(F))
    grads = dict(
        x=d_x,
        router_kernel=param_grads.router.kernel[...],
        w_gate_up=moe_jax.unpack_gate_up(packed),
        w_down=param_grads.w_down[...],
    )
    _check_layer(y, aux, grads, inputs, dict(capacity_factor=capacity_factor))
