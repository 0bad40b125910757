"""The FP8 kernel (``grouped_matmul(quantization="fp8_block", backend="pallas")``: forward and dgrad) on the device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_grouped_matmul_fp8_gpu.py``.

- Promotion. Hopper's FP8 wgmma accumulates with about 14 bits, which the kernel confines to one 128-wide K block
  before adding the block, scaled, to an f32 total. With all-positive operands at K = 7168 no cancellation hides the
  accumulator's error, so the data separate the two: the test simulates on the same quantized operands a 14-bit
  accumulator (truncating, one add per 32-wide wgmma step) reset every 128 K and promoted in f64, and one that runs
  over all of K, and the kernel's error against the exact product must lie below the geometric mean of the two.
- A named shape (dsv3-ep8 gate_up, uniform routing, 1/16 of the rows past the sum) against the XLA implementation
  on three groups (first non-empty, largest, last non-empty), each run alone: a row's activation blocks and a group's
  weight blocks do not depend on the other groups. Rows past the sum must be exactly zero.
- A seeded sweep of small ragged shapes against the XLA implementation, forward and d lhs (the dgrad kernel), with K
  and N multiples of 128 or 64 off one (partial last blocks).
- The GLU forward keeping its pre-activation in FP8 blocks, quantized in its epilogue (qwen3-30b gate_up, whose
  tiles fit the epilogue's buffers without losing a stage), against the same kernel keeping bf16 and the quantizer
  kernel after it: equal bit for bit.
- mxfp8 under "pallas" (the bf16 kernels on its exactly dequantized operands) against its XLA path.
- The wgrad (d rhs, the FP8 wgrad kernel): at a named shape against the recipe's wgrad in XLA on three groups, each
  run alone (its row blocks start at its first row either way), and in a seeded sweep of small ragged shapes in both
  weight layouts against the XLA path's d rhs. Its tensor cores accumulate 128 rows per block (~2^-14 of a block's
  partial sums): ``F32_OUT_TOL`` for f32 outputs, ``BF16_OUT_TOL`` for bf16.
Tolerances against the XLA implementation (f32 products of the dequantized operands): ``F32_OUT_TOL`` where the
kernel writes f32 (the tensor cores' ~14-bit accumulation within a block errs by ~2^-14 of a block's partial sums,
a missed scale or block by O(1)); ``BF16_OUT_TOL`` for bf16 outputs (their rounding, 2^-9). ``GLU_DGRAD_TOL``: with
a GLU and bf16 outputs the kernel path keeps the pre-activation in bf16 for the backward, the XLA path in f32; the
cotangent's e4m3 quantization turns that 2^-9 difference into whole e4m3 steps (2^-4) of the ~1/32 of elements
near a rounding boundary, 1.2e-2 in d lhs (measured under the interpreter).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.grouped_matmul import api, launch, reference_fp8
from moe_jax.ops.grouped_matmul.packing import pack_gate_up
from tests.oracle import random_group_sizes, relative_error

pytestmark = pytest.mark.gpu
F32_OUT_TOL = 2e-3
BF16_OUT_TOL = 1e-2
GLU_DGRAD_TOL = 3e-2
MXFP8_TOL = 1e-4
ACCUMULATOR_BITS = 14  # significant bits Hopper's FP8 wgmma keeps while accumulating (DeepSeek-V3 report)
WGMMA_K = 32  # FP8 products one wgmma instruction adds to the accumulator
BLOCK = 128


def _pallas(lhs, rhs, group_sizes, **options):
    return moe_jax.grouped_matmul(lhs, rhs, group_sizes, quantization="fp8_block", backend="pallas", **options)


def _xla(lhs, rhs, group_sizes, **options):
    return moe_jax.grouped_matmul(lhs, rhs, group_sizes, quantization="fp8_block", backend="xla", **options)


def _truncated(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` rounded toward zero to ``bits`` significant bits."""
    mantissa, exponent = np.frexp(values)
    return np.ldexp(np.trunc(mantissa * 2.0**bits) / 2.0**bits, exponent)


def _simulated(x_values, x_scales, w_values, w_scales, promote_every: int) -> np.ndarray:
    """x [M, K] . w [N, K]^T with the products of FP8 values accumulated in a truncating ACCUMULATOR_BITS-bit
    accumulator, WGMMA_K products per add; every ``promote_every`` K it is scaled into an f64 total and reset (with
    ``promote_every = K`` the scales are applied per product instead, as one long accumulation would need)."""
    k = x_values.shape[1]
    total = np.zeros((x_values.shape[0], w_values.shape[0]))
    accumulator = np.zeros_like(total)
    for k0 in range(0, k, WGMMA_K):
        block = k0 // BLOCK
        a, b = x_values[:, k0 : k0 + WGMMA_K], w_values[:, k0 : k0 + WGMMA_K]
        if promote_every < k:
            accumulator = _truncated(accumulator + a @ b.T, ACCUMULATOR_BITS)
            if (k0 + WGMMA_K) % promote_every == 0:
                total += accumulator * x_scales[:, block, None] * w_scales[None, block]
                accumulator = np.zeros_like(total)
        else:
            scaled = (a * x_scales[:, block, None]) @ (b * w_scales[block]).T
            total = _truncated(total + scaled, ACCUMULATOR_BITS)
    return total


