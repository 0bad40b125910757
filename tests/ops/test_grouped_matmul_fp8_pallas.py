"""The FP8 kernel (``grouped_matmul(quantization="fp8_block", backend="pallas")``: the forward, and the dgrad where K
is a multiple of 64) under the checking Mosaic GPU interpreter against the XLA implementation, on the same quantized
operands.

The interpreter multiplies the e4m3 values exactly in f32 (its wgmma is a NumPy matmul), so the kernel's sum per
128-wide K block times the scales and the XLA path's product of the dequantized operands differ by f32 rounding only:
``F32_OUT_TOL`` on f32 outputs, ``BF16_OUT_TOL`` where those sums are rounded to bf16 (a rare flip of one bf16 unit,
2^-8 relative, in the relative norm). Through a GLU the gradients start from pre-activations that differ by f32
rounding, and the cotangent's own quantization turns a rare such difference at an e4m3 rounding boundary into a
whole e4m3 step (2^-4 relative) of an element or a block's scale: ``GLU_GRAD_TOL`` (2.6e-5 measured).

Races are detected and uninitialised memory is NaN, so a scale read before its copy landed, or a row or column tile
the kernel forgot, shows up. Shapes are small: 128 x 128 tiles on 4 simulated SMs.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax._core import backend as dispatch
from moe_jax.ops.grouped_matmul import api, config, launch
from moe_jax.ops.grouped_matmul.packing import pack_gate_up
from tests import oracle
from tests.helpers import checked_interpreter, grouped_matmul_inputs, jitted_vjp, simulated_sms

REPO = pathlib.Path(__file__).resolve().parents[2]
F32_OUT_TOL = 1e-5
BF16_OUT_TOL = 2e-3
GLU_GRAD_TOL = 1e-3

# (M, K, N, group sizes). "edges": empty, one row, and 127 / 128 / 129 rows across 128-row tiles, 35 rows past the
# sum. "narrow": M off 8 (padded), N = 192 (a 64-column last column tile and weight-scale block), one hot group.
# "decode": ~25 rows a group, which the config heuristic gives 64-row tiles on one consumer warpgroup. "ragged": K and
# N end in partial 128-wide blocks (a 64-wide last K block, read with a 64-byte swizzle; the dgrad's contraction N
# likewise), as gpt-oss's 2880 does. "odd_k": K = 200, no multiple of 64 (zero-padded to 256; the dgrad, whose output
# columns are K, runs in XLA).
CASES = {
    "edges": (420, 256, 256, [0, 1, 127, 128, 129]),
    "narrow": (203, 384, 192, [0, 203, 0]),
    "decode": (100, 128, 128, [25, 0, 40, 20]),
    "ragged": (203, 320, 192, [0, 120, 83]),
    "odd_k": (100, 200, 128, [60, 0, 40]),
}


def _problem(seed, m, k, n, sizes, *, transpose_rhs=True, dtype=jnp.bfloat16):
    lhs, rhs = grouped_matmul_inputs(np.random.default_rng(seed), m, k, n, len(sizes), transpose_rhs)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes, jnp.int32)


@pytest.fixture
def interpret():
    """Runs the test's kernels under the checking interpreter and fails it on any detected race."""
    with checked_interpreter():
        yield


def _both(lhs, rhs, group_sizes, **options):
    """(the kernel's result, the XLA implementation's) of one quantized call, as one jitted program: dispatched op by
    op, the quantization around the kernel and the XLA path compile one small program per operation and shape."""
    options = dict(quantization="fp8_block", **options)

    def both(lhs, rhs, group_sizes):
        kernel = moe_jax.grouped_matmul(lhs, rhs, group_sizes, backend="pallas", **options)
        return kernel, moe_jax.grouped_matmul(lhs, rhs, group_sizes, backend="xla", **options)

    return jax.jit(both)(lhs, rhs, group_sizes)


@pytest.mark.parametrize(
    "case, transpose_rhs, out_dtype",
    [
        ("edges", True, jnp.float32),
        ("edges", False, jnp.bfloat16),
        ("narrow", True, None),
        ("decode", True, None),
        ("ragged", True, jnp.float32),
        ("odd_k", False, jnp.float32),
    ],
)
@pytest.mark.usefixtures("interpret")
def test_forward_matches_xla(case, transpose_rhs, out_dtype):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _problem(0, m, k, n, sizes, transpose_rhs=transpose_rhs)
    out, expected = _both(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)
    assert out.shape == (m, n) and out.dtype == (out_dtype or jnp.bfloat16) == expected.dtype
    tol = F32_OUT_TOL if out_dtype == jnp.float32 else BF16_OUT_TOL
    assert oracle.relative_error(out, expected) < tol
    np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(sizes) :], 0.0)


