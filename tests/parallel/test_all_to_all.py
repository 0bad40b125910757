"""The all-to-all dispatch of moe_ffn_expert_parallel on 8 virtual CPU devices (one subprocess), against moe_ffn on
one device and the float64 oracle; its buffer bound, errors, memory at a fixed per-device batch, nn.MoE with shared
experts on an Explicit mesh, and the Pallas kernels under the interpreter."""

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
from moe_jax.parallel import moe_ffn_expert_parallel
from moe_jax.parallel.expert_parallel import choose_dispatch
from tests import oracle
from tests.helpers import checked_interpreter, layer_inputs, virtual_devices_flags

REPO = pathlib.Path(__file__).resolve().parents[2]

MESH_SCRIPT = """
import functools, json
import jax, jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
import moe_jax
from moe_jax.parallel import moe_ffn_expert_parallel
from tests import oracle

D, F = 16, 8


def inputs(seed, tokens, experts):
    keys = jax.random.split(jax.random.key(seed), 5)
    return dict(
        x=jax.random.normal(keys[0], (tokens, D)),
        router=jax.random.normal(keys[1], (D, experts)) * D**-0.5,
        w_gate_up=jax.random.normal(keys[2], (experts, D, 2 * F)) * D**-0.5,
        w_down=jax.random.normal(keys[3], (experts, F, D)) * F**-0.5,
        ct=jax.random.normal(keys[4], (tokens, D)),
    )


def results(layer, arrays, options):
    def loss(x, router, w_gate_up, w_down):
        y, aux = layer(x, router, w_gate_up, w_down, backend="xla", **options)
        return jnp.sum(y * arrays["ct"]) + aux.load_balancing_loss + 0.1 * aux.z_loss, (y, aux)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, (y, aux) = grad(arrays["x"], arrays["router"], arrays["w_gate_up"], arrays["w_down"])
    return [y, aux.load_balancing_loss, aux.z_loss, aux.expert_counts, *grads], aux


def mesh_of(shape, kind=AxisType.Explicit):
    return jax.make_mesh(shape, ("data", "expert"), axis_types=(kind, kind), devices=jax.devices()[: np.prod(shape)])


# (mesh, E, top_k, options): E / P = 1, top_k 1 / 2 / 8, a hot expert (the bias sends every token to expert 5),
# chunks, the all-gather dispatch on the same mesh for the per-device counts, and FP8 expert GEMMs (the (2, 4) mesh
# with top_k 2 runs in the hot and FP8 cases). The exchange is "slots" ("auto") but where named: slot_factor 8 makes
# a slot hold all of a device's rows, so that only the all-to-all runs; the hot expert overflows the default slots,
# which sends the rows past them through the "padded" exchange (so the hot case covers that exchange too).
CASES = {
    "(1,8) k1 E/P=1 slots only": ((1, 8), 8, 1, dict(slot_factor=8.0)),
    "(8,1) k2": ((8, 1), 8, 2, {}),
    "(1,8) k8 chunks2": ((1, 8), 16, 8, dict(num_chunks=2)),
    "(2,4) k2 hot": ((2, 4), 8, 2, dict(bias=jnp.zeros(8).at[5].set(10.0))),
    "(2,4) k2 hot owners": ((2, 4), 8, 2, dict(bias=jnp.zeros(8).at[5].set(10.0), exchange="owners")),
    "(2,4) k2 hot all_gather": ((2, 4), 8, 2, dict(bias=jnp.zeros(8).at[5].set(10.0), dispatch="all_gather")),
    "(2,4) k2 fp8": ((2, 4), 8, 2, dict(quantization="fp8_block")),
}
report, references = {}, {}
for name, (shape, experts, top_k, options) in CASES.items():
    # One draw, and one moe_ffn reference, for the hot expert's exchanges and dispatches.
    base = name.removesuffix(" all_gather").removesuffix(" owners")
    arrays = inputs(list(CASES).index(base), 64, experts)
    options = dict(dict(dispatch="all_to_all", top_k=top_k), **options)
    reference_options = {k: v for k, v in options.items() if k in ("top_k", "bias", "quantization")}
    if base not in references:
        references[base] = results(moe_jax.moe_ffn, arrays, reference_options)[0]
    expected = references[base]
    with jax.set_mesh(mesh_of(shape, AxisType.Auto if "(8,1)" in name else AxisType.Explicit)):
        got, aux = results(moe_ffn_expert_parallel, arrays, options)
    report[name] = dict(
        errors=[oracle.max_relative_error(a, e) for e, a in zip(expected, got, strict=True)],
        received=np.asarray(aux.received_rows).tolist(),
        dropped=np.asarray(aux.dropped_rows).tolist(),
        overflowed=np.asarray(aux.overflowed_rows).tolist(),
    )

# The buffer bound: 8 tokens per device, k = 2, bound ceil(0.75 * 16) = 12 rows a device; the hot expert overflows
# it, and slots of ceil(0.5 * 16 / 4) = 2 rows a pair send the kept rows through the fallback exchange too. The
# owners exchange (tokens, not rows) on the same inputs keeps and drops the same rows.
shape, experts, top_k, factor = (2, 4), 8, 2, 0.75
arrays = inputs(100, 64, experts)
bias = jnp.zeros(experts).at[5].set(0.5)
bounded = {}
with jax.set_mesh(mesh_of(shape)):
    for exchange in ("slots", "owners"):
        bounded[exchange] = results(
            moe_ffn_expert_parallel,
            arrays,
            dict(dispatch="all_to_all", top_k=top_k, buffer_factor=factor, bias=bias, slot_factor=0.5,
                 exchange=exchange),
        )  # fmt: skip
keep_rule = lambda routed: oracle.buffer_keep(
    routed["experts"], routed["selected_scores"], num_devices=8, num_peers=4, experts_per_device=2, bound=12
)
exact = {name: np.asarray(arrays[name], np.float64) for name in ("x", "router", "w_gate_up", "w_down", "ct")}
args = [exact[name] for name in ("x", "router", "w_gate_up", "w_down")]
bias64 = np.asarray(bias, np.float64)
y, exact_aux = oracle.moe_ffn(*args, top_k=top_k, bias=bias64, keep_rule=keep_rule)
grads = oracle.moe_ffn_gradients(*args, exact["ct"], top_k=top_k, bias=bias64, keep_rule=keep_rule, z_loss_weight=0.1)
keep = exact_aux["keep"]
# The device computing each assignment: the owner of its expert on the expert axis of its token (32 tokens a group).
routed = oracle.route(exact["x"] @ exact["router"], top_k, bias=bias64)
owner = np.arange(64)[:, None] // 32 * 4 + routed["experts"] // 2
wanted = np.bincount(owner.reshape(-1), minlength=8)
kept = np.bincount(owner[keep], minlength=8)
fully_dropped = np.flatnonzero(~keep.any(1))
buffer_report = {
    exchange: dict(
        errors=[oracle.max_relative_error(a, e) for e, a in zip([y, exact_aux["load_balancing_loss"],
                exact_aux["z_loss"], exact_aux["expert_counts"], *grads.values()], got, strict=True)],
        received=np.asarray(aux.received_rows).tolist(),
        dropped=np.asarray(aux.dropped_rows).tolist(),
        overflowed=np.asarray(aux.overflowed_rows).tolist(),
        expected_received=kept.tolist(),
        expected_dropped=(wanted - kept).tolist(),
        fully_dropped=fully_dropped.tolist(),
        fully_dropped_y=float(np.abs(np.asarray(got[0])[fully_dropped]).max()) if fully_dropped.size else None,
        fully_dropped_dx=float(np.abs(np.asarray(got[4])[fully_dropped] - grads["x"][fully_dropped]).max())
        if fully_dropped.size else None,
    )
    for exchange, (got, aux) in bounded.items()
}  # fmt: skip


# Compiled temp memory of the forward + backward at 64 tokens and 4 experts per device, P = 2 and 8.
def temp_bytes(num_shards, **options):
    shapes = [(64 * num_shards, 32), (32, 4 * num_shards), (4 * num_shards, 32, 64), (4 * num_shards, 32, 32)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

    def loss(*a):
        y, aux = moe_ffn_expert_parallel(*a, top_k=2, backend="xla", **options)
        return jnp.sum(y) + aux.load_balancing_loss

    with jax.set_mesh(mesh_of((1, num_shards))):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


memory = {
    "all_to_all buffer_factor=2": [temp_bytes(p, dispatch="all_to_all", buffer_factor=2.0) for p in (2, 8)],
    "owners buffer_factor=2": [
        temp_bytes(p, dispatch="all_to_all", buffer_factor=2.0, exchange="owners") for p in (2, 8)
    ],
    "all_gather": [temp_bytes(p, dispatch="all_gather") for p in (2, 8)],
}

# nn.MoE with shared experts, expert parallel on an Explicit (2, 4) mesh, against the same module without.
layer = moe_jax.nn.MoE(D, F, 8, 2, num_shared_experts=1, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(7), (4, 16, D))


def module_loss(module, x):
    return jnp.sum(module(x) * jnp.cos(x))


def module_results():
    loss, grads = nnx.jit(nnx.value_and_grad(module_loss))(layer, x)
    return [loss, *jax.tree.leaves(nnx.state(grads, nnx.Param))]


expected = module_results()
layer.expert_parallel, layer.dispatch = True, "all_to_all"
with jax.set_mesh(mesh_of((2, 4))):
    got = module_results()
module_errors = [oracle.max_relative_error(a, e) for e, a in zip(expected, got, strict=True)]

messages = {}
arrays = inputs(0, 64, 8)
with jax.set_mesh(mesh_of((2, 4))):
    for name, options in {
        "tokens": dict(x=arrays["x"][:60]),
        "chunks": dict(num_chunks=3),
        "buffer_all_gather": dict(dispatch="all_gather", buffer_factor=1.0),
        "dispatch": dict(dispatch="ragged"),
        "slot_factor_padded": dict(exchange="padded", slot_factor=1.5),
        "slot_factor": dict(slot_factor=0.0),
    }.items():
        call = dict(x=arrays["x"], router_kernel=arrays["router"], w_gate_up=arrays["w_gate_up"],
                    w_down=arrays["w_down"], top_k=2, dispatch="all_to_all")
        call.update(options)
        try:
            moe_ffn_expert_parallel(**call)
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
print(json.dumps(dict(devices=jax.device_count(), cases=report, buffer=buffer_report, memory=memory,
                      module=module_errors, messages=messages)))
"""


