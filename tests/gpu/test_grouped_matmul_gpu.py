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
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.grouped_matmul import launch, reference
from moe_jax.ops.grouped_matmul.config import Config
from tests.oracle import GroupOracle, random_group_sizes, relative_error

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
    ("qwen3-30b-t128/gate_up", "uniform"),  # decode-sized groups (8 rows): the heuristic's 64-row tiles
    ("gpt-oss-120b-t128/down", "zipf1.2"),
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


# Every value of every Config field, in configs that fit in shared memory (per output dtype), at one small ragged
# shape (M 700 off the tile, an empty group, a 1-row group, 49 rows past the sum; K 384 and N 576 off the 256-wide
# tiles). The CPU tests run these kernels under the interpreter, which does not apply the hardware's alignment
# rules: epilogue_n=32 passed there and faulted here (CUDA_ERROR_MISALIGNED_ADDRESS), and Config now rejects it.
CONFIG_SPACE = [
    Config(block_m=64, block_n=64, num_stages=2, num_compute_wgs=1, grid_minor="m"),
    Config(block_m=64, block_n=256, num_compute_wgs=1),
    Config(block_m=64, block_n=128, num_compute_wgs=1, grid_minor="m"),
    Config(block_m=64, block_n=256, num_compute_wgs=1, overlap_epilogue=True),
    Config(block_m=128, block_n=64),
    Config(block_m=128, block_n=128, num_compute_wgs=1, grid_width=3),
    Config(block_m=128, block_n=128, grid_minor="m", grid_width=16),
    Config(block_m=128, block_n=128, overlap_epilogue=True),
    Config(block_m=128, block_n=192, grid_minor="m"),
    Config(block_m=128, block_n=192, epilogue_n=192, num_stages=3, overlap_epilogue=True),
    Config(block_m=128, block_n=256, block_k=128, num_stages=2, grid_minor="m", grid_width=1),
    Config(block_m=128, block_n=256, epilogue_n=128, num_stages=3),
    Config(block_m=128, block_n=256, grid_minor="m", overlap_epilogue=True),
    Config(block_m=256, block_n=64),
    Config(block_m=256, block_n=128, num_stages=3, grid_minor="m"),
    Config(block_m=256, block_n=256, num_stages=2),
    Config(block_m=128, block_n=128, grid_minor="g", grid_width=2, keep_ctas_in_step=True),
    Config(block_m=128, block_n=256, grid_minor="g", grid_width=16, overlap_epilogue=True, keep_ctas_in_step=True),
]
CONFIG_SPACE_SIZES = [0, 300, 1, 150, 200]


def _config_id(c: Config) -> str:
    extra = f"{'o' if c.overlap_epilogue else ''}{'t' if c.keep_ctas_in_step else ''}"
    return f"{c.block_m}x{c.block_n}x{c.block_k}s{c.num_stages}w{c.num_compute_wgs}e{c.epilogue_n}{c.grid_minor}{extra}"


@pytest.mark.parametrize("config", CONFIG_SPACE, ids=_config_id)
def test_every_config_field_value_runs_on_device(config):
    m, k, n, sizes = 700, 384, 576, CONFIG_SPACE_SIZES
    lhs, rhs, dout = _inputs(jax.random.key(7), len(sizes), m, k, n)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    a, b = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    f32_product = functools.partial(reference.grouped_matmul, preferred_element_type=jnp.float32)
    exact = {
        "fwd": f32_product(lhs, rhs, group_sizes),
        "dgrad": f32_product(dout, rhs, group_sizes, transpose_rhs=True),
        "wgrad": np.stack([a[s:e].T @ b[s:e] for s, e in zip(offsets[:-1], offsets[1:], strict=True)]),
    }
    kernels = {
        "fwd": functools.partial(launch.run_rows_kernel, "fwd", lhs, rhs, group_sizes, w_transposed=False),
        "dgrad": functools.partial(launch.run_rows_kernel, "dgrad", dout, rhs, group_sizes, w_transposed=True),
        "wgrad": functools.partial(launch.run_wgrad_kernel, lhs, dout, group_sizes),
    }
    ran = 0
    for (kind, kernel), out_dtype in itertools.product(kernels.items(), (jnp.bfloat16, jnp.float32)):
        if not config.fits(2, jnp.dtype(out_dtype).itemsize):
            continue
        if kind == "wgrad" and (config.block_n // config.num_compute_wgs) % 64:
            with pytest.raises(ValueError, match="block_n must be a multiple of"):
                kernel(out_dtype=out_dtype, config=config)
            continue
        if kind == "wgrad" and config.grid_minor == "g":
            with pytest.raises(ValueError, match="grid_minor must be 'm' or 'n'"):
                kernel(out_dtype=out_dtype, config=config)
            continue
        out = np.asarray(kernel(out_dtype=out_dtype, config=config), np.float32)
        tol = F32_OUT_TOL if out_dtype == jnp.float32 else TOL
        assert relative_error(out, exact[kind]) < tol, (kind, out_dtype)
        zeros = out[0] if kind == "wgrad" else out[sum(sizes) :]  # the empty group's gradient; rows past the sum
        assert np.all(zeros == 0.0), (kind, out_dtype)
        ran += 1
    assert ran >= 2, "every config runs at least its bf16 fwd and dgrad"


# Non-finite values in rows a group's chunks read but do not own: past the sum in both operands, or inside group 3
# in y only (group 2's chunk shares it), which takes the kernel's y-masking branch and its barrier between the
# consumers. One and two consumer warpgroups, with and without the overlapped epilogue.
@pytest.mark.parametrize(
    "config",
    [
        Config(block_m=64, block_n=128, num_compute_wgs=1),
        Config(block_n=128, overlap_epilogue=True),
        Config(block_n=256, num_stages=3),  # fits the f32 output tile
    ],
    ids=_config_id,
)
@pytest.mark.parametrize("poison", ["past the sum", "inside a neighbour"])
def test_wgrad_ignores_nonfinite_neighbouring_rows(config, poison):
    m, p, q, sizes = 1000, 256, 512, [300, 0, 5, 400, 100]
    rng = np.random.default_rng(len(poison))
    x = rng.normal(size=(m, p)).astype(np.float32)
    y = rng.normal(size=(m, q)).astype(np.float32)
    x[sum(sizes) :] = np.nan
    if poison == "past the sum":
        y[sum(sizes) :] = np.inf
    else:
        y[330, 7] = -np.inf  # group 3's row; group 2 (rows 300-304) reads rows 296-359 (block_k 64)
    x, y = jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16)
    out = np.asarray(launch.run_wgrad_kernel(x, y, jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32, config=config))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    xb, yb = np.asarray(x, np.float64), np.asarray(y, np.float64)
    clean = [0, 1, 2, 4] if poison == "inside a neighbour" else [0, 1, 2, 3, 4]  # group 3 owns its -inf
    for g in clean:
        s, e = offsets[g], offsets[g + 1]
        assert relative_error(out[g], xb[s:e].T @ yb[s:e]) < F32_OUT_TOL, g
