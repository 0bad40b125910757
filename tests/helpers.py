"""What many test files share: the checking interpreter, abstract devices (simulated SMs, a CUDA lowering target) and
seeded input builders.

The builders draw from a ``np.random.Generator`` in a fixed order and return float64 NumPy arrays; a test casts them
to the dtypes it checks (``jnp.asarray(w, jnp.bfloat16)``), so the oracle can read the same draws at full precision.
"""

import contextlib
import functools
import itertools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the interpreter's race state has no public API
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

import moe_jax
from moe_jax.ops.grouped_matmul import glu
from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK, split_gate_up
from tests import oracle

# ------------------------------------------------------------------------------------------------------ interpreter

# The checking interpreter: races detected, uninitialised memory (shared and output buffers) poisoned with NaN.
CHECKING_INTERPRETER = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


@contextlib.contextmanager
def checked_interpreter():
    """Runs every Mosaic GPU kernel inside under the checking interpreter; raises if any of them raced.

    The interpreter keeps the race state of the last kernel only, so each kernel's state is recorded as it is made.
    """
    states = []
    state_type = gpu_callbacks.GPURaceDetectionState

    def recording_state(*args, **kwargs):
        states.append(state_type(*args, **kwargs))
        return states[-1]

    with (
        mock.patch.object(gpu_callbacks, "GPURaceDetectionState", recording_state),
        plgpu.force_gpu_interpret_mode(CHECKING_INTERPRETER),
    ):
        yield
    raced = sum(state.races_found for state in states)
    assert not raced, f"the interpreter detected a data race in {raced} of {len(states)} kernel runs"


def jitted_vjp(fn, primals, cotangent) -> tuple:
    """``(fn(*primals), *its VJP at cotangent)`` as one jitted program: dispatched op by op, the glue around the kernels
    (and a pure-JAX reference) compiles one small program per operation and shape, which takes longer than running it.
    """

    def value_and_pullback(primals, cotangent):
        out, pullback = jax.vjp(fn, *primals)
        return (out, *pullback(cotangent))

    return jax.jit(value_and_pullback)(primals, cotangent)


def simulated_sms(num_sms: int):
    """A context in which persistent kernels see ``num_sms`` SMs on the CPU (``hardware.num_sms`` reads an abstract
    device's core count): the interpreter's time grows with them."""
    device = AbstractDevice(device_kind="cpu", num_cores=num_sms, platform="cpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def virtual_devices_flags(count: int) -> str:
    """XLA_FLAGS for a subprocess that sees ``count`` virtual CPU devices: this process's flags (tools/test.sh's
    unoptimised code generation, ``configure_cpu_interpreter``'s scheduler option) and the device count."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()


# ------------------------------------------------------------------------------------------------- cross-products


def pairwise_by_default(*value_lists) -> list:
    """The cross-product of three or more ``value_lists`` (of two values or more each) as pytest params, those whose
    values' indices add up to an odd number marked ``slow``: every pair of values of two of the lists still runs by
    default, the values of the others chosen to make the sum even (tests/README.md, "The default run and the full
    one"). A value that is a tuple fills as many arguments."""
    assert len(value_lists) >= 3 and all(len(values) >= 2 for values in value_lists)
    cases = []
    for indices in itertools.product(*(range(len(values)) for values in value_lists)):
        chosen = [values[index] for values, index in zip(value_lists, indices, strict=True)]
        args = [arg for value in chosen for arg in (value if isinstance(value, tuple) else (value,))]
        cases.append(pytest.param(*args, marks=() if sum(indices) % 2 == 0 else pytest.mark.slow))
    return cases


# ------------------------------------------------------------------------------------------------- lowering for CUDA

# An abstract H200: kernels build for the GPU (``hardware.interpret_params()`` is None) on its 132 SMs. Lowering stops
# before the CUDA compiler, so it needs no GPU.
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def on_abstract_h200():
    """A context in which the kernels are built (not interpreted) for an H200, on a CPU host."""
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=H200))


