"""``grouped_matmul(quantization=...)`` on the XLA path against float64 NumPy oracles.

The oracles take the operands quantized by the public quantizer (``quantize_blockwise``, tested on its own) with the
block shapes each recipe names, dequantize them in float64 and multiply group by group with loops; the weight
gradient's operands are quantized group by group, on each group's own rows (its blocks start at the group's first
row). Against them, with f32 inputs and outputs, only the f32 accumulation differs: ``EXACT_TOL``.

Against the unquantized float64 product the error is the quantization's: e4m3 keeps 3 fraction bits, a value's
relative error is up to 2^-4 (about 2^-5.5 RMS over a block's spread), and a product of two quantized operands
errs by about sqrt(2) times that: 3.7-3.8% measured on these normal data, ``UNQUANTIZED_TOL``. Through a GLU the
gate and the up product both err (5.3-5.5% measured), and the gradients quantize the cotangent too (3.6-3.8% without
a GLU, 5.3-5.6% through swiglu): ``UNQUANTIZED_GLU_TOL`` and ``UNQUANTIZED_GRAD_TOL``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.ops.grouped_matmul import api, reference
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, pack_gate_up, stored_array, unpack_gate_up
from tests import oracle
from tests.helpers import grouped_matmul_inputs, jitted_vjp, pairwise_by_default

EXACT_TOL = 1e-5
UNQUANTIZED_TOL = 5e-2
UNQUANTIZED_GLU_TOL = 8e-2
UNQUANTIZED_GRAD_TOL = 8e-2

# Per recipe: (block along every contraction, the forward weights' block along N, power-of-two scales).
RECIPES = {"fp8_block": (128, 128, False), "mxfp8": (32, 1, True)}
QUANTIZATIONS = list(RECIPES)

# (M, K, N, group sizes). "edges": empty, one row, one short of, exactly and one past a 128-row block, 35 rows past
# the sum; "hot": one group takes every row; "small": K and N of one 128-block, M off 8.
CASES = {
    "edges": (420, 256, 256, [0, 1, 127, 128, 129]),
    "hot": (200, 128, 256, [0, 200, 0]),
    "small": (77, 128, 128, [40, 0, 30]),
}


# The op and the weight quantizer, each call one jitted program with the options static: op by op, every operation of
# the glue and of the quantizer would compile on its own.
_grouped_matmul = jax.jit(
    moe_jax.grouped_matmul,
    static_argnames=("activation", "preferred_element_type", "transpose_rhs", "quantization", "backend"),
)
_quantize_weights = jax.jit(api.quantize_weights, static_argnames=("quantization", "transpose_rhs"))


def _problem(seed, m, k, n, sizes, *, transpose_rhs=False, dtype=jnp.float32):
    lhs, rhs = grouped_matmul_inputs(np.random.default_rng(seed), m, k, n, len(sizes), transpose_rhs)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes, jnp.int32)


def _dequantized(quantized) -> np.ndarray:
    """A BlockScaled's values times its scales, each scale repeated over its block, in float64."""
    scales = np.asarray(quantized.scales.astype(jnp.float32), np.float64)
    for axis, (block, size) in enumerate(zip(quantized.block_shape, quantized.shape, strict=True)):
        scales = np.take(np.repeat(scales, block, axis=axis), np.arange(size), axis=axis)
    return np.asarray(quantized.values.astype(jnp.float32), np.float64) * scales


def _quantize(x, block_shape, quantization):
    pow2_scales = RECIPES[quantization][2]
    quantize = functools.partial(moe_jax.quantize_blockwise, pow2_scales=pow2_scales, backend="xla")
    return jax.jit(quantize, static_argnums=1)(x, block_shape)


def _forward_weights(rhs, quantization, transpose_rhs):
    """The oracle's dequantized forward weights [G, K, N] (or [G, N, K])."""
    block, cols, _ = RECIPES[quantization]
    return _dequantized(_quantize(rhs, (1, cols, block) if transpose_rhs else (1, block, cols), quantization))