@pytest.fixture(scope="module")
def mesh_report():
    env = {**os.environ, "XLA_FLAGS": virtual_devices_flags(8), "JAX_PLATFORMS": "cpu"}
    completed = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    return report


FP8_TOL = 5e-2
NAMES = ["y", "load_balancing_loss", "z_loss", "expert_counts", "d_x", "d_router", "d_w_gate_up", "d_w_down"]


def test_all_to_all_matches_moe_ffn_on_every_mesh(mesh_report):
    """y, the losses, the expert counts and the gradients of x, router and both expert weights on (2, 4), (1, 8) and
    (8, 1) meshes, top_k 1 / 2 / 8, one expert per device, a hot expert, two chunks, against moe_ffn on one device.
    f32: the dispatches change only the order of sums (1e-5, as test_expert_parallel.py). With FP8 expert GEMMs
    (``quantization="fp8_block"``) the operands' blocks are the same on the devices as on one (a row's 1 x 128, an
    expert's 128 x 128, a group's rows for the wgrad), and an f32 sum in another order that lands on an e4m3 rounding
    boundary of the hidden activations or a gradient moves that element (or, through a block's amax, its block) by
    one e4m3 step, 2^-4: FP8_TOL (measured 2.1e-2 in d w_gate_up; a row sent to the wrong device errs by O(1))."""
    for case, report in mesh_report["cases"].items():
        tol = FP8_TOL if "fp8" in case else 1e-5
        for name, error in zip(NAMES, report["errors"], strict=True):
            assert error <= tol, f"{case}: {name} relative error {error:.2e}"
        assert report["dropped"] == [0] * 8, case


