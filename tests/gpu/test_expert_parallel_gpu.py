"""``moe_ffn_expert_parallel`` with the Pallas kernels over several GPUs, against the float64 oracle and against
``moe_ffn``'s XLA reference on one.

Run on a machine with 2 or more GPUs (the device tool's nvidia-h200-x2, for one):
``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_expert_parallel_gpu.py``. On fewer GPUs these tests skip:
what they check is the collectives and the per-device expert slices, which one device cannot exercise.

Both meshes over all P devices: expert parallel (1, P) and data parallel (P, 1), Explicit axes. Seeded random
inputs, a seed per case (printed on failure). Checked: y, the load-balancing and z losses, and the gradients of x,
the router kernel and both expert weights of ``sum(y * ct) + lb + 0.1 z``, relative-norm error <= ``TOL`` (bf16
inputs and outputs, f32 accumulation: the grouped-matmul GPU tests' tolerance) against the reference and against the
float64 oracle (``moe_ffn`` / ``moe_ffn_gradients`` of tests/oracle.py, which share no code with the layer's
composition; the bf16 layer's oracle tolerance in test_moe_ffn_pallas.py); the expert counts exactly. x lies on a grid
of 1/16 and the router kernel on one of 1/256 (both exact in bf16), so the logits are exact in f32 in any summation
order and the oracle selects what the layer does; token COPIES[0] is repeated, and the capacity case cuts through the
copies' tied scores (``capacity_factor_splitting``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_jax
from moe_jax.parallel import moe_ffn_expert_parallel
from tests import oracle
from tests.oracle import relative_error

pytestmark = pytest.mark.gpu
TOL = 1e-2
T, D, F, E = 4096, 1024, 512, 32
COPIES = [7, 1000, 1001, 3000]
CASES = {
    "softmax_swiglu": dict(top_k=4, activation="swiglu"),
    "grouped_sigmoid_bias_geglu": dict(
        top_k=8, activation="geglu", score="sigmoid", num_groups=8, top_groups=4, scale=2.5, use_bias=True
    ),
    "capacity_gpt_oss": dict(top_k=4, activation="gpt_oss", capacity="split the copies"),
}


@pytest.fixture(scope="module")
def num_devices():
    count = jax.device_count()
    if count < 2:
        pytest.skip(f"expert parallelism needs 2+ GPUs; this machine has {count}")
    return count


def _inputs(seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), 6)

    def normal(key, dims, fan_in):
        return (jax.random.normal(key, dims, jnp.float32) * fan_in**-0.5).astype(jnp.bfloat16)

    def on_grid(array, step):
        return (jnp.round(array.astype(jnp.float32) / step) * step).astype(jnp.bfloat16)

    x = on_grid(normal(keys[0], (T, D), 1), 1 / 16)
    return dict(
        x=x.at[jnp.asarray(COPIES)].set(x[COPIES[0]]),
        router_kernel=on_grid(normal(keys[1], (D, E), D), 1 / 256),
        w_gate_up=moe_jax.pack_gate_up(normal(keys[2], (E, D, 2 * F), D)),
        w_down=normal(keys[3], (E, F, D), F),
        bias=jax.random.normal(keys[4], (E,), jnp.float32) * 0.1,
        ct=normal(keys[5], (T, D), 1),
    )


def _options(inputs, case) -> dict:
    """The case's options, its capacity as the capacity factor that splits the copies' tie."""
    options = dict(CASES[case])
    if options.pop("capacity", None):
        exact = {name: np.asarray(inputs[name], np.float64) for name in ("x", "router_kernel")}
        routed = oracle.route(exact["x"] @ exact["router_kernel"], options["top_k"])
        tied = [copy * options["top_k"] for copy in COPIES]
        options["capacity_factor"] = oracle.capacity_factor_splitting(
            routed["experts"], routed["selected_scores"], tied, E
        )
    return options


def _exact_results(inputs, options) -> dict:
    """The float64 oracle's, as ``_results``'s."""
    options = dict(options)
    bias = np.asarray(inputs["bias"], np.float64) if options.pop("use_bias", False) else None
    unpacked = dict(inputs, w_gate_up=moe_jax.unpack_gate_up(inputs["w_gate_up"]))
    arrays = [np.asarray(unpacked[name], np.float64) for name in ("x", "router_kernel", "w_gate_up", "w_down")]
    y, aux = oracle.moe_ffn(*arrays, bias=bias, **options)
    grads = oracle.moe_ffn_gradients(
        *arrays, np.asarray(inputs["ct"], np.float64), bias=bias, z_loss_weight=0.1, **options
    )
    return dict(
        y=y, lb=aux["load_balancing_loss"], z=aux["z_loss"], counts=aux["expert_counts"], grads=list(grads.values())
    )


def _results(layer, inputs, options, backend):
    options = dict(options)
    bias = inputs["bias"] if options.pop("use_bias", False) else None

    def loss(x, router_kernel, w_gate_up, w_down):
        y, aux = layer(x, router_kernel, w_gate_up, w_down, bias=bias, backend=backend, **options)
        objective = jnp.sum(y.astype(jnp.float32) * inputs["ct"]) + aux.load_balancing_loss + 0.1 * aux.z_loss
        return objective, (y, aux)

    args = (inputs["x"], inputs["router_kernel"], inputs["w_gate_up"], inputs["w_down"])
    grads, (y, aux) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    grads = (grads[0], grads[1], moe_jax.unpack_gate_up(grads[2]), grads[3])  # [gate | up], as the oracle's
    return jax.device_get(
        dict(y=y, lb=aux.load_balancing_loss, z=aux.z_loss, counts=aux.expert_counts, grads=list(grads))
    )


# The capacity is per expert-axis group: equal to moe_ffn's only where one group holds the batch (layout "expert").
# "expert all_to_all": the all-to-all dispatch (ragged_all_to_all on GPUs), gradients included.
DROPLESS = [case for case in CASES if "capacity" not in CASES[case]]
LAYOUTS = (
    [(case, "expert") for case in CASES]
    + [(case, "data") for case in DROPLESS]
    + [(case, "expert all_to_all") for case in DROPLESS]
)


@pytest.mark.parametrize(("case", "layout"), LAYOUTS)
def test_pallas_over_devices_matches_reference(num_devices, case, layout):
    seed = LAYOUTS.index((case, layout))
    inputs = _inputs(seed)
    options = _options(inputs, case)
    expected = _results(moe_jax.moe_ffn, inputs, options, "xla")
    exact = _exact_results(inputs, options)

    shape = (1, num_devices) if layout.startswith("expert") else (num_devices, 1)
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    placed = dict(inputs)
    placed["x"] = jax.device_put(inputs["x"], NamedSharding(mesh, P(("data", "expert"))))
    for name in ("w_gate_up", "w_down"):
        placed[name] = jax.device_put(inputs[name], NamedSharding(mesh, P("expert")))
    with jax.set_mesh(mesh):
        dispatch = "all_to_all" if layout.endswith("all_to_all") else "all_gather"
        got = _results(moe_ffn_expert_parallel, placed, dict(options, dispatch=dispatch), "pallas")

    np.testing.assert_array_equal(got["counts"], expected["counts"], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got["counts"], exact["counts"], err_msg=f"seed {seed}")
    names = ("y", "lb", "z", "d_x", "d_router", "d_w_gate_up", "d_w_down")
    for reference_name, reference in (("reference", expected), ("oracle", exact)):
        wanted = [reference["y"], reference["lb"], reference["z"], *reference["grads"]]
        actual = [got["y"], got["lb"], got["z"], *got["grads"]]
        errors = {name: relative_error(a, w) for name, a, w in zip(names, actual, wanted, strict=True)}
        assert max(errors.values()) <= TOL, f"seed {seed}, against the {reference_name}: {errors}"


# FP8 expert GEMMs over the devices against moe_ffn's FP8 XLA recipe on one: the same operands quantized the same
# way (a token's 1 x 128 blocks, an expert's 128 x 128, a group's 128-row blocks in the same row order). Each side
# rounds its own bf16 pre-activation, which the backward keeps in e4m3, so a rounding flip next to an e4m3 boundary
# moves a kept value by a whole e4m3 step: test_glu_mlp_gpu.py's FP8_TOL (5e-2) covers those. In the relative norm
# of 4096 tokens one row lost or misplaced weighs little: the interpreter test tests/parallel/test_all_to_all.py
# (32 tokens) is the one that catches a single row. The router and the losses stay in high precision.
FP8_TOL = 5e-2


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_fp8_over_devices_matches_the_xla_recipe(num_devices, dispatch):
    seed = 100 + ["all_to_all", "all_gather"].index(dispatch)
    inputs = _inputs(seed)
    options = dict(_options(inputs, "softmax_swiglu"), quantization="fp8_block")
    expected = _results(moe_jax.moe_ffn, inputs, options, "xla")
    mesh = jax.make_mesh((1, num_devices), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    placed = dict(inputs)
    placed["x"] = jax.device_put(inputs["x"], NamedSharding(mesh, P(("data", "expert"))))
    for name in ("w_gate_up", "w_down"):
        placed[name] = jax.device_put(inputs[name], NamedSharding(mesh, P("expert")))
    with jax.set_mesh(mesh):
        got = _results(moe_ffn_expert_parallel, placed, dict(options, dispatch=dispatch), "pallas")

    np.testing.assert_array_equal(got["counts"], expected["counts"], err_msg=f"seed {seed}")
    names = ("y", "lb", "z", "d_x", "d_router", "d_w_gate_up", "d_w_down")
    wanted = [expected["y"], expected["lb"], expected["z"], *expected["grads"]]
    actual = [got["y"], got["lb"], got["z"], *got["grads"]]
    errors = {name: relative_error(a, w) for name, a, w in zip(names, actual, wanted, strict=True)}
    assert max(errors.values()) <= FP8_TOL, f"seed {seed}: {errors}"
