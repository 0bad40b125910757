"""The FP8 GLU MLP's kernels (``glu_mlp(quantization="fp8_block", backend="pallas")``) under the checking Mosaic GPU
interpreter: the down projection's dgrad with the GLU backward in its epilogue on FP8 operands, against ``jax.vjp``
of the reference GLU; the whole MLP, forward and gradients, against the XLA implementation of the same recipe
(``moe_jax.ops.glu_mlp.reference.quantized_glu_mlp``), on sorted rows and routed from tokens (each token quantized
once, its FP8 row permuted); and the kernels' refusal of f32 x.

The interpreter multiplies e4m3 values exactly in f32, so the GLU backward differs from its oracle by the bf16
rounding of its outputs and of the kept pre-activation: ``GRAD_TOL`` as for the bf16 kernel. The MLP's two paths
quantize the same operands the same way and differ where an f32 sum is rounded to bf16 (the hidden activations, the
kept pre-activation, d_gate_up); a rare such flip at an e4m3 rounding boundary moves one element or a block's scale
by a whole e4m3 step (2^-4 relative) when the operand is quantized again: ``MLP_TOL`` covers a few of those in the
relative norm. The gradients get ``MLP_GRAD_TOL``: the gate_up kernel quantizes the kept pre-activation from its
bf16 rounding in registers, a round trip XLA:CPU, which runs the interpreted kernel, may leave out (excess
precision), so here the kernel quantizes f32 values where the XLA path quantizes bf16 ones, and more elements flip
(2.6e-2 measured; tests/gpu has the GPU's rounding equal the quantizer's, bit for bit). ``MIN_QUANTIZATION_ERROR``
against the unquantized MLP shows the kernels quantized.

Cases (M, D, F, group sizes): "ragged": D = 320 (the GLU backward's contraction ends in a 64-wide block), F = 192 (a
half-empty last column tile), an empty group, sizes off 8; "edges": one-row and 129-row groups across 128-row tiles,
70 rows past the sum; "small" (the stored copies' test, whose point is not the ragged edges): a one-row and a
63-row group, 8 rows past the sum, one 128-wide block of D and of F.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax._core import backend as dispatch
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul import launch, reference
from moe_jax.ops.grouped_matmul.api import master_weights, quantize_weights
from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK, split_gate_up
from moe_jax.ops.quant import api as quant_api
from tests import oracle
from tests.helpers import check_glu_backward, checked_interpreter, cuda_lowering, glu_mlp_inputs, simulated_sms

GRAD_TOL = 1e-2
MLP_TOL = 2e-2
MLP_GRAD_TOL = 3e-2
MIN_QUANTIZATION_ERROR = 5e-3
CASES = {
    "ragged": (203, 320, 192, [0, 120, 83]),
    "edges": (300, 256, 128, [1, 129, 0, 100]),
    "small": (72, 128, 128, [1, 63]),
}


@pytest.fixture
def interpret():
    """Runs the test's kernels under the checking interpreter on 2 simulated SMs; fails it on a detected race."""
    with simulated_sms(2), checked_interpreter():
        yield


def _inputs(case: str, seed: int) -> dict:
    m, d, f, sizes = CASES[case]
    rng = np.random.default_rng(seed)
    inputs = glu_mlp_inputs(rng, m, d, f, len(sizes))
    inputs["cotangent"] = rng.normal(size=(m, d))
    dtypes = dict(row_scale=jnp.float32)
    inputs = {name: jnp.asarray(value, dtypes.get(name, jnp.bfloat16)) for name, value in inputs.items()}
    return inputs | dict(group_sizes=jnp.asarray(sizes, jnp.int32))