def test_received_rows_count_each_devices_experts_rows(mesh_report):
    """Dropless, both dispatches count the same rows per device: the hot expert's device (expert 5 on device 2 of
    each expert axis) computes every token of its group once."""
    cases = mesh_report["cases"]
    assert cases["(2,4) k2 hot"]["received"] == cases["(2,4) k2 hot all_gather"]["received"]
    assert cases["(2,4) k2 hot owners"]["received"] == cases["(2,4) k2 hot all_gather"]["received"]
    received = cases["(2,4) k2 hot"]["received"]
    assert received[2] >= 32 and received[6] >= 32  # 32 tokens per expert axis, each with expert 5
    assert sum(cases["(1,8) k8 chunks2"]["received"]) == 64 * 8


@pytest.mark.parametrize("exchange", ["slots", "owners"])
def test_buffer_drops_lowest_scores_and_counts_them(mesh_report, exchange):
    """buffer_factor 0.75 with a hot expert: the received and dropped rows per device equal the oracle's
    (``oracle.buffer_keep``), y and every gradient equal the float64 oracle with those rows dropped (1e-5, f32),
    and a token whose rows were all dropped gets y = 0 and only the router's gradient."""
    report = mesh_report["buffer"][exchange]
    assert report["received"] == report["expected_received"]
    assert report["dropped"] == report["expected_dropped"]
    assert sum(report["dropped"]) > 0, "the bound drops nothing: the test does not exercise it"
    for name, error in zip(NAMES, report["errors"], strict=True):
        assert error <= 1e-5, f"{name} relative error {error:.2e}"
    if report["fully_dropped"]:
        assert report["fully_dropped_y"] == 0.0
        assert report["fully_dropped_dx"] <= 1e-5