def _group_slices(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [slice(int(start), int(start + size)) for start, size in zip(starts, sizes, strict=True)]


def _per_group_rows(x, sizes, quantization) -> np.ndarray:
    """x [M, C] quantized group by group in blocks of rows starting at each group's first row (the wgrad's
    operands), float64; zeros past the sum."""
    block, _, _ = RECIPES[quantization]
    out = np.zeros(x.shape)
    for rows in _group_slices(sizes):
        if rows.stop > rows.start:
            out[rows] = _dequantized(_quantize(x[rows].T, (1, block), quantization)).T
    return out


# ---------------------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "transpose_rhs, case, quantization", pairwise_by_default([False, True], list(CASES), QUANTIZATIONS)
)
def test_forward_matches_float64_product_of_the_quantized_operands(quantization, case, transpose_rhs):
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _problem(0, m, k, n, sizes, transpose_rhs=transpose_rhs)
    out = _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, quantization=quantization, backend="xla")
    block = RECIPES[quantization][0]
    expected = oracle.grouped_matmul(
        _dequantized(_quantize(lhs, (1, block), quantization)),
        _forward_weights(rhs, quantization, transpose_rhs),
        sizes,
        transpose_rhs=transpose_rhs,
    )
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert oracle.relative_error(out, expected) < EXACT_TOL
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes) :], 0.0)


@pytest.mark.parametrize(
    "packed, activation, quantization", pairwise_by_default([False, True], ["swiglu", "gpt_oss"], QUANTIZATIONS)
)
def test_glu_and_row_scale_quantize_the_packed_weights(quantization, activation, packed):
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(1, m, k, n, sizes)
    lhs = lhs * 3.0  # past gpt_oss's clamp
    row_scale = jnp.asarray(np.random.default_rng(2).uniform(size=m), jnp.float32)
    weights = pack_gate_up(rhs) if packed else rhs
    out = _grouped_matmul(
        lhs, weights, group_sizes, activation=activation, row_scale=row_scale, quantization=quantization
    )
    # Quantized in the packed layout (64 gate and 64 up columns per 128-column block), multiplied as [gate | up].
    packed_rhs = pack_gate_up(rhs)
    block, cols, _ = RECIPES[quantization]
    dequantized_packed = _dequantized(_quantize(packed_rhs.array, (1, block, cols), quantization))
    unpacked = np.asarray(unpack_gate_up(PackedGateUp(jnp.asarray(dequantized_packed), packed_rhs.block)))
    expected = oracle.grouped_matmul(
        _dequantized(_quantize(lhs, (1, block), quantization)),
        unpacked,
        sizes,
        activation=activation,
        row_scale=np.asarray(row_scale),
    )
    assert out.shape == (m, n // 2)
    assert oracle.relative_error(out, expected) < EXACT_TOL
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes) :], 0.0)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("activation", [None, "geglu"])
def test_close_to_the_unquantized_product(quantization, activation):
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(3, m, k, n, sizes, dtype=jnp.bfloat16)
    out = _grouped_matmul(lhs, rhs, group_sizes, activation=activation, quantization=quantization)
    assert out.dtype == jnp.bfloat16
    expected = oracle.grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, activation=activation)
    tol = UNQUANTIZED_TOL if activation is None else UNQUANTIZED_GLU_TOL
    assert oracle.relative_error(out, expected) < tol


