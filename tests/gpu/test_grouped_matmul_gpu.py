"""The sm90 grouped-matmul kernels on the device: fwd, dgrad and wgrad through ``jax.vjp`` of
``moe_jax.grouped_matmul(backend="pallas")``.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_grouped_matmul_gpu.py``.

- Named shapes at full size, uniform and skewed routings: XLA's ragged_dot is too slow and too large there (it
  multiplies by every group), so the oracle is the exact f32 product of three groups (first non-empty, largest,
  last non-empty) plus every row past the sum, which must be exactly zero.
- A seeded random sweep of smaller shapes and routings against the XLA reference (``jax.lax.ragged_dot``) on the
  same device, both rhs layouts, bf16 and f32 outputs.
Tolerance: relative-norm error ``TOL`` against f32 results (bf16 inputs, f32 accumulation, bf16 rounding of outputs
and of the cotangent); ``F32_OUT_TOL`` for f32 outputs of the sweep.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax._core.testing import GroupOracle, random_group_sizes, relative_error
from moe_jax.ops import shapes
from moe_jax.ops.grouped_matmul import reference

pytestmark = pytest.mark.gpu
TOL = 1e-2
# f32 outputs from the same bf16 inputs differ from the reference only by the summation order (~1e-6); a kernel
# that rounded through bf16 would be ~2e-3 off, which TOL would let through.
F32_OUT_TOL = 1e-4


def _inputs(key, g, m, k, n, transpose_rhs=False):
    keys = jax.random.split(key, 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = (jax.random.normal(keys[1], rhs_shape, jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    return lhs, rhs, jax.random.normal(keys[2], (m, n), jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("fn", "transpose_rhs", "out_dtype"))
def _fwd_bwd(lhs, rhs, group_sizes, cotangent, *, fn, transpose_rhs=False, out_dtype=None):
    def op(a, b):
        return fn(a, b, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)

    out, pullback = jax.vjp(op, lhs, rhs)
    return (out, *pullback(cotangent.astype(out.dtype)))


pallas = functools.partial(moe_jax.grouped_matmul, backend="pallas")


# One projection per model (each full-size case takes ~30-60 s to build, compile and check), plus skewed routings.
NAMED = [
    ("qwen3-30b/gate_up", "uniform"),
    ("qwen3-30b/gate_up", "half"),
    ("qwen3-30b/down", "zipf1.2"),
    ("gpt-oss-120b/down", "uniform"),
    ("dsv3-ep8/gate_up", "uniform"),
    ("mixtral/down", "half"),
]


@pytest.mark.parametrize("name, routing", NAMED)
def test_named_shape_against_exact_groups(name, routing):
    shape = shapes.GMM_SHAPES[name]
    lhs, rhs, cotangent = _inputs(jax.random.key(1), shape.g, shape.m, shape.k, shape.n)
    # Route 15/16 of the rows so that the kernels also write the zero rows past the sum.
    group_sizes = shape.group_sizes(routing, seed=2) * 15 // 16
    out, d_lhs, d_rhs = _fwd_bwd(lhs, rhs, group_sizes, cotangent, fn=pallas)

    oracle = GroupOracle(lhs, rhs, group_sizes, cotangent)
    for what, errors in zip(("out", "d_lhs", "d_rhs"), oracle.group_errors((out, d_lhs, d_rhs)), strict=True):
        for g, error in errors.items():
            assert error < TOL, f"{what}, group {g}"
    past = oracle.routed_rows
    assert float(jnp.max(jnp.abs(out[past:]))) == 0.0 and float(jnp.max(jnp.abs(d_lhs[past:]))) == 0.0


def _sweep_cases(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for index in range(count):
        g = int(rng.choice([1, 3, 8, 16]))
        m = int(rng.integers(64, 3000))  # mostly off 8 and off the 128-row tile
        k, n = (64 * int(rng.integers(1, 16)) for _ in range(2))
        kind = str(rng.choice(["uniform", "empty", "hot", "tail", "zipf"]))
        sizes = random_group_sizes(rng, g, m, kind)
        yield pytest.param(
            g, m, k, n, sizes, bool(rng.integers(2)), [None, jnp.float32][index % 2], id=f"{index}-{kind}"
        )


@pytest.mark.parametrize("g, m, k, n, sizes, transpose_rhs, out_dtype", list(_sweep_cases(8)))
def test_random_shapes_against_reference(g, m, k, n, sizes, transpose_rhs, out_dtype):
    lhs, rhs, cotangent = _inputs(jax.random.key(m), g, m, k, n, transpose_rhs)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    options = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype)
    kernel = _fwd_bwd(lhs, rhs, group_sizes, cotangent, fn=pallas, **options)
    expected = _fwd_bwd(lhs, rhs, group_sizes, cotangent, fn=reference.grouped_matmul, **options)
    for what, actual, exact in zip(("out", "d_lhs", "d_rhs"), kernel, expected, strict=True):
        assert actual.shape == exact.shape and actual.dtype == exact.dtype, what
        tol = F32_OUT_TOL if what == "out" and out_dtype == jnp.float32 else TOL
        assert relative_error(actual, exact) < tol, what
    past = int(np.sum(sizes))
    assert float(jnp.max(jnp.abs(kernel[0][past:]), initial=0.0)) == 0.0