def test_promotion_per_128_k_bounds_the_error_at_long_k():
    m, k, n = 256, 7168, BLOCK  # one weight block of columns: one scale per K block
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.uniform(keys[0], (m, k), jnp.float32, 0.25, 1.0).astype(jnp.bfloat16)
    rhs = jax.random.uniform(keys[1], (1, n, k), jnp.float32, 0.25, 1.0).astype(jnp.bfloat16)
    x = moe_jax.quantize_blockwise(lhs, (1, BLOCK))
    w = api.quantize_weights(rhs, transpose_rhs=True)
    group_sizes = jnp.array([m], jnp.int32)
    out = _pallas(x, w, group_sizes, transpose_rhs=True, preferred_element_type=jnp.float32)

    x_values, w_values = (np.asarray(q.values.astype(jnp.float32), np.float64) for q in (x, w))
    x_scales = np.asarray(x.scales, np.float64)  # [M, K / 128]
    w_values, w_scales = w_values[0], np.asarray(w.scales[0, 0], np.float64)  # [N, K], [K / 128]
    exact = (x_values * np.repeat(x_scales, BLOCK, axis=1)) @ (w_values * np.repeat(w_scales, BLOCK)).T
    promoted = _simulated(x_values, x_scales, w_values, w_scales, BLOCK)
    unpromoted = _simulated(x_values, x_scales, w_values, w_scales, k)
    promoted_error, unpromoted_error = relative_error(promoted, exact), relative_error(unpromoted, exact)
    assert unpromoted_error > 10 * promoted_error, "the data do not separate the two accumulations"
    bound = np.sqrt(promoted_error * unpromoted_error)
    assert relative_error(out, exact) < bound, (promoted_error, unpromoted_error)


@functools.partial(jax.jit, static_argnames=("fn", "activation", "out_dtype"))
def _forward_and_dgrad(lhs, rhs, group_sizes, cotangent, *, fn, activation=None, out_dtype=None):
    """(out, d lhs) of ``fn`` with weights [G, N, K]; ``cotangent`` comes in the output's dtype.

    It is rounded before the jit, not inside: XLA:GPU folds a convert to bf16 and back to f32 in one program, so the
    XLA path's backward would quantize the unrounded f32 cotangent while the kernel path quantizes the bf16 one it
    is given (1.3e-2 apart in d lhs: e4m3 steps of the elements near a rounding boundary)."""

    def op(x):
        return fn(x, rhs, group_sizes, activation=activation, transpose_rhs=True, preferred_element_type=out_dtype)

    out, pullback = jax.vjp(op, lhs)
    assert cotangent.dtype == out.dtype
    return out, pullback(cotangent)[0]


def _check(kernel, expected, sizes, tols) -> None:
    """The kernel's (out, d lhs) against the expected ones, each within its tolerance; zero rows past the sum."""
    for name, actual, exact, tol in zip(("out", "d_lhs"), kernel, expected, tols, strict=True):
        assert actual.dtype == exact.dtype, name
        assert relative_error(actual, exact) < tol, name
        assert float(jnp.max(jnp.abs(actual[int(np.sum(sizes)) :].astype(jnp.float32)), initial=0.0)) == 0.0, name