# -------------------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "transpose_rhs, case, quantization", pairwise_by_default([False, True], ["edges", "hot"], QUANTIZATIONS)
)
def test_gradients_are_the_recipes_quantized_gemms(quantization, case, transpose_rhs):
    """d lhs = dy (blocks along N) . w^T, d rhs = x_g^T . dy_g (blocks of rows from each group's start)."""
    m, k, n, sizes = CASES[case]
    lhs, rhs, group_sizes = _problem(4, m, k, n, sizes, transpose_rhs=transpose_rhs)
    cotangent = jnp.asarray(np.random.default_rng(5).normal(size=(m, n)), jnp.float32)

    def op(lhs, rhs):
        return moe_jax.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, quantization=quantization)

    _, d_lhs, d_rhs = jitted_vjp(op, (lhs, rhs), cotangent)

    block, _, _ = RECIPES[quantization]
    dy = _dequantized(_quantize(cotangent, (1, block), quantization))
    if quantization == "fp8_block":
        w = _forward_weights(rhs, quantization, transpose_rhs)  # the forward's blocks, reused
    else:
        w = _dequantized(_quantize(rhs, (1, block, 1) if transpose_rhs else (1, 1, block), quantization))
    w_kn = w.transpose(0, 2, 1) if transpose_rhs else w
    x_rows = _per_group_rows(np.asarray(lhs, np.float64), sizes, quantization)
    dy_rows = _per_group_rows(np.asarray(cotangent, np.float64), sizes, quantization)
    expected_d_lhs = np.zeros((m, k))
    expected_d_w = np.zeros((len(sizes), k, n))
    for g, rows in enumerate(_group_slices(sizes)):
        expected_d_lhs[rows] = dy[rows] @ w_kn[g].T
        expected_d_w[g] = x_rows[rows].T @ dy_rows[rows]
    expected_d_rhs = expected_d_w.transpose(0, 2, 1) if transpose_rhs else expected_d_w
    assert d_lhs.dtype == lhs.dtype and d_rhs.dtype == rhs.dtype
    assert oracle.relative_error(d_lhs, expected_d_lhs) < EXACT_TOL
    assert oracle.relative_error(d_rhs, expected_d_rhs) < EXACT_TOL
    np.testing.assert_array_equal(np.asarray(d_lhs)[sum(sizes) :], 0.0)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_gradients_close_to_the_unquantized_ones(quantization, activation):
    """Straight through the quantization: the gradients of lhs, rhs and row_scale stay near the float64 gradients
    of the unquantized op."""
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(6, m, k, n, sizes)
    row_scale = jnp.asarray(np.random.default_rng(7).uniform(0.5, 1.5, size=m), jnp.float32)
    cols = n // 2 if activation else n
    cotangent = jnp.asarray(np.random.default_rng(8).normal(size=(m, cols)), jnp.float32)

    def quantized(lhs, rhs, row_scale):
        return moe_jax.grouped_matmul(
            lhs, rhs, group_sizes, activation=activation, row_scale=row_scale, quantization=quantization
        )

    def exact(lhs, rhs, row_scale):
        return reference.grouped_matmul(lhs, rhs, group_sizes, activation=activation, row_scale=row_scale)

    _, *grads = jitted_vjp(quantized, (lhs, rhs, row_scale), cotangent)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(a), jnp.float64) for a in (lhs, rhs, row_scale, cotangent)]
        _, *expected = jitted_vjp(exact, args[:3], args[3])
    for name, actual, exact_grad in zip(("d_lhs", "d_rhs", "d_row_scale"), grads, expected, strict=True):
        assert oracle.relative_error(actual, exact_grad) < UNQUANTIZED_GRAD_TOL, name


