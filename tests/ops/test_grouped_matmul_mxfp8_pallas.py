"""The "mxfp8" recipe on the bf16 kernels (``launch.BF16_KERNEL_GEMMS``: ``grouped_matmul``, ``glu_mlp`` and
``routed_glu_mlp`` with ``backend="pallas"``) under the checking Mosaic GPU interpreter, against the XLA
implementation of the same recipe.

Both multiply the same dequantized operands, which bf16 holds exactly, with f32 accumulation: they differ by the
order of the f32 sums only, ``F32_TOL`` on f32 outputs and on gradients that start from them. Through a GLU the
gradients start from pre-activations that differ by f32 rounding, and the cotangent's own quantization turns a rare
such difference at an e4m3 rounding boundary into a whole e4m3 step of an element or a block's scale:
``GLU_GRAD_TOL``, as for the FP8 kernel (tests/ops/test_grouped_matmul_fp8_pallas.py).
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax._core import backend as dispatch
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul import api, reference_fp8
from tests import oracle
from tests.helpers import checked_interpreter, grouped_matmul_inputs, jitted_vjp, moe_layer_inputs, simulated_sms

F32_TOL = 1e-5
GLU_GRAD_TOL = 1e-3
# Groups of 0, 1, 127 and 129 rows, and 35 rows past the sum.
M, K, N, SIZES = 292, 128, 256, [0, 1, 127, 129]


@pytest.fixture
def interpret():
    """Runs the test's kernels under the checking interpreter on 2 simulated SMs; fails it on any detected race."""
    with simulated_sms(2), checked_interpreter():
        yield


