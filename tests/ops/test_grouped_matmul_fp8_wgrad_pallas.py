"""The FP8 wgrad kernel (sm90_fp8_wgrad.py, through ``launch.run_fp8_wgrad_kernel`` and the quantized op's
gradient) under the checking Mosaic GPU interpreter against ``reference_fp8.quantized_wgrad``, the recipe's wgrad in
XLA, on the same quantization.

The interpreter multiplies the e4m3 values exactly in f32, so the kernel's sum per 128-row block times both scales
and the reference's product of the dequantized operands differ by f32 rounding only: ``F32_OUT_TOL`` on f32 outputs,
``BF16_OUT_TOL`` where they are rounded to bf16 (a rare flip of one bf16 unit, 2^-8 relative, in the relative norm).
Races are detected and uninitialised memory is NaN, so a scale read before its copy landed, a block of another group
or an output tile the kernel forgot shows up.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.ops.grouped_matmul import launch, reference_fp8
from tests import oracle
from tests.helpers import checked_interpreter, jitted_vjp, simulated_sms

F32_OUT_TOL = 1e-5
BF16_OUT_TOL = 2e-3
RECIPE = reference_fp8.RECIPES["fp8_block"]

# (M, P, Q, group sizes, SMs); the kernel's tiles are [192, 128], 64 rows a consumer. "edges": empty, one row, one
# short of / exactly / one past a 128-row block, 35 rows past the sum, P = 128 (a row tile whose third consumer stores
# nothing), Q = 192 (a last column tile of 64). "hot": one group takes every row, P = 256 (a last row tile whose
# second and third consumers store nothing), sizes past M. "wraps": nine blocks on one SM, more steps than the ring
# has slots, so the producer refills slots whose scales the consumers read (a missing fence before their release
# races).
CASES = {
    "edges": (420, 128, 192, [0, 1, 127, 128, 129], None),
    "hot": (300, 256, 128, [0, 300, 0, 40], None),
    "wraps": (1100, 128, 128, [1100, 0], 1),
}


@pytest.fixture
def interpret():
    """Runs the test's kernels under the checking interpreter and fails it on any detected race."""
    with checked_interpreter():
        yield


def _kernel(x, y, group_sizes, out_dtype, **row_tokens):
    """The kernel as one jitted program (op by op, the glue around it would compile per operation)."""
    return jax.jit(functools.partial(launch.run_fp8_wgrad_kernel, out_dtype=out_dtype))(x, y, group_sizes, **row_tokens)


def _recipes_wgrad(x, group_sizes, y, transpose_rhs, out_dtype):
    """``reference_fp8.quantized_wgrad`` as one jitted program."""
    wgrad = functools.partial(
        reference_fp8.quantized_wgrad, recipe=RECIPE, transpose_rhs=transpose_rhs, out_dtype=out_dtype
    )
    return jax.jit(wgrad)(x, group_sizes, y)


def _operands(seed, m, p, q, dtype):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(m, p)), dtype), jnp.asarray(rng.normal(size=(m, q)), dtype)


@pytest.mark.parametrize(
    "case, in_dtype, out_dtype, tol",
    [
        ("edges", jnp.float32, jnp.float32, F32_OUT_TOL),
        ("hot", jnp.bfloat16, jnp.bfloat16, BF16_OUT_TOL),
        ("wraps", jnp.bfloat16, jnp.bfloat16, BF16_OUT_TOL),
    ],
)
@pytest.mark.usefixtures("interpret")
def test_kernel_matches_the_recipes_wgrad(case, in_dtype, out_dtype, tol):
    m, p, q, sizes, num_sms = CASES[case]
    x, y = _operands(0, m, p, q, in_dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    with simulated_sms(num_sms) if num_sms else contextlib.nullcontext():
        out = _kernel(x, y, group_sizes, out_dtype)
    expected = _recipes_wgrad(x, group_sizes, y, False, out_dtype)
    assert out.shape == (len(sizes), p, q) and out.dtype == out_dtype
    assert oracle.relative_error(out, expected) < tol
    empty = [g for g, size in enumerate(sizes) if size == 0 or sum(sizes[:g]) >= m]
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)


@pytest.mark.parametrize("gathered", ["x", "y"])
@pytest.mark.usefixtures("interpret")
def test_gathered_rows_give_the_wgrad_of_the_gathered_copy(gathered):
    """x_row_tokens / y_row_tokens: one operand's rows gathered from 150 tokens by its quantizer equal the wgrad of
    the copy tokens[row_tokens] bit for bit (the same FP8 operands), and the recipe's wgrad of that copy within
    ``BF16_OUT_TOL``."""
    m, p, q, sizes, _ = CASES["edges"]
    x, y = _operands(3, m, p, q, jnp.bfloat16)
    tokens = _operands(2, 150, p, q, jnp.bfloat16)[0 if gathered == "x" else 1]
    row_tokens = jnp.asarray(np.random.default_rng(4).integers(0, 150, size=m), jnp.int32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    copy = dict(x=x, y=y) | {gathered: tokens[row_tokens]}
    operands = dict(x=x, y=y) | {gathered: tokens}
    out = _kernel(operands["x"], operands["y"], group_sizes, jnp.bfloat16, **{f"{gathered}_row_tokens": row_tokens})
    copy_out = _kernel(copy["x"], copy["y"], group_sizes, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(copy_out, np.float32))
    expected = _recipes_wgrad(copy["x"], group_sizes, copy["y"], False, jnp.bfloat16)
    assert oracle.relative_error(out, expected) < BF16_OUT_TOL


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.usefixtures("interpret")
def test_op_gradient_runs_the_kernel_in_either_weight_layout(transpose_rhs):
    """d rhs of ``grouped_matmul(quantization="fp8_block", backend="pallas")``, [G, K, N] or [G, N, K], is the
    recipe's wgrad (the XLA path's d rhs), for f32 weights."""
    m, k, n, sizes = 300, 128, 192, [129, 0, 1, 127]
    lhs, d_out = _operands(1, m, k, n, jnp.float32)
    shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
    rhs = jnp.asarray(np.random.default_rng(2).normal(size=shape) / np.sqrt(k), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def op(rhs):
        return moe_jax.grouped_matmul(
            lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, quantization="fp8_block", backend="pallas"
        )

    _, d_rhs = jitted_vjp(op, (rhs,), d_out)
    expected = _recipes_wgrad(lhs, group_sizes, d_out, transpose_rhs, jnp.float32)
    assert d_rhs.shape == rhs.shape and d_rhs.dtype == jnp.float32
    assert oracle.relative_error(d_rhs, expected) < F32_OUT_TOL


@pytest.mark.parametrize(
    "args, match",
    [
        (("mxfp8", 128, 128, jnp.float32), "runs quantization='fp8_block'"),
        (("fp8_block", 128, 96, jnp.float32), "N must be a positive multiple of 64"),
        (("fp8_block", 128, 128, jnp.float64), "writes float32, bfloat16 or float16"),
    ],
)
def test_calls_the_wgrad_kernel_cannot_run_say_why(args, match):
    assert match in launch.fp8_wgrad_unsupported(*args)
    assert launch.fp8_wgrad_unsupported("fp8_block", 128, 192, jnp.bfloat16) is None