@pytest.mark.parametrize(
    "activation, case, with_row_scale, fp8_pre",
    [
        ("swiglu", "ragged", True, False),
        ("swiglu", "ragged", True, True),
        ("gpt_oss", "edges", True, True),
        ("geglu", "edges", False, False),
    ],
)
@pytest.mark.usefixtures("interpret")
def test_fp8_glu_backward_epilogue(activation, case, with_row_scale, fp8_pre):
    """fp8_pre: the pre-activation arrives quantized (1 x 128 of its packed columns) and the epilogue dequantizes it;
    the oracle then runs on the dequantized values."""
    inputs = _inputs(case, seed=3)
    group_sizes, d_y = inputs["group_sizes"], inputs["cotangent"]
    row_scale = inputs["row_scale"] if with_row_scale else None
    m, d_ff = d_y.shape[0], inputs["w_down"].shape[1]
    # The bf16 rounding of gate and up outside the jitted program below, whose XLA may skip it (excess precision).
    gate_up = 5.0 * jax.random.normal(jax.random.key(1), (m, 2 * d_ff), jnp.float32)
    gate, up = (half.astype(jnp.bfloat16).astype(jnp.float32) for half in jnp.split(gate_up, 2, axis=1))

    def run(d_y, w_down, gate, up, row_scale):
        """(the kernel's outputs, gate, up, d_h) as one jitted program: op by op, the quantizations and the reference
        would compile one small program per operation and shape."""
        d_y_fp8 = moe_jax.quantize_blockwise(d_y, (1, 128))
        w_down_fp8 = quantize_weights(w_down)  # [G, F, D] in 128 x 128 blocks: K-major for this GEMM
        packed_rows = moe_jax.pack_gate_up(jnp.concatenate([gate, up], axis=1)[None]).array[0].astype(jnp.bfloat16)
        out_dtype = None
        if fp8_pre:
            packed_rows = moe_jax.quantize_blockwise(packed_rows, (1, 128))
            gate, up = split_gate_up(packed_rows.dequantize(), PACK_BLOCK)
            out_dtype = jnp.bfloat16
        outputs = launch.run_glu_dgrad(
            d_y_fp8, w_down_fp8, group_sizes, packed_rows, row_scale, activation, out_dtype=out_dtype
        )
        d_h = reference.grouped_matmul(
            d_y_fp8.dequantize(),
            w_down_fp8.dequantize(),
            group_sizes,
            transpose_rhs=True,
            preferred_element_type=jnp.float32,
        )
        return outputs, gate, up, d_h

    (d_gate_up, hidden, d_row_scale), gate, up, d_h = jax.jit(run)(d_y, inputs["w_down"], gate, up, row_scale)
    assert d_gate_up.dtype == hidden.dtype == jnp.bfloat16
    routed_rows = int(np.sum(CASES[case][3]))
    outputs = (d_gate_up, hidden, d_row_scale)
    check_glu_backward(
        outputs, gate, up, d_h, row_scale, activation, routed_rows, hidden_tol=GRAD_TOL, grad_tol=GRAD_TOL
    )


# gpt_oss's FP8 GLU backward is checked by test_fp8_glu_backward_epilogue and the MLP's composition by the swiglu
# case: the pair is `slow`.
@pytest.mark.parametrize(
    "activation, case", [("swiglu", "ragged"), pytest.param("gpt_oss", "edges", marks=pytest.mark.slow)]
)
def test_fp8_glu_mlp_matches_the_xla_recipe(activation, case):
    inputs = _inputs(case, seed=4)
    names = ("x", "w_gate_up", "w_down", "row_scale")

    def run(backend, quantization="fp8_block"):
        def loss(x, w_gate_up, w_down, row_scale):
            y = moe_jax.glu_mlp(
                x,
                w_gate_up,
                w_down,
                inputs["group_sizes"],
                activation=activation,
                row_scale=row_scale,
                backend=backend,
                quantization=quantization,
            )
            return jnp.sum(y.astype(jnp.float32) * inputs["cotangent"].astype(jnp.float32)), y

        grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
        return jax.jit(grad)(*(inputs[name] for name in names))

    with simulated_sms(2), checked_interpreter():
        kernel_grads, kernel_y = run("pallas")
    xla_grads, xla_y = run("xla")
    assert oracle.relative_error(kernel_y, xla_y) < MLP_TOL
    assert oracle.relative_error(kernel_y, run("xla", None)[1]) > MIN_QUANTIZATION_ERROR
    past = int(np.sum(CASES[case][3]))
    np.testing.assert_array_equal(np.asarray(kernel_y, np.float32)[past:], 0.0)
    for name, actual, expected in zip(names, kernel_grads, xla_grads, strict=True):
        assert oracle.relative_error(actual, expected) < MLP_GRAD_TOL, name


def test_quantized_master_weights_are_read_as_they_are_and_give_their_masters_gradients(monkeypatch):
    """Weights quantized once (``quantize_master``) give the kernels' output and gradients on the master weights
    bit for bit, and the call quantizes no weight (the kernels read the copies)."""
    inputs = _inputs("small", seed=7)
    group_sizes, cotangent = inputs["group_sizes"], inputs["cotangent"].astype(jnp.float32)
    masters = (moe_jax.pack_gate_up(inputs["w_gate_up"]), inputs["w_down"])
    copies = tuple(moe_jax.quantize_master(w) for w in masters)

    def run(w_gate_up, w_down):
        def loss(x, w_gate_up, w_down):
            options = dict(row_scale=inputs["row_scale"], backend="pallas", quantization="fp8_block")
            y = moe_jax.glu_mlp(x, w_gate_up, w_down, group_sizes, **options)
            return jnp.sum(y.astype(jnp.float32) * cotangent), y

        (d_x, *d_weights), y = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(inputs["x"], w_gate_up, w_down)
        return y, d_x, *(master_weights(d) for d in d_weights)

    with simulated_sms(2), checked_interpreter():
        expected = run(*masters)

        def quantized_again(*args, **kwargs):
            raise AssertionError("a weight was quantized again")

        monkeypatch.setattr(quant_api, "quantize_square_blocks", quantized_again)
        got = run(*copies)
    for actual, wanted in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(actual, wanted)