@pytest.mark.parametrize("consumers, block_n, n", [(2, 128, 384), (3, 128, 384), (2, 192, 384), (2, 192, 448)])
@pytest.mark.usefixtures("interpret")
def test_tiles_match_xla(consumers, block_n, n):
    """Two consumers (128-row tiles) and three (192-row tiles: N = 384 is below fp8_config's bound for them) over 3 K
    blocks give the XLA path's product; 123 rows leave the second group's tile partly past its rows. 192-column tiles
    take two weight-scale blocks each: the first tile's boundary lies 128 columns in, the second's 64; at N = 448 the
    last tile holds 64 columns and loads the padded block past the last."""
    m, k, sizes = 200, 3 * 128, [0, 77, 123]
    lhs, rhs, group_sizes = _problem(9, m, k, n, sizes)
    tiles = config.fp8_config(m=m, k=k, n=n, g=len(sizes), out_itemsize=4, consumers=consumers, block_n=block_n)
    assert (tiles.block_m, tiles.block_n, tiles.num_compute_wgs) == (64 * consumers, block_n, consumers)

    def both(lhs, rhs, group_sizes):  # one jitted program, as in _both
        x = moe_jax.quantize_blockwise(lhs, (1, 128))
        w = api.quantize_weights(rhs, transpose_rhs=True)
        out = launch.run_fp8_forward_kernel(x, w, group_sizes, None, None, jnp.float32, keep=False, config=tiles)
        options = dict(transpose_rhs=True, quantization="fp8_block", preferred_element_type=jnp.float32)
        return out, moe_jax.grouped_matmul(x, w, group_sizes, backend="xla", **options)

    out, expected = jax.jit(both)(lhs, rhs, group_sizes)
    assert oracle.relative_error(out, expected) < F32_OUT_TOL


def test_tiles_whose_arrays_overflow_the_registers_say_why():
    """The total and the partial of 128 rows a consumer take 256 registers a thread, more than three consumers'
    152."""
    tiles = dataclasses.replace(config.fp8_config(m=256, k=1024, n=512, g=2, consumers=3), block_m=384)
    lhs, rhs, group_sizes = _args()
    x = moe_jax.quantize_blockwise(lhs, (1, 128))
    w = api.quantize_weights(rhs, transpose_rhs=True)
    with pytest.raises(ValueError, match="the total and the partial take 256 registers"):
        launch.run_fp8_forward_kernel(x, w, group_sizes, None, None, jnp.float32, keep=False, config=tiles)


@pytest.mark.parametrize("activation, packed", [("swiglu", True), ("gpt_oss", False)])
@pytest.mark.usefixtures("interpret")
def test_glu_and_row_scale_epilogue_matches_xla(activation, packed):
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(1, m, k, n, sizes)
    lhs = lhs * 3  # past gpt_oss's clamp
    row_scale = jnp.asarray(np.random.default_rng(2).uniform(size=m), jnp.float32)
    weights = pack_gate_up(rhs, transposed=True) if packed else rhs
    options = dict(activation=activation, row_scale=row_scale, transpose_rhs=True, preferred_element_type=jnp.float32)
    out, expected = _both(lhs, weights, group_sizes, **options)
    assert out.shape == (m, n // 2)
    assert oracle.relative_error(out, expected) < F32_OUT_TOL
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes) :], 0.0)


@pytest.mark.usefixtures("interpret")
def test_block_scaled_operands():
    """Pre-quantized operands (activations and packed gate/up weights) go to the kernel as they are."""
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(3, m, k, n, sizes)
    x = moe_jax.quantize_blockwise(lhs, (1, 128))
    w = api.quantize_weights(pack_gate_up(rhs, transposed=True), transpose_rhs=True)
    out, expected = _both(x, w, group_sizes, activation="swiglu", transpose_rhs=True)
    assert out.dtype == jnp.bfloat16
    assert oracle.relative_error(out, expected) < BF16_OUT_TOL


@pytest.mark.parametrize(
    "activation, case", [(None, "edges"), ("geglu", "edges"), (None, "narrow"), (None, "ragged"), (None, "odd_k")]
)
@pytest.mark.usefixtures("interpret")
def test_gradients_match_xla(activation, case):
    """The kernel path's backward (the epilogue's VJP on the kept pre-activation, the dgrad in the FP8 kernel where K
    is a multiple of 64, in XLA for "odd_k"'s K = 200, the wgrad in the FP8 wgrad kernel where K and N are multiples
    of 64, else in XLA) gives the XLA path's gradients."""
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _problem(4, m, k, n, sizes, dtype=jnp.float32)
    row_scale = jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, size=m), jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(6).normal(size=(m, n // 2 if activation else n)), jnp.float32)

    def vjp(backend):
        def op(lhs, rhs, row_scale):
            return moe_jax.grouped_matmul(
                lhs,
                rhs,
                group_sizes,
                activation=activation,
                row_scale=row_scale,
                transpose_rhs=True,
                quantization="fp8_block",
                backend=backend,
            )

        return jitted_vjp(op, (lhs, rhs, row_scale), cotangent)

    names = ("out", "d_lhs", "d_rhs", "d_row_scale")
    for name, actual, exact in zip(names, vjp("pallas"), vjp("xla"), strict=True):
        assert actual.dtype == exact.dtype, name
        tol = F32_OUT_TOL if name == "out" or activation is None else GLU_GRAD_TOL
        assert oracle.relative_error(actual, exact) < tol, name


def _args(k=256, n=256):
    return _problem(7, 64, k, n, [30, 34])


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(quantization="fp8_block", n=96), "N must be a positive multiple of 64"),
        (dict(quantization="fp8_block", activation="swiglu", unpacked=True), "PackedGateUp"),
    ],
)
def test_calls_the_kernel_cannot_run_say_why(options, match):
    lhs, rhs, group_sizes = _args(n=options.pop("n", 256))
    if options.pop("unpacked", False):
        rhs = api.quantize_weights(rhs, transpose_rhs=True)
    with pytest.raises(NotImplementedError, match=match):
        moe_jax.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=True, backend="pallas", **options)