def test_memory_at_a_fixed_per_device_batch(mesh_report):
    """Compiled temp memory of forward + backward at 64 tokens and 4 experts per device: with a buffer bound the
    all-to-all's (slots and owners exchanges) does not grow from P = 2 to P = 8 (within 1.3x); the all-gather's
    grows with the gathered batch (measured ~3.7x; asserted > 2x so that the comparison keeps meaning something)."""
    all_gather_2, all_gather_8 = mesh_report["memory"]["all_gather"]
    for exchange in ("all_to_all", "owners"):
        all_to_all_2, all_to_all_8 = mesh_report["memory"][f"{exchange} buffer_factor=2"]
        assert all_to_all_8 <= 1.3 * all_to_all_2, (exchange, all_to_all_2, all_to_all_8)
    assert all_gather_8 > 2 * all_gather_2, (all_gather_2, all_gather_8)


def test_module_with_shared_experts_on_an_explicit_mesh(mesh_report):
    """nn.MoE(num_shared_experts=1, expert_parallel=True) under an Explicit (2, 4) mesh against the same module
    without expert parallelism: the loss and every parameter's gradient (f32, 1e-5)."""
    for index, error in enumerate(mesh_report["module"]):
        assert error <= 1e-5, f"leaf {index}: relative error {error:.2e}"


def test_rejects_bad_arguments(mesh_report):
    messages = mesh_report["messages"]
    assert "x.shape[0] (T=60) must be a multiple of the mesh size 8" in messages["tokens"]
    assert "num_chunks=3 must divide the 8 tokens of each device" in messages["chunks"]
    assert "apply to dispatch='all_to_all' only" in messages["buffer_all_gather"]
    assert "dispatch" in messages["dispatch"] and "ragged" in messages["dispatch"]
    assert "slot_factor=1.5 applies to exchange='slots' or 'owners'" in messages["slot_factor_padded"]
    assert "slot_factor must be > 0, got 0.0" in messages["slot_factor"]


def test_slots_overflow_only_where_a_pair_exceeds_its_slot(mesh_report):
    """The "slots" exchange's fallback runs for the hot expert (8 tokens a device, k 2: a slot holds
    ceil(1.25 * 16 / 4) = 5 rows a pair, and every device sends 8 rows to expert 5's device) and not
    where a slot holds every row (slot_factor 8); the all-gather never overflows. The results
    of every case match moe_ffn (test_all_to_all_matches_moe_ffn_on_every_mesh)."""
    cases = mesh_report["cases"]
    hot = cases["(2,4) k2 hot"]["overflowed"]
    assert hot[2] > 0 and hot[6] > 0, hot
    assert hot[2] <= cases["(2,4) k2 hot"]["received"][2]
    assert cases["(1,8) k1 E/P=1 slots only"]["overflowed"] == [0] * 8
    assert cases["(2,4) k2 hot all_gather"]["overflowed"] == [0] * 8
    assert sum(mesh_report["buffer"]["slots"]["overflowed"]) > 0, "the bounded case does not exercise the fallback"
    assert sum(mesh_report["buffer"]["owners"]["overflowed"]) > 0, "the bounded case does not exercise the fallback"
    assert sum(cases["(2,4) k2 hot owners"]["overflowed"]) > 0


