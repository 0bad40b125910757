"""``moe_ffn_expert_parallel`` with the Pallas kernels over several GPUs, against ``moe_ffn``'s XLA reference on one.

Run on a machine with 2 or more GPUs (the device tool's nvidia-h100-x2):
``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_expert_parallel_gpu.py``. On fewer GPUs these tests skip:
what they check is the collectives and the per-device expert slices, which one device cannot exercise.

Both meshes over all P devices: expert parallel (1, P) and data parallel (P, 1), Explicit axes. Seeded random
inputs, a seed per case (printed on failure). Checked: y, the load-balancing and z losses, and the gradients of x,
the router kernel and both expert weights of ``sum(y * ct) + lb + 0.1 z``, relative-norm error <= ``TOL`` (bf16
inputs and outputs, f32 accumulation: the grouped-matmul GPU tests' tolerance); the expert counts exactly (the
routing is the same computation on the same logits).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_jax
from moe_jax.parallel import moe_ffn_expert_parallel
from tests.oracle import relative_error

pytestmark = pytest.mark.gpu
TOL = 1e-2
T, D, F, E = 4096, 1024, 512, 32
CASES = {
    "softmax_swiglu": dict(top_k=4, activation="swiglu"),
    "grouped_sigmoid_bias_geglu": dict(
        top_k=8, activation="geglu", score="sigmoid", num_groups=8, top_groups=4, scale=2.5, use_bias=True
    ),
    "capacity_gpt_oss": dict(top_k=4, activation="gpt_oss", capacity_factor=0.8),
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

    return dict(
        x=normal(keys[0], (T, D), 1),
        router_kernel=normal(keys[1], (D, E), D),
        w_gate_up=moe_jax.pack_gate_up(normal(keys[2], (E, D, 2 * F), D)),
        w_down=normal(keys[3], (E, F, D), F),
        bias=jax.random.normal(keys[4], (E,), jnp.float32) * 0.1,
        ct=normal(keys[5], (T, D), 1),
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
    return jax.device_get(
        dict(y=y, lb=aux.load_balancing_loss, z=aux.z_loss, counts=aux.expert_counts, grads=jax.tree.leaves(grads))
    )


# The capacity is per expert-axis group: equal to moe_ffn's only where one group holds the batch (layout "expert").
LAYOUTS = [(case, "expert") for case in CASES] + [
    (case, "data") for case in CASES if "capacity_factor" not in CASES[case]
]


@pytest.mark.parametrize(("case", "layout"), LAYOUTS)
def test_pallas_over_devices_matches_reference(num_devices, case, layout):
    seed = LAYOUTS.index((case, layout))
    inputs = _inputs(seed)
    options = CASES[case]
    expected = _results(moe_jax.moe_ffn, inputs, options, "xla")

    shape = (1, num_devices) if layout == "expert" else (num_devices, 1)
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    placed = dict(inputs)
    placed["x"] = jax.device_put(inputs["x"], NamedSharding(mesh, P(("data", "expert"))))
    for name in ("w_gate_up", "w_down"):
        placed[name] = jax.device_put(inputs[name], NamedSharding(mesh, P("expert")))
    with jax.set_mesh(mesh):
        got = _results(moe_ffn_expert_parallel, placed, options, "pallas")

    np.testing.assert_array_equal(got["counts"], expected["counts"], err_msg=f"seed {seed}")
    pairs = {"y": (got["y"], expected["y"]), "lb": (got["lb"], expected["lb"]), "z": (got["z"], expected["z"])}
    names = ("d_x", "d_router", "d_w_gate_up", "d_w_down")
    pairs |= dict(zip(names, zip(got["grads"], expected["grads"], strict=True), strict=True))
    errors = {name: relative_error(actual, wanted) for name, (actual, wanted) in pairs.items()}
    assert max(errors.values()) <= TOL, f"seed {seed}: {errors}"