@pytest.mark.parametrize(
    "activation, out_dtype, tols",
    [
        (None, jnp.float32, (F32_OUT_TOL, BF16_OUT_TOL)),  # d lhs is bf16, as lhs
        ("swiglu", jnp.float32, (F32_OUT_TOL, BF16_OUT_TOL)),
        ("swiglu", None, (BF16_OUT_TOL, GLU_DGRAD_TOL)),
    ],
)
def test_named_shape_against_xla_on_three_groups(activation, out_dtype, tols):
    s = shapes.GMM_SHAPES["dsv3-ep8/gate_up"]
    keys = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(keys[0], (s.m, s.k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (s.g, s.n, s.k), jnp.float32) * s.k**-0.5).astype(jnp.bfloat16)
    cotangent = jax.random.normal(keys[2], (s.m, s.n // 2 if activation else s.n), out_dtype or jnp.bfloat16)
    weights = pack_gate_up(rhs, transposed=True) if activation else rhs
    group_sizes = s.group_sizes("uniform", seed=2) * 15 // 16
    options = dict(activation=activation, out_dtype=out_dtype)
    kernel = _forward_and_dgrad(lhs, weights, group_sizes, cotangent, fn=_pallas, **options)

    sizes = np.asarray(group_sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    nonempty = np.flatnonzero(sizes)
    for g in sorted({int(nonempty[0]), int(np.argmax(sizes)), int(nonempty[-1])}):
        rows = slice(int(starts[g]), int(starts[g] + sizes[g]))
        group_weights = pack_gate_up(rhs[g : g + 1], transposed=True) if activation else rhs[g : g + 1]
        group_sizes_g = jnp.array([sizes[g]], jnp.int32)
        expected = _forward_and_dgrad(lhs[rows], group_weights, group_sizes_g, cotangent[rows], fn=_xla, **options)
        _check([a[rows] for a in kernel], expected, sizes[g], tols)
    _check(kernel, kernel, sizes, (np.inf, np.inf))  # the rows past the sum


def _sweep_cases(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for index in range(count):
        g = int(rng.choice([1, 3, 8, 16]))
        m = int(rng.integers(64, 3000))  # mostly off 8 and off the 128-row tile
        # K and N alternately multiples of 128 and 64 off one: a 64-wide last K block (a 64-byte swizzle), a
        # 64-column last tile forward, and the dgrad's contraction N ending in a 64-wide block.
        off = 64 * (index % 2)
        k, n = 128 * int(rng.integers(1, 12)) - off, 128 * int(rng.integers(1, 8)) - off
        kind = str(rng.choice(["uniform", "empty", "hot", "tail", "zipf"]))
        sizes = random_group_sizes(rng, g, m, kind)
        # f32 inputs for f32 outputs (the output dtype and d lhs's are the inputs').
        yield pytest.param(g, m, k, n, sizes, [jnp.bfloat16, jnp.float32][index % 2], id=f"{index}-{kind}")


@pytest.mark.parametrize("g, m, k, n, sizes, dtype", list(_sweep_cases(6)))
def test_random_shapes_against_xla(g, m, k, n, sizes, dtype):
    keys = jax.random.split(jax.random.key(m), 3)
    lhs = jax.random.normal(keys[0], (m, k), dtype)
    rhs = (jax.random.normal(keys[1], (g, n, k), jnp.float32) * k**-0.5).astype(dtype)
    cotangent = jax.random.normal(keys[2], (m, n), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    kernel = _forward_and_dgrad(lhs, rhs, group_sizes, cotangent, fn=_pallas)
    expected = _forward_and_dgrad(lhs, rhs, group_sizes, cotangent, fn=_xla)
    tol = F32_OUT_TOL if dtype == jnp.float32 else BF16_OUT_TOL
    _check(kernel, expected, sizes, (tol, tol))


def test_wgrad_named_shape_against_xla_on_three_groups():
    s = shapes.GMM_SHAPES["dsv3-ep8/gate_up"]
    keys = jax.random.split(jax.random.key(3), 2)
    lhs = jax.random.normal(keys[0], (s.m, s.k), jnp.bfloat16)
    d_out = jax.random.normal(keys[1], (s.m, s.n), jnp.bfloat16)
    group_sizes = s.group_sizes("uniform", seed=4) * 15 // 16
    # [G, N, K]: the layout of the forward's weights.
    d_rhs = jax.jit(launch.run_fp8_wgrad_kernel, static_argnames="out_dtype")(
        d_out, lhs, group_sizes, out_dtype=jnp.float32
    )
    assert d_rhs.shape == (s.g, s.n, s.k)

    sizes = np.asarray(group_sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    nonempty = np.flatnonzero(sizes)
    recipe = reference_fp8.RECIPES["fp8_block"]
    wgrad = jax.jit(reference_fp8.quantized_wgrad, static_argnums=(3, 4, 5))
    for g in sorted({int(nonempty[0]), int(np.argmax(sizes)), int(nonempty[-1])}):
        rows = slice(int(starts[g]), int(starts[g] + sizes[g]))
        one_group = jnp.array([sizes[g]], jnp.int32)
        expected = wgrad(lhs[rows], one_group, d_out[rows], recipe, True, jnp.float32)[0]
        assert relative_error(d_rhs[g], expected) < F32_OUT_TOL, g


@functools.partial(jax.jit, static_argnames=("backend", "transpose_rhs"))
def _weight_gradient(lhs, rhs, group_sizes, cotangent, *, backend, transpose_rhs):
    def op(rhs):
        return moe_jax.grouped_matmul(
            lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, quantization="fp8_block", backend=backend
        )

    _, pullback = jax.vjp(op, rhs)
    return pullback(cotangent)[0]


@pytest.mark.parametrize("g, m, k, n, sizes, dtype", list(_sweep_cases(6, seed=1)))
def test_wgrad_random_shapes_against_xla(g, m, k, n, sizes, dtype):
    """d rhs (in rhs's dtype) in either weight layout (alternating with M's parity)."""
    keys = jax.random.split(jax.random.key(m + 1), 3)
    lhs = jax.random.normal(keys[0], (m, k), dtype)
    transpose_rhs = bool(m % 2)
    shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = (jax.random.normal(keys[1], shape, jnp.float32) * k**-0.5).astype(dtype)
    cotangent = jax.random.normal(keys[2], (m, n), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    args = (lhs, rhs, group_sizes, cotangent)
    kernel = _weight_gradient(*args, backend="pallas", transpose_rhs=transpose_rhs)
    expected = _weight_gradient(*args, backend="xla", transpose_rhs=transpose_rhs)
    assert kernel.shape == rhs.shape and kernel.dtype == expected.dtype == dtype
    assert relative_error(kernel, expected) < (F32_OUT_TOL if dtype == jnp.float32 else BF16_OUT_TOL)


@pytest.mark.parametrize(
    "shape, activation",
    [("qwen3-30b/gate_up", "swiglu"), ("qwen3-30b/gate_up", "gpt_oss"), ("gpt-oss-120b/gate_up", "gpt_oss")],
)
def test_kept_pre_activation_blocks_match_the_quantizer(shape, activation):
    """The epilogue's FP8 blocks against the 1 x 128 quantizer on the kernel's bf16 copy, bit for bit: on two
    consumers (qwen3-30b) and on three, where the block buffer costs a stage (gpt-oss-120b: its K of 2880 ends in a
    half block)."""
    s = shapes.GMM_SHAPES[shape]
    m = s.m // 4
    keys = jax.random.split(jax.random.key(3), 2)
    x = moe_jax.quantize_blockwise(4.0 * jax.random.normal(keys[0], (m, s.k), jnp.bfloat16), (1, 128))
    rhs = (jax.random.normal(keys[1], (s.g, s.n, s.k), jnp.float32) * s.k**-0.5).astype(jnp.bfloat16)
    w = moe_jax.quantize_blockwise(pack_gate_up(rhs, transposed=True).array, (1, 128, 128))
    group_sizes = s.group_sizes("uniform", seed=4) // 4 * 15 // 16

    @functools.partial(jax.jit, static_argnames="keep_blocks")
    def forward(x, w, group_sizes, keep_blocks):
        options = dict(keep=True, keep_blocks=keep_blocks)
        return launch.run_fp8_forward_kernel(x, w, group_sizes, None, activation, jnp.bfloat16, **options)

    hidden, kept = forward(x, w, group_sizes, False)
    hidden_fused, kept_fused = forward(x, w, group_sizes, True)
    expected = moe_jax.quantize_blockwise(kept, (1, 128), backend="pallas")
    np.testing.assert_array_equal(np.asarray(hidden_fused).view(np.uint16), np.asarray(hidden).view(np.uint16))
    np.testing.assert_array_equal(
        np.asarray(kept_fused.values).view(np.uint8), np.asarray(expected.values).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(kept_fused.scales), np.asarray(expected.scales))


def test_mxfp8_on_the_bf16_kernels_matches_xla():
    """mxfp8 under "pallas" (its GEMMs on the bf16 kernels, on dequantized operands bf16 holds exactly) against its
    XLA path: forward, d lhs and d rhs in f32, ragged groups with rows past the sum (zeros in out and d lhs). Both
    sum exact products in f32, the tensor cores in their own order: ``MXFP8_TOL``, under what rounding one operand to
    bf16 would cost at K = 1024 (about 1.7e-3; tests/gpu/test_grouped_matmul_gpu.py says why)."""
    rng = np.random.default_rng(7)
    m, k, n, g = 4096, 1024, 512, 8
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), jnp.float32)
    group_sizes = jnp.asarray(random_group_sizes(rng, g, m, "tail"), jnp.int32)
    cotangent = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)

    def vjp(backend):
        op = functools.partial(moe_jax.grouped_matmul, quantization="mxfp8", backend=backend)
        out, pullback = jax.vjp(lambda x, w: op(x, w, group_sizes), lhs, rhs)
        return (out, *pullback(cotangent))

    kernel_results = vjp("pallas")
    for name, kernel, expected in zip(("out", "d_lhs", "d_rhs"), kernel_results, vjp("xla"), strict=True):
        assert relative_error(kernel, expected) < MXFP8_TOL, name
    rows = int(group_sizes.sum())
    for name, result in zip(("out", "d_lhs"), kernel_results, strict=False):
        assert float(jnp.abs(result[rows:]).max()) == 0.0, name