def cuda_lowering(fn, *args) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA at ``args`` (arrays or ``jax.ShapeDtypeStruct``s)."""
    with on_abstract_h200():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ---------------------------------------------------------------------------------------------------------- inputs


def layer_inputs(seed: int, t: int, d: int, f: int, e: int) -> tuple:
    """(x [T, D] bf16, router kernel [D, E] f32, packed w_gate_up [E, D, 2F] bf16, w_down [E, F, D] bf16, cotangent
    [T, D] f32) of one MoE layer, normal over the fan-in."""
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.bfloat16)
    router = jax.random.normal(keys[1], (d, e)) * d**-0.5
    w_gate_up = moe_jax.pack_gate_up((jax.random.normal(keys[2], (e, d, 2 * f)) * d**-0.5).astype(jnp.bfloat16))
    w_down = (jax.random.normal(keys[3], (e, f, d)) * f**-0.5).astype(jnp.bfloat16)
    return x, router, w_gate_up, w_down, jax.random.normal(keys[4], (t, d))


def expert_weights(rng: np.random.Generator, num_experts: int, d: int, f: int) -> tuple[np.ndarray, np.ndarray]:
    """w_gate_up [E, D, 2F] as [gate | up] and w_down [E, F, D], normal over the fan-in (std 1/sqrt(D), 1/sqrt(F))."""
    w_gate_up = rng.normal(size=(num_experts, d, 2 * f)) / np.sqrt(d)
    w_down = rng.normal(size=(num_experts, f, d)) / np.sqrt(f)
    return w_gate_up, w_down


def grouped_matmul_inputs(rng, m: int, k: int, n: int, num_groups: int, transpose_rhs: bool = False):
    """lhs [M, K] standard normal, rhs [G, K, N] (or [G, N, K]) with std 1/sqrt(K)."""
    lhs = rng.normal(size=(m, k))
    rhs = rng.normal(size=(num_groups, n, k) if transpose_rhs else (num_groups, k, n)) / np.sqrt(k)
    return lhs, rhs


def glu_mlp_inputs(rng, m: int, d: int, f: int, num_groups: int, x_scale: float = 1.0) -> dict:
    """x [M, D] with std ``x_scale``, ``expert_weights``, row_scale [M] uniform in [0.1, 1)."""
    x = x_scale * rng.normal(size=(m, d))
    w_gate_up, w_down = expert_weights(rng, num_groups, d, f)
    return dict(x=x, w_gate_up=w_gate_up, w_down=w_down, row_scale=rng.uniform(0.1, 1.0, size=m))


def moe_layer_inputs(rng, t: int, d: int, f: int, num_experts: int) -> dict:
    """x [T, D] standard normal, router_kernel [D, E] with std 1/sqrt(D), ``expert_weights``."""
    x = rng.normal(size=(t, d))
    router_kernel = rng.normal(size=(d, num_experts)) / np.sqrt(d)
    w_gate_up, w_down = expert_weights(rng, num_experts, d, f)
    return dict(x=x, router_kernel=router_kernel, w_gate_up=w_gate_up, w_down=w_down)


def normal(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    """[*shape] float32: ``scale`` x standard normal draws from ``seed``."""
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype(np.float32)


def random_routing(seed: int, num_tokens: int, num_experts: int, top_k: int) -> moe_jax.Routing:
    """``moe_jax.route`` (the XLA reference, one jitted program) of standard normal f32 logits drawn from ``seed``."""
    return _route_on_xla(jnp.asarray(normal(seed, (num_tokens, num_experts))), top_k)


# Op by op, routing compiles one small program per operation and shape.
_route_on_xla = jax.jit(functools.partial(moe_jax.route, backend="xla"), static_argnums=1)


def check_glu_backward(outputs, gate, up, d_h, row_scale, activation: str, routed_rows: int, *, hidden_tol, grad_tol):
    """Asserts that the GLU-backward kernel's ``outputs`` (d_gate_up [M, 2F] packed, h * row_scale [M, F],
    d_row_scale [M] or None) match ``jax.vjp`` of the reference GLU at the kept pre-activation (gate, up [M, F] f32)
    for the product d_h [M, F] f32 (before the row scale): within ``grad_tol`` for the gradients and ``hidden_tol``
    for h, over the first ``routed_rows`` rows; past them the product is 0, so d_gate_up and d_row_scale are exactly
    0 (h depends on the pre-activation alone and is written for every row)."""
    d_gate_up, hidden, d_row_scale = outputs
    d_gate_up, expected_d_gate_up, expected_hidden, expected_d_row_scale = _glu_backward_expected(
        d_gate_up, gate, up, d_h, row_scale, activation
    )
    assert oracle.relative_error(d_gate_up[:routed_rows], expected_d_gate_up[:routed_rows]) < grad_tol
    np.testing.assert_array_equal(np.asarray(d_gate_up, np.float32)[routed_rows:], 0.0)
    assert oracle.relative_error(hidden, expected_hidden) < hidden_tol
    if row_scale is None:
        assert d_row_scale is None
        return
    assert oracle.relative_error(d_row_scale[:routed_rows], expected_d_row_scale[:routed_rows]) < grad_tol
    np.testing.assert_array_equal(np.asarray(d_row_scale)[routed_rows:], 0.0)


@functools.partial(jax.jit, static_argnames="activation")
def _glu_backward_expected(d_gate_up, gate, up, d_h, row_scale, activation):
    """``check_glu_backward``'s arrays as one jitted program (op by op, each would compile a small program): the
    kernel's d_gate_up unpacked to [gate | up], and jax.vjp's d_gate_up, h * row_scale and d_row_scale (None without
    a row scale)."""
    scale = 1.0 if row_scale is None else row_scale[:, None]
    hidden, pullback = jax.vjp(lambda g, u: glu.glu(g, u, activation), gate, up)
    expected_d_gate_up = jnp.concatenate(pullback(d_h * scale), axis=1)
    expected_d_row_scale = None if row_scale is None else jnp.sum(hidden * d_h, axis=1)
    d_gate_up = jnp.concatenate(split_gate_up(d_gate_up, PACK_BLOCK), axis=1)
    return d_gate_up, expected_d_gate_up, hidden * scale, expected_d_row_scale