def test_float64_inputs_whose_output_the_kernel_cannot_write_say_why():
    with jax.enable_x64(True):
        lhs, rhs, group_sizes = _problem(8, 64, 128, 128, [30, 34], dtype=jnp.float64)
        with pytest.raises(NotImplementedError, match="writes float32, bfloat16 or float16, got float64"):
            moe_jax.grouped_matmul(
                lhs, rhs, group_sizes, transpose_rhs=True, quantization="fp8_block", backend="pallas"
            )


def test_auto_takes_the_fp8_kernel_on_sm90_where_it_runs():
    """On an sm90 GPU "auto" runs an fp8_block call on the FP8 kernel where it applies, else in XLA (mxfp8's choice:
    tests/ops/test_grouped_matmul_mxfp8_pallas.py)."""
    lhs, rhs, _ = _args()
    with mock.patch.object(dispatch, "has_sm90_gpu", return_value=True):
        for num_cols, expected in ((256, "pallas"), (96, "xla")):
            call = api._gemm_call(lhs, rhs, 256, num_cols, None, "fp8_block")
            assert dispatch.select("grouped_matmul", "auto", api.IMPLEMENTATIONS, call).name == expected


def kept_blocks_match_the_quantizer(activation: str, consumers: int) -> None:
    """The GLU forward keeping its pre-activation in FP8 blocks (``keep_blocks``: quantized in the epilogue, by
    ``consumers`` warpgroups of 64 rows) against the same kernel keeping it in bf16, then quantized by the 1 x 128
    quantizer: h, the values and the scales equal bit for bit. Groups of 1, 129, 0 and 100 rows and 70 rows past the
    sum (ZERO_TILE tiles: zeros, the smallest scale); gpt_oss's inputs cross its clamps, which its rounding keeps
    values on their side of."""
    x_scale = 4.0 if activation == "gpt_oss" else 1.0
    lhs, rhs, sizes = _problem(7, 300, 256, 256, [1, 129, 0, 100])
    x = moe_jax.quantize_blockwise((x_scale * lhs.astype(jnp.float32)).astype(jnp.bfloat16), (1, 128))
    w = moe_jax.quantize_blockwise(rhs, (1, 128, 128))
    (m, k), (g, n, _) = x.shape, w.shape
    tiles = dict(m=m, k=k, n=n, g=g, glu_forward=True, consumers=consumers)
    with simulated_sms(2), checked_interpreter():
        run = [
            launch.run_fp8_forward_kernel(
                x, w, sizes, None, activation, jnp.bfloat16, keep=True, keep_blocks=blocks,
                config=config.fp8_config(**tiles, keep_blocks=blocks),
            )
            for blocks in (False, True)
        ]  # fmt: skip
    (hidden, kept), (hidden_fused, kept_fused) = run
    expected = moe_jax.quantize_blockwise(kept, (1, 128), backend="xla")
    np.testing.assert_array_equal(np.asarray(hidden_fused).view(np.uint16), np.asarray(hidden).view(np.uint16))
    assert kept_fused.block_shape == (1, 128) and kept_fused.values.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(
        np.asarray(kept_fused.values).view(np.uint8), np.asarray(expected.values).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(kept_fused.scales), np.asarray(expected.scales))


KEPT_BLOCKS_SCRIPT = """
from tests.ops.test_grouped_matmul_fp8_pallas import kept_blocks_match_the_quantizer
for activation, consumers in (("swiglu", 2), ("gpt_oss", 3)):
    print("checking", activation, consumers, flush=True)
    kept_blocks_match_the_quantizer(activation, consumers)
"""


def test_glu_forward_keeps_the_pre_activation_in_fp8_blocks():
    """``kept_blocks_match_the_quantizer`` for swiglu on two consumers and gpt_oss on three (the layers' gate_up
    from 4096 packed columns; the rounding at gpt_oss's clamps is the same code on either), in a process whose
    XLA:CPU, which runs the interpreted kernels, rounds every f32 -> bf16 -> f32 round trip as the GPU does (by
    default it may keep the f32 value: excess precision). One process for both: its start-up and the kernels' shared
    programs once."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false".strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    completed = subprocess.run(
        [sys.executable, "-c", KEPT_BLOCKS_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert completed.returncode == 0, completed.stdout[-200:] + completed.stderr[-4000:]
    assert completed.stdout.split() == ["checking", "swiglu", "2", "checking", "gpt_oss", "3"]
