"""moe_ffn_expert_parallel against the float64 oracle and moe_ffn on one device, on meshes of virtual CPU devices."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import moe_jax
from moe_jax.ops.grouped_matmul.api import master_weights
from moe_jax.parallel.expert_parallel import local_expert_rows, moe_ffn_expert_parallel
from tests import oracle
from tests.helpers import layer_inputs, virtual_devices_flags

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_local_expert_rows_puts_each_shards_rows_first(num_shards):
    """Against slicing the expert-sorted rows in NumPy, on a routing with empty experts."""
    num_experts, top_k = 8, 2
    logits = jax.random.normal(jax.random.key(num_shards), (40, num_experts))
    logits = logits.at[:, 3].set(-jnp.inf)  # expert 3 gets no rows
    routing = moe_jax.route(logits, top_k, backend="xla")
    sizes, order = np.asarray(routing.group_sizes), np.asarray(routing.sort_indices)
    starts = np.cumsum(sizes) - sizes
    per_shard = num_experts // num_shards
    for shard in range(num_shards):
        first = shard * per_shard
        local_sizes, local_indices = local_expert_rows(routing.group_sizes, routing.sort_indices, first, per_shard)
        local_sizes, local_indices = np.asarray(local_sizes), np.asarray(local_indices)
        np.testing.assert_array_equal(local_sizes, sizes[first : first + per_shard])
        rows = local_sizes.sum()
        np.testing.assert_array_equal(local_indices[:rows], order[starts[first] : starts[first] + rows])
        np.testing.assert_array_equal(np.sort(local_indices), np.arange(order.size))  # a permutation of all rows


MESH_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
import moe_jax
from tests import oracle
from moe_jax.parallel.expert_parallel import moe_ffn_expert_parallel

T, D, F, E = 64, 32, 16, 8
COPIES = [3, 17, 40, 41]  # token 3 repeated exactly: the capacity case cuts through their tie
keys = jax.random.split(jax.random.key(int(sys.argv[1])), 6)
# x on a grid of 1/8, the router kernel on one of 1/64: exact logits in f32, so the copies tie on every device.
x = jnp.round(jax.random.normal(keys[0], (T, D)) * 8) / 8
x = x.at[jnp.asarray(COPIES)].set(x[COPIES[0]])
router = jnp.round(jax.random.normal(keys[1], (D, E)) * D**-0.5 * 64) / 64
w_gate_up = jax.random.normal(keys[2], (E, D, 2 * F)) * D**-0.5
w_down = jax.random.normal(keys[3], (E, F, D)) * F**-0.5
bias = jax.random.normal(keys[4], (E,)) * 0.1
cotangent = jax.random.normal(keys[5], (T, D))
routed = oracle.route(np.asarray(x, np.float64) @ np.asarray(router, np.float64), 2)
tie_split = oracle.capacity_factor_splitting(routed["experts"], routed["selected_scores"], [c * 2 for c in COPIES], E)
capacity = oracle.expert_capacity(T, 2, E, tie_split)
copies_kept = oracle.capacity_keep(routed["experts"], routed["selected_scores"], capacity)[COPIES, 0].tolist()
CASES = {
    "softmax": dict(top_k=2, activation="swiglu"),
    "grouped_sigmoid_bias": dict(top_k=3, score="sigmoid", num_groups=4, top_groups=2, bias=bias, activation="geglu"),
    "capacity": dict(top_k=2, capacity_factor=tie_split, activation="gpt_oss"),
}


def loss(layer, options, *args):
    y, aux = layer(*args, backend="xla", **options)
    return jnp.sum(y * cotangent) + aux.load_balancing_loss + 0.1 * aux.z_loss, (y, aux)


def results(layer, options):
    grad = jax.jit(jax.grad(lambda *a: loss(layer, options, *a), argnums=(0, 1, 2, 3), has_aux=True))
    grads, (y, aux) = grad(x, router, w_gate_up, w_down)
    return [y, aux.load_balancing_loss, aux.z_loss, aux.expert_counts, *grads]


def exact_results(options):  # the float64 oracle's, in results' order
    options = {k: np.asarray(v, np.float64) if k == "bias" else v for k, v in options.items()}
    arrays = [np.asarray(a, np.float64) for a in (x, router, w_gate_up, w_down)]
    y, aux = oracle.moe_ffn(*arrays, **options)
    grads = oracle.moe_ffn_gradients(*arrays, np.asarray(cotangent, np.float64), z_loss_weight=0.1, **options)
    return [y, aux["load_balancing_loss"], aux["z_loss"], aux["expert_counts"], *grads.values()]


report, exact_report = {}, {}
for name, options in CASES.items():
    exact = exact_results(options)
    reference = results(moe_jax.moe_ffn, options)
    exact_report[f"{name} moe_ffn"] = [oracle.max_relative_error(a, e) for e, a in zip(exact, reference, strict=True)]
    for shape, kind in (((2, 2), AxisType.Explicit), ((1, 4), AxisType.Auto), ((4, 1), AxisType.Explicit)):
        if "capacity_factor" in options and shape[0] > 1:
            continue  # the capacity is per expert-axis group: equal to moe_ffn's where one group holds the batch
        mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(kind, kind))
        with jax.set_mesh(mesh):
            got = results(moe_ffn_expert_parallel, options)
        case = f"{name} {shape} {kind.name}"
        report[case] = [oracle.max_relative_error(a, e) for e, a in zip(reference, got, strict=True)]
        exact_report[case] = [oracle.max_relative_error(a, e) for e, a in zip(exact, got, strict=True)]

errors = {}
mesh = jax.make_mesh((2, 2), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
with jax.set_mesh(mesh):
    for name, call in {
        "no_axis": lambda: moe_ffn_expert_parallel(x, router, w_gate_up, w_down, top_k=2, expert_axis="model"),
        "experts": lambda: moe_ffn_expert_parallel(x, router[:, :7], w_gate_up[:7], w_down[:7], top_k=2),
        "tokens": lambda: moe_ffn_expert_parallel(x[:62], router, w_gate_up, w_down, top_k=2),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
summary = {"devices": jax.device_count(), "errors": report, "exact_errors": exact_report, "messages": errors}
print(json.dumps(summary | {"copies_kept": copies_kept}))
"""