# ------------------------------------------------------------------------------------------- pre-quantized operands


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_block_scaled_operands_are_taken_as_they_are(quantization, transpose_rhs):
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(9, m, k, n, sizes, transpose_rhs=transpose_rhs, dtype=jnp.bfloat16)
    options = dict(transpose_rhs=transpose_rhs, quantization=quantization)
    block = RECIPES[quantization][0]
    lhs_q = _quantize(lhs, (1, block), quantization)
    rhs_q = _quantize_weights(rhs, quantization, transpose_rhs=transpose_rhs)
    expected = _grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, **options)
    both = _grouped_matmul(lhs_q, rhs_q, group_sizes, **options)
    assert both.dtype == jnp.bfloat16  # no high-precision input to take the dtype from
    np.testing.assert_array_equal(both, expected.astype(jnp.bfloat16))
    for operands in ((lhs_q, rhs), (lhs, rhs_q)):
        out = _grouped_matmul(*operands, group_sizes, preferred_element_type=jnp.float32, **options)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_packed_weights_serve_the_glu(quantization):
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(10, m, k, n, sizes)
    options = dict(activation="swiglu", quantization=quantization)
    quantized = _quantize_weights(pack_gate_up(rhs), quantization)
    assert isinstance(quantized, PackedGateUp) and isinstance(quantized.array, moe_jax.BlockScaled)
    out = _grouped_matmul(lhs, quantized, group_sizes, **options)
    np.testing.assert_array_equal(out, _grouped_matmul(lhs, rhs, group_sizes, **options))
    both = _grouped_matmul(
        _quantize(lhs, (1, RECIPES[quantization][0]), quantization), quantized, group_sizes, **options
    )
    assert both.dtype == jnp.bfloat16
    np.testing.assert_array_equal(both, out.astype(jnp.bfloat16))


def test_fp8_block_weights_pre_quantized_give_the_same_input_gradient():
    """fp8_block's dgrad reuses the forward's quantized weights, so quantizing them beforehand changes nothing."""
    m, k, n, sizes = CASES["hot"]
    lhs, rhs, group_sizes = _problem(11, m, k, n, sizes)
    cotangent = jnp.asarray(np.random.default_rng(12).normal(size=(m, n)), jnp.float32)

    def d_lhs(weights):
        def op(lhs):
            return moe_jax.grouped_matmul(lhs, weights, group_sizes, quantization="fp8_block")

        return jitted_vjp(op, (lhs,), cotangent)[1]

    np.testing.assert_array_equal(d_lhs(_quantize_weights(rhs)), d_lhs(rhs))


def _values_and_gradients(weights, lhs, group_sizes, cotangent, **options):
    """(out, d lhs, d rhs) of the fp8_block op on ``weights``; a QuantizedMaster's d rhs is its master's gradient."""

    def op(lhs, weights):
        return moe_jax.grouped_matmul(lhs, weights, group_sizes, quantization="fp8_block", **options)

    out, d_lhs, d_weights = jitted_vjp(op, (lhs, weights), cotangent)
    d_rhs = api.master_weights(d_weights)
    return out, d_lhs, d_rhs.array if isinstance(d_rhs, PackedGateUp) else d_rhs


@pytest.mark.parametrize("transpose_rhs, activation", [(False, None), (True, None), (False, "swiglu")])
def test_quantized_master_gives_the_values_and_gradients_of_its_master(transpose_rhs, activation):
    """Weights quantized once (``quantize_master``) give the op's output and gradients on the master weights exactly:
    the same copies, and the weight gradient reaches the master straight through them."""
    m, k, n, sizes = CASES["edges"]
    lhs, rhs, group_sizes = _problem(21, m, k, n, sizes, transpose_rhs=transpose_rhs)
    if activation is not None:
        rhs = pack_gate_up(rhs, transposed=transpose_rhs)
    cols = n // 2 if activation else n
    cotangent = jnp.asarray(np.random.default_rng(22).normal(size=(m, cols)), jnp.float32)
    options = dict(activation=activation, transpose_rhs=transpose_rhs)
    master = jax.jit(api.quantize_master, static_argnames="transpose_rhs")(rhs, transpose_rhs=transpose_rhs)
    expected = _values_and_gradients(rhs, lhs, group_sizes, cotangent, **options)
    got = _values_and_gradients(master, lhs, group_sizes, cotangent, **options)
    assert isinstance(stored_array(master), moe_jax.QuantizedMaster)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------------------- errors


def _args():
    lhs, rhs, group_sizes = _problem(13, 64, 128, 128, [30, 34])
    return lhs, rhs, group_sizes


def test_unknown_quantization_is_rejected():
    with pytest.raises(ValueError, match="quantization"):
        moe_jax.grouped_matmul(*_args(), quantization="fp8")