@pytest.mark.parametrize(
    ("top_k", "num_shards", "capacity_factor", "expected"),
    [(2, 8, None, "all_to_all"), (8, 8, None, "all_gather"), (4, 2, None, "all_gather"), (1, 2, 1.0, "all_gather")],
)
def test_auto_dispatch_follows_the_traffic_model(top_k, num_shards, capacity_factor, expected):
    assert choose_dispatch("auto", top_k, num_shards, capacity_factor) == expected


def test_all_to_all_runs_the_pallas_kernels():
    """The all-to-all path with the Mosaic GPU kernels under the checking interpreter on a one-device mesh (the
    interpreter runs one device's kernels at a time; see test_expert_parallel.py), forward and gradients, against the
    float64 oracle. bf16: relative-norm 1e-2, the bf16 layer's tolerance (test_moe_ffn_pallas.py)."""
    t, d, f, e, k = 32, 128, 64, 4, 2
    x, router, w_gate_up, w_down, cotangent = layer_inputs(3, t, d, f, e)
    y, grads = _all_to_all_on_the_kernels(x, router, w_gate_up, w_down, cotangent, k)
    arrays = [np.asarray(a, np.float64) for a in (x, router, moe_jax.unpack_gate_up(w_gate_up), w_down)]
    exact_y, _ = oracle.moe_ffn(*arrays, top_k=k)
    exact = oracle.moe_ffn_gradients(*arrays, np.asarray(cotangent, np.float64), top_k=k, load_balancing_weight=0.0)
    assert oracle.relative_error(y, exact_y) <= 1e-2
    actual = dict(x=grads[0], w_gate_up=moe_jax.unpack_gate_up(grads[1]), w_down=grads[2])
    for name, value in actual.items():
        assert oracle.relative_error(value, exact[name]) <= 1e-2, name


def test_all_to_all_runs_the_fp8_kernels():
    """The same with FP8 expert GEMMs, whose custom VJP also puts the received rows back in their receive order (its
    backward quantizes each received row's dy once), against moe_ffn's FP8 XLA path on one device: the same operands
    quantized the same way, so test_moe_ffn_fp8_pallas.py's tolerances (2e-2 for y, 3e-2 for the gradients), which a
    received row lost or put back in the wrong place exceeds (the error of one row of 32 is O(1) / sqrt(32))."""
    t, d, f, e, k = 32, 128, 64, 4, 2
    x, router, w_gate_up, w_down, cotangent = layer_inputs(3, t, d, f, e)
    y, grads = _all_to_all_on_the_kernels(x, router, w_gate_up, w_down, cotangent, k, quantization="fp8_block")

    def reference_loss(x, w_gate_up, w_down):
        y, _ = moe_jax.moe_ffn(x, router, w_gate_up, w_down, top_k=k, backend="xla", quantization="fp8_block")
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    reference = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2), has_aux=True))
    expected_grads, expected_y = reference(x, w_gate_up, w_down)
    assert oracle.relative_error(y, expected_y) <= 2e-2
    # The leaves: x, the packed gate/up array, w_down.
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True)
    for name, (value, expected) in zip(("x", "w_gate_up", "w_down"), pairs, strict=True):
        assert oracle.relative_error(value, expected) <= 3e-2, name


def _all_to_all_on_the_kernels(x, router, w_gate_up, w_down, cotangent, top_k, quantization=None):
    """(y, gradients of sum(y * cotangent) by x, w_gate_up and w_down) of the all-to-all path on a (1, 1) mesh."""

    def loss(x, w_gate_up, w_down):
        options = dict(top_k=top_k, dispatch="all_to_all", backend="pallas", quantization=quantization)
        y, _ = moe_ffn_expert_parallel(x, router, w_gate_up, w_down, **options)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    mesh = jax.make_mesh((1, 1), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh), checked_interpreter():
        grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w_gate_up, w_down)
    return y, grads