def test_mxfp8_dequantized_values_are_bf16_numbers():
    """The premise of the bf16 path: mxfp8's dequantized operands survive a round trip through bf16 unchanged (rows
    over 22 decades of magnitudes), fp8_block's (f32 scales) do not."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 256)) * np.logspace(-10, 12, 64)[:, None], jnp.float32)
    for quantization, exact in (("mxfp8", True), ("fp8_block", False)):
        recipe = reference_fp8.RECIPES[quantization]
        values = reference_fp8.quantize(x, recipe.lhs_block, recipe).dequantize()
        assert recipe.exact_in_bf16 == exact
        assert bool(jnp.all(values.astype(jnp.bfloat16).astype(jnp.float32) == values)) == exact, quantization


@pytest.mark.parametrize("activation, transpose_rhs", [(None, False), ("swiglu", True)])
@pytest.mark.usefixtures("interpret")
def test_grouped_matmul_and_its_gradients_match_xla(activation, transpose_rhs):
    """Forward, d lhs, d rhs and d row_scale against the XLA path, in both weight layouts; the rows past the sum of
    the output and of d lhs are zeros."""
    lhs, rhs = grouped_matmul_inputs(np.random.default_rng(1), M, K, N, len(SIZES), transpose_rhs)
    lhs, rhs = jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32)
    group_sizes = jnp.asarray(SIZES, jnp.int32)
    row_scale = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, size=M), jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(3).normal(size=(M, N // 2 if activation else N)), jnp.float32)

    def vjp(backend):
        def op(lhs, rhs, row_scale):
            options = dict(activation=activation, row_scale=row_scale, transpose_rhs=transpose_rhs)
            options.update(quantization="mxfp8", backend=backend)
            return moe_jax.grouped_matmul(lhs, rhs, group_sizes, **options)

        return jitted_vjp(op, (lhs, rhs, row_scale), cotangent)

    names = ("out", "d_lhs", "d_rhs", "d_row_scale")
    kernel_results = vjp("pallas")
    for name, actual, expected in zip(names, kernel_results, vjp("xla"), strict=True):
        assert actual.dtype == expected.dtype == jnp.float32, name
        tol = F32_TOL if name == "out" or activation is None else GLU_GRAD_TOL
        assert oracle.relative_error(actual, expected) < tol, name
    for name, result in zip(("out", "d_lhs"), kernel_results, strict=False):
        assert float(jnp.abs(result[sum(SIZES) :]).max()) == 0.0, name


@pytest.mark.usefixtures("interpret")
def test_routed_glu_mlp_and_its_gradients_match_xla():
    """The routed MLP (tokens permuted, the bf16 kernels' three GEMMs per projection, each token's rows combined) and
    its gradients to x, both weights and the routing weights, against the XLA implementation: the wiring (permute,
    combine, the custom VJP), whose mistakes cost O(1). Every output passes through a GLU or the quantized h, so
    ``GLU_GRAD_TOL``; the products themselves are held to ``F32_TOL`` by the grouped-matmul test above."""
    rng = np.random.default_rng(4)
    num_tokens, top_k, d_model, d_ff, num_experts = 96, 2, 128, 64, 4
    inputs = moe_layer_inputs(rng, num_tokens, d_model, d_ff, num_experts)
    x, w_gate_up, w_down = (jnp.asarray(inputs[name], jnp.float32) for name in ("x", "w_gate_up", "w_down"))
    experts = rng.integers(0, num_experts, size=num_tokens * top_k)
    experts[:top_k] = num_experts - 1  # expert 0 may get no row; the last one gets some
    sort_indices = jnp.asarray(np.argsort(experts, kind="stable"), jnp.int32)
    group_sizes = jnp.asarray(np.bincount(experts, minlength=num_experts), jnp.int32)
    row_scale = jnp.asarray(rng.uniform(0.2, 1.0, size=num_tokens * top_k), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(num_tokens, d_model)), jnp.float32)

    def vjp(backend):
        def op(x, w_gate_up, w_down, row_scale):
            options = dict(row_scale=row_scale, quantization="mxfp8", backend=backend, combine="xla")
            return glu_mlp_api.routed_glu_mlp(x, sort_indices, top_k, w_gate_up, w_down, group_sizes, **options)

        return jitted_vjp(op, (x, w_gate_up, w_down, row_scale), cotangent)

    names = ("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale")
    for name, actual, expected in zip(names, vjp("pallas"), vjp("xla"), strict=True):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert oracle.relative_error(actual, expected) < GLU_GRAD_TOL, name


def test_auto_takes_the_bf16_kernels_for_mxfp8_on_sm90_where_they_run():
    """On an sm90 GPU "auto" runs mxfp8 on the bf16 kernels where K and N are multiples of 64 (also a GLU MLP with f32
    x, which the FP8 kernels' pre-activation tiles would not take), else in XLA; routed, the rows are permuted first
    ("pallas_sorted": the gathering gate_up kernel is the FP8 one)."""
    lhs = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16)
    with mock.patch.object(dispatch, "has_sm90_gpu", return_value=True):
        for num_cols, expected in ((256, "pallas"), (96, "xla")):
            call = api._gemm_call(lhs, rhs, 256, num_cols, None, "mxfp8")
            assert dispatch.select("grouped_matmul", "auto", api.IMPLEMENTATIONS, call).name == expected
        weights = glu_mlp_api.abstract_weights(jnp.zeros((4, 256, 256)), jnp.zeros((4, 128, 256)))
        call = glu_mlp_api.MlpCall(jnp.dtype(jnp.float32), 256, 128, "swiglu", "mxfp8", weights)
        assert glu_mlp_api.select_routed("auto", call) == "pallas_sorted"


def test_mxfp8_the_bf16_kernels_cannot_run_says_why():
    lhs, rhs = grouped_matmul_inputs(np.random.default_rng(5), 64, 128, 96, 2)
    with pytest.raises(NotImplementedError, match="N must be a positive multiple of 64"):
        moe_jax.grouped_matmul(
            jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16), jnp.asarray([30, 34], jnp.int32),
            quantization="mxfp8", backend="pallas",
        )  # fmt: skip