# The default case drops rows (every path of the others, plus the rows past the sum); the one without drops and the
# gathered MLP with its rows summed after it pair paths that the default case covers one by one: `slow`.
@pytest.mark.parametrize(
    "gathered_combine, dropped",
    [
        ("inside", True),
        pytest.param("inside", False, marks=pytest.mark.slow),
        pytest.param("after", False, marks=pytest.mark.slow),
    ],
)
def test_fp8_routed_glu_mlp_matches_the_xla_recipe(gathered_combine, dropped):
    """Tokens quantized once each, their FP8 rows gathered by the gate_up kernel ("pallas_gather") or permuted with
    their scales into expert order first ("pallas_sorted"; T = 67, k = 3, one empty expert, ``Routing.positions``
    moves the rows), against the XLA path, which permutes x first and quantizes the rows: the same values. Each
    token's rows are summed (``combine``): on the kernel paths inside the kernels' VJP, whose backward quantizes
    each token's dy once, gathers its FP8 rows in the GLU-backward kernel (gathered) or permutes them (sorted), and
    gathers them in the down wgrad's quantizer (or, with ``gathered_combine`` "after", by ``permute.combine`` after
    the gathered MLP, which then gets the rows' dy); on the XLA path after the MLP. With ``dropped`` the last 7
    sorted rows fall past the sum (as a capacity drop does; ``zero_tail=False``, what moe_ffn runs then): the
    kernels write them as zeros, which the sum inside their VJP reads, and the XLA path's sum leaves them out. The
    kernel paths quantize the same values the same way, so they agree bit for bit."""
    rng = np.random.default_rng(5)
    num_tokens, top_k, d, d_ff = 67, 3, 256, 128
    inputs = glu_mlp_inputs(rng, num_tokens * top_k, d, d_ff, 4)
    x = jnp.asarray(rng.normal(size=(num_tokens, d)), jnp.bfloat16)
    routing = moe_jax.route(jnp.asarray(rng.normal(size=(num_tokens, 4)) - [0, 0, 0, 1e9], jnp.float32), top_k)
    cotangent = jnp.asarray(rng.normal(size=(num_tokens, d)), jnp.float32)
    weights = tuple(jnp.asarray(inputs[name], jnp.bfloat16) for name in ("w_gate_up", "w_down"))
    row_scale = jnp.asarray(inputs["row_scale"], jnp.float32)
    # Expert 3 is empty, so cutting expert 2's group leaves its last rows at the end of the sorted order.
    group_sizes = routing.group_sizes - jnp.asarray([0, 0, 7 if dropped else 0, 0], jnp.int32)

    def run(backend, combine_after=False):
        def loss(x, w_gate_up, w_down, row_scale):
            options = dict(row_scale=row_scale, positions=routing.positions, backend=backend, zero_tail=not dropped)
            args = (x, routing.sort_indices, top_k, w_gate_up, w_down, group_sizes)
            if combine_after:
                rows = glu_mlp_api.routed_glu_mlp(*args, **options, quantization="fp8_block")
                y = moe_jax.combine(rows, routing.sort_indices, top_k, positions=routing.positions, backend="xla")
            else:
                y = glu_mlp_api.routed_glu_mlp(*args, **options, quantization="fp8_block", combine="xla")
            return jnp.sum(y.astype(jnp.float32) * cotangent), y

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *weights, row_scale)

    with simulated_sms(2), checked_interpreter():
        gathered = run("pallas_gather", combine_after=gathered_combine == "after")
        kernel_grads, kernel_y = run("pallas_sorted")
    xla_grads, xla_y = run("xla")
    assert int(routing.group_sizes[3]) == 0 and kernel_y.shape == (num_tokens, d)
    assert oracle.relative_error(kernel_y, xla_y) < MLP_TOL
    for name, actual, expected in zip(("x", "w_gate_up", "w_down", "row_scale"), kernel_grads, xla_grads, strict=True):
        assert oracle.relative_error(actual, expected) < MLP_GRAD_TOL, name
    for actual, expected in zip(jax.tree.leaves(gathered), jax.tree.leaves((kernel_grads, kernel_y)), strict=True):
        np.testing.assert_array_equal(actual, expected)


def test_kernels_refuse_f32_x_and_auto_takes_the_xla_recipe(monkeypatch):
    """The FP8 GLU backward keeps its [64, 256] pre-activation tiles in x's dtype in shared memory: f32 ones leave the
    pipeline no room, so backend="pallas" refuses f32 x by name, and "auto" on an H200 (lowered from this host, as if
    it had one) runs the XLA recipe for f32 x and the FP8 kernels for bf16 x."""
    inputs = _inputs("edges", seed=6)
    names = ("x", "w_gate_up", "w_down")
    f32_args = [inputs[name].astype(jnp.float32) for name in names] + [inputs["group_sizes"]]
    with pytest.raises(NotImplementedError, match="pre-activation in x's dtype, which must be bfloat16 or float16"):
        moe_jax.glu_mlp(*f32_args, backend="pallas", quantization="fp8_block")

    def auto(*args):
        return moe_jax.glu_mlp(*args, backend="auto", quantization="fp8_block")

    monkeypatch.setattr(dispatch, "has_sm90_gpu", lambda: True)
    bf16_args = [inputs[name] for name in names] + [inputs["group_sizes"]]
    assert "moe_gmm_fp8" in cuda_lowering(auto, *bf16_args)
    assert "moe_gmm" not in cuda_lowering(auto, *f32_args)