@pytest.fixture(scope="module")
def mesh_report():
    env = {**os.environ, "XLA_FLAGS": virtual_devices_flags(4), "JAX_PLATFORMS": "cpu"}
    completed = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, "0"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    return report


NAMES = ["y", "load_balancing_loss", "z_loss", "expert_counts", "d_x", "d_router", "d_w_gate_up", "d_w_down"]


def test_matches_the_float64_oracle_on_every_mesh_shape(mesh_report):
    """y, the losses, the expert counts and the gradients of x, router and both expert weights, on (data, expert)
    meshes (2, 2), (1, 4) and (4, 1), Explicit and Auto axes, three routings and activations (one with a capacity
    that cuts through the exact tie of repeated tokens), and of moe_ffn on one device, against the float64 oracle
    (``moe_ffn`` / ``moe_ffn_gradients``, no code shared with the layer). f32 against float64: 1e-5, the f32 layer
    oracle test's tolerance (test_moe_ffn.py), relative to the largest entry."""
    assert mesh_report["copies_kept"] == [True, True, False, False], "the capacity does not cut through the tie"
    assert len(mesh_report["exact_errors"]) == 3 + 7
    for case, errors in mesh_report["exact_errors"].items():
        for name, error in zip(NAMES, errors, strict=True):
            assert error <= 1e-5, f"{case}: {name} relative error {error:.2e}"


def test_matches_moe_ffn_on_every_mesh_shape(mesh_report):
    """As above, against moe_ffn on one device. f32: the only differences are the order of sums (measured <= 2e-6
    relative)."""
    assert len(mesh_report["errors"]) == 7
    for case, errors in mesh_report["errors"].items():
        for name, error in zip(NAMES, errors, strict=True):
            assert error <= 1e-5, f"{case}: {name} relative error {error:.2e}"


def test_rejects_bad_meshes_and_shapes(mesh_report):
    messages = mesh_report["messages"]
    assert "expert_axis='model' is not an axis of the current mesh" in messages["no_axis"]
    assert "E=7 experts must split evenly over the 2 devices of 'expert'" in messages["experts"]
    assert "x.shape[0] (T=62) must be a multiple of the mesh size 4" in messages["tokens"]