def test_block_scaled_operand_needs_a_quantization():
    lhs, rhs, group_sizes = _args()
    with pytest.raises(TypeError, match="lhs is a BlockScaled"):
        moe_jax.grouped_matmul(moe_jax.quantize_blockwise(lhs, (1, 128)), rhs, group_sizes)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda lhs, rhs: (moe_jax.quantize_blockwise(lhs, (1, 32)), rhs), ValueError, "lhs is a BlockScaled of"),
        (lambda lhs, rhs: (lhs, moe_jax.quantize_blockwise(rhs, (1, 128, 1))), ValueError, r"takes \(1, 128, 128\)"),
        (
            lambda lhs, rhs: (moe_jax.quantize_blockwise(lhs, (1, 128), pow2_scales=True), rhs),
            TypeError,
            "lhs.scales must be float32",
        ),
        (lambda lhs, rhs: (lhs.astype(jnp.float8_e4m3fn), rhs), TypeError, "lhs must have dtype"),
        (lambda lhs, rhs: (lhs.astype(jnp.bfloat16), rhs), TypeError, "same dtype"),
    ],
)
def test_bad_operands_for_fp8_block(make, error, match):
    lhs, rhs, group_sizes = _args()
    with pytest.raises(error, match=match):
        moe_jax.grouped_matmul(*make(lhs, rhs), group_sizes, quantization="fp8_block")


def test_block_scaled_with_inconsistent_scales_is_rejected():
    lhs, rhs, group_sizes = _args()
    quantized = moe_jax.quantize_blockwise(lhs, (1, 128))
    broken = moe_jax.BlockScaled(quantized.values, quantized.scales[:32], (1, 128))
    with pytest.raises(ValueError, match=r"lhs.scales must have shape \(64, 1\)"):
        moe_jax.grouped_matmul(broken, rhs, group_sizes, quantization="fp8_block")


def test_quantize_weights_checks_its_arguments():
    _, rhs, _ = _args()
    with pytest.raises(ValueError, match="quantization"):
        api.quantize_weights(rhs, "int8")
    with pytest.raises(ValueError, match="rank 3"):
        api.quantize_weights(rhs[0])


def test_mxfp8_weight_blocks_lie_along_k():
    """An MXFP8 rhs has one e8m0 scale per 32 elements of K and per column."""
    _, rhs, _ = _args()
    quantized = _quantize_weights(rhs, "mxfp8")
    assert quantized.block_shape == (1, 32, 1)
    assert quantized.scales.shape == (2, 4, 128) and quantized.scales.dtype == jnp.float8_e8m0fnu
    assert _quantize_weights(rhs, "mxfp8", transpose_rhs=True).block_shape == (1, 1, 32)


@pytest.mark.parametrize(
    "make, options, match",
    [
        (lambda rhs: api.quantize_master(rhs), dict(), "pass quantization='fp8_block', got None"),
        (lambda rhs: api.quantize_master(rhs), dict(quantization="mxfp8"), "got 'mxfp8'"),
        (
            lambda rhs: api.quantize_master(rhs),
            dict(quantization="fp8_block", transpose_rhs=True),
            "made with transpose_rhs=False",
        ),
        (
            lambda rhs: api.quantize_master(rhs),
            dict(quantization="fp8_block", activation="swiglu"),
            "unpacked .gate . up. weights",
        ),
    ],
)
def test_quantized_master_outside_its_recipe_and_layout_is_rejected(make, options, match):
    lhs, rhs, group_sizes = _args()
    with pytest.raises(ValueError, match=match):
        moe_jax.grouped_matmul(lhs, make(rhs), group_sizes, **options)


def test_quantize_master_checks_its_arguments():
    _, rhs, _ = _args()
    with pytest.raises(ValueError, match="rank 3"):
        api.quantize_master(rhs[0])
    with pytest.raises(TypeError, match="rhs must have dtype"):
        api.quantize_master(rhs.astype(jnp.int32))