def test_pallas_kernels_run_under_shard_map():
    """The Mosaic GPU kernels (interpreted) inside the shard_map, forward and gradients, on a one-device mesh.

    The interpreter of jax 0.11.2 keeps one global shared memory: kernels of several virtual devices at once trip
    its barrier bookkeeping, so the multi-device meshes above run the XLA path. Against the float64 oracle and moe_ffn's
    XLA path; bf16: relative-norm 1e-2 for both, the bf16 layer's tolerances (test_moe_ffn_pallas.py).
    """
    t, d, f, e, k = 32, 128, 64, 4, 2
    x, router, w_gate_up, w_down, cotangent = layer_inputs(1, t, d, f, e)

    def grads(layer, backend):
        def loss(x, w_gate_up, w_down):
            y, aux = layer(x, router, w_gate_up, w_down, top_k=k, backend=backend)
            return jnp.sum(y.astype(jnp.float32) * cotangent) + aux.load_balancing_loss, y

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w_gate_up, w_down)

    expected_grads, expected_y = grads(moe_jax.moe_ffn, "xla")
    with jax.set_mesh(jax.make_mesh((1, 1), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)):
        actual_grads, actual_y = grads(moe_ffn_expert_parallel, "pallas")
    for expected, actual in zip(
        [expected_y, *jax.tree.leaves(expected_grads)], [actual_y, *jax.tree.leaves(actual_grads)], strict=True
    ):
        expected, actual = np.asarray(expected, np.float32), np.asarray(actual, np.float32)
        assert np.linalg.norm(actual - expected) <= 1e-2 * np.linalg.norm(expected)

    arrays = [np.asarray(a, np.float64) for a in (x, router, moe_jax.unpack_gate_up(w_gate_up), w_down)]
    exact_y, _ = oracle.moe_ffn(*arrays, top_k=k)
    exact_grads = oracle.moe_ffn_gradients(*arrays, np.asarray(cotangent, np.float64), top_k=k)
    actual = dict(x=actual_grads[0], w_gate_up=moe_jax.unpack_gate_up(actual_grads[1]), w_down=actual_grads[2])
    assert oracle.relative_error(actual_y, exact_y) <= 1e-2
    for name, value in actual.items():
        assert oracle.relative_error(value, exact_grads[name]) <= 1e-2, name


def test_quantized_master_weights_give_their_masters_results():
    """Each device quantizes its own experts per call, so QuantizedMaster weights (a training step's copies) enter as
    their masters: the same outputs and gradients (those reach the masters), bit for bit, on a one-device mesh."""
    t, d, f, e, k = 32, 128, 128, 4, 2
    x, router, w_gate_up, w_down, cotangent = layer_inputs(2, t, d, f, e)

    def results(w_gate_up, w_down):
        def loss(x, w_gate_up, w_down):
            y, _ = moe_ffn_expert_parallel(
                x, router, w_gate_up, w_down, top_k=k, backend="xla", quantization="fp8_block"
            )
            return jnp.sum(y.astype(jnp.float32) * cotangent), y

        (d_x, *d_weights), y = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w_gate_up, w_down)
        return y, d_x, *(master_weights(w) for w in d_weights)

    with jax.set_mesh(jax.make_mesh((1, 1), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)):
        expected = results(w_gate_up, w_down)
        got = results(moe_jax.quantize_master(w_gate_up), moe_jax.quantize_master(w_down))
    for actual, wanted in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(actual, wanted)


@pytest.mark.parametrize("quantization, match", [(None, "got None"), ("mxfp8", "got 'mxfp8'")])
def test_quantized_master_weights_outside_fp8_block_are_rejected(quantization, match):
    """As in moe_ffn: a QuantizedMaster holds fp8_block's copies, so another quantization is an error, not a silent
    run on its master."""
    t, d, f, e = 16, 128, 128, 4
    x = jnp.zeros((t, d), jnp.bfloat16)
    w_gate_up = moe_jax.pack_gate_up(jnp.zeros((e, d, 2 * f), jnp.bfloat16))
    w_down = moe_jax.quantize_master(jnp.zeros((e, f, d), jnp.bfloat16))
    mesh = jax.make_mesh((1, 1), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=f"w_down is a QuantizedMaster.*{match}"):
        moe_ffn_expert_parallel(x, jnp.zeros((d, e)), w_gate_up, w_down, top_k=2, quantization=quantization)
