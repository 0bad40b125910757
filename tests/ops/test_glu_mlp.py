"""The GLU MLP op on CPU (backend "xla"), the gate/up packing, the epilogues' GLU math and the partial-sum gather.

Oracles: the NumPy float64 ``tests.oracle`` for values, ``jax.vjp`` of ``glu.glu`` for
the hand-derived GLU gradient, ``check_grads`` (float64) for the reference op's gradients. Tolerances are stated
where used.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_jax
from moe_jax.ops.glu_mlp import reference as mlp_reference
from moe_jax.ops.grouped_matmul import glu, schedule
from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK, gate_up_block, join_gate_up, split_gate_up
from tests import oracle
from tests.helpers import glu_mlp_inputs, jitted_vjp, pairwise_by_default

F32_TOL = 1e-5  # f32 end to end


def _mlp_problem(seed, m, d, f, sizes, dtype=np.float32, x_scale=1.0):
    inputs = glu_mlp_inputs(np.random.default_rng(seed), m, d, f, len(sizes), x_scale)
    x, w_gate_up, w_down, row_scale = (inputs[name].astype(dtype) for name in ("x", "w_gate_up", "w_down", "row_scale"))
    return x, w_gate_up, w_down, np.asarray(sizes, np.int32), row_scale


# ------------------------------------------------------------------------------------------------------------ packing


def test_packing_interleaves_blocks_of_gate_and_up_columns():
    d_ff = 2 * PACK_BLOCK
    w = jnp.arange(2 * 3 * 2 * d_ff, dtype=jnp.float32).reshape(2, 3, 2 * d_ff)
    packed = moe_jax.pack_gate_up(w)
    assert packed.block == PACK_BLOCK and packed.shape == w.shape and not packed.transposed
    gate, up = w[..., :d_ff], w[..., d_ff:]
    b = PACK_BLOCK
    expected = jnp.concatenate([gate[..., :b], up[..., :b], gate[..., b:], up[..., b:]], axis=-1)
    np.testing.assert_array_equal(packed.array, expected)
    np.testing.assert_array_equal(moe_jax.unpack_gate_up(packed), w)
    # A GEMM output in packed order splits back into the two halves.
    split = split_gate_up(packed.array, packed.block)
    np.testing.assert_array_equal(split[0], gate)
    np.testing.assert_array_equal(split[1], up)
    # ... and join_gate_up puts the halves back in packed order (with the block F, as plain halves).
    np.testing.assert_array_equal(join_gate_up(gate, up, packed.block), packed.array)
    np.testing.assert_array_equal(join_gate_up(gate, up, d_ff), w)


def test_transposed_packing_and_the_identity_block():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4 * PACK_BLOCK, 5)), jnp.float32)  # [G, 2F, K]
    packed = moe_jax.pack_gate_up(w, transposed=True)
    np.testing.assert_array_equal(packed.array, jnp.swapaxes(moe_jax.pack_gate_up(jnp.swapaxes(w, 1, 2)).array, 1, 2))
    np.testing.assert_array_equal(moe_jax.unpack_gate_up(packed), w)
    # F not a multiple of the block: the packed layout is the unpacked one.
    assert gate_up_block(40) == 40
    odd = jnp.ones((1, 3, 80))
    np.testing.assert_array_equal(moe_jax.pack_gate_up(odd).array, odd)


def test_packed_weights_are_a_pytree_whose_gradient_stays_packed():
    x, w_gate_up, _, sizes, _ = _mlp_problem(1, 20, 8, PACK_BLOCK, [12, 8])
    packed = moe_jax.pack_gate_up(jnp.asarray(w_gate_up))

    def loss(weights):
        return jnp.sum(moe_jax.grouped_matmul(jnp.asarray(x), weights, jnp.asarray(sizes), activation="swiglu"))

    grad = jax.jit(jax.grad(loss))
    grad_packed = grad(packed)
    grad_plain = grad(jnp.asarray(w_gate_up))
    assert isinstance(grad_packed, moe_jax.PackedGateUp)
    assert oracle.relative_error(moe_jax.unpack_gate_up(grad_packed), grad_plain) < F32_TOL


@pytest.mark.parametrize("activation", glu.ACTIVATIONS)
def test_reference_reads_packed_weights_without_unpacking(activation):
    x, w_gate_up, _, sizes, row_scale = _mlp_problem(2, 30, 16, PACK_BLOCK, [10, 0, 17], x_scale=4.0)
    packed = moe_jax.pack_gate_up(jnp.asarray(w_gate_up))
    op = jax.jit(functools.partial(moe_jax.grouped_matmul, activation=activation, backend="xla"))
    out = op(jnp.asarray(x), packed, jnp.asarray(sizes), row_scale=jnp.asarray(row_scale))
    expected = oracle.grouped_matmul(x, w_gate_up, sizes, activation=activation, row_scale=row_scale)
    assert oracle.relative_error(out, expected) < F32_TOL


def test_packed_weights_need_an_activation_and_their_own_layout():
    packed = moe_jax.pack_gate_up(jnp.ones((2, 8, 128)))
    lhs, sizes = jnp.ones((4, 8)), jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="PackedGateUp"):
        moe_jax.grouped_matmul(lhs, packed, sizes)
    with pytest.raises(ValueError, match="transpose_rhs must match"):
        moe_jax.grouped_matmul(lhs, packed, sizes, activation="swiglu", transpose_rhs=True)
    with pytest.raises(ValueError, match="w_gate_up"):
        moe_jax.pack_gate_up(jnp.ones((2, 8, 127)))


# ----------------------------------------------------------------------------------------------- the epilogues' math


@pytest.mark.parametrize("activation", glu.ACTIVATIONS)
def test_glu_and_its_hand_derived_gradient(activation):
    rng = np.random.default_rng(3)
    gate, up, d_h = (jnp.asarray(rng.normal(scale=5.0, size=(64, 32)), jnp.float32) for _ in range(3))
    # Hit the clamp bounds exactly too: there the derivative is 1/2, as jax.numpy's min/max give it.
    gate, up = gate.at[0, :4].set(7.0), up.at[1, :4].set(jnp.array([7.0, -7.0, 7.0, -7.0]))
    h, d_gate, d_up = jax.jit(functools.partial(glu.glu_grad, activation=activation))(gate, up, d_h)
    forward = functools.partial(glu.glu, activation=activation)
    expected_h, expected_d_gate, expected_d_up = jitted_vjp(forward, (gate, up), d_h)
    assert oracle.relative_error(jax.jit(forward)(gate, up), expected_h) < F32_TOL
    assert oracle.relative_error(h, expected_h) < F32_TOL
    assert oracle.relative_error(d_gate, expected_d_gate) < F32_TOL
    assert oracle.relative_error(d_up, expected_d_up) < F32_TOL
    assert oracle.relative_error(h, oracle.gated_activation(gate, up, activation)) < F32_TOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kept_pre_activation_never_rounds_across_a_clamp_bound(dtype):
    rng = np.random.default_rng(4)
    near = np.concatenate([7.0 + rng.uniform(-0.05, 0.05, 4000), -7.0 + rng.uniform(-0.05, 0.05, 4000), [7.0, -7.0]])
    values = jnp.asarray(near.reshape(-1, 2), jnp.float32)
    gate, up = values[:, 0], values[:, 1]
    for activation in glu.ACTIVATIONS:
        kept_gate, kept_up = glu.kept_pre_activation(gate, up, activation, dtype)
        for x, kept in ((gate, kept_gate), (up, kept_up)):
            np.testing.assert_array_equal(kept, kept.astype(dtype).astype(jnp.float32))  # representable
            step = 4 * float(jnp.finfo(dtype).eps)  # the spacing around 7
            assert float(jnp.max(jnp.abs(kept - x))) <= step
        if activation == "gpt_oss":  # gate is clamped from above, up on both sides
            for x, kept, bound in ((gate, kept_gate, 7.0), (up, kept_up, 7.0), (up, kept_up, -7.0)):
                np.testing.assert_array_equal(jnp.sign(kept - bound), jnp.sign(x - bound))


# ------------------------------------------------------------------------------------------- glu_mlp, backend "xla"


@pytest.mark.parametrize("activation", glu.ACTIVATIONS)
@pytest.mark.parametrize("with_row_scale", [False, True])
def test_glu_mlp_matches_the_oracle(activation, with_row_scale):
    x, w_gate_up, w_down, sizes, row_scale = _mlp_problem(5, 40, 16, 12, [0, 15, 3, 14], x_scale=4.0)
    row_scale = row_scale if with_row_scale else None
    y = jax.jit(functools.partial(moe_jax.glu_mlp, activation=activation, backend="xla"))(
        *map(jnp.asarray, (x, w_gate_up, w_down, sizes)),
        row_scale=None if row_scale is None else jnp.asarray(row_scale),
    )
    hidden = oracle.grouped_matmul(x, w_gate_up, sizes, activation=activation)
    expected = oracle.grouped_matmul(hidden, w_down, sizes, row_scale=row_scale)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert oracle.relative_error(y, expected) < F32_TOL
    np.testing.assert_array_equal(np.asarray(y)[sizes.sum() :], 0.0)


@pytest.mark.parametrize("activation", glu.ACTIVATIONS)
def test_glu_mlp_reference_gradients(activation):
    x, w_gate_up, w_down, sizes, row_scale = _mlp_problem(6, 11, 5, 3, [4, 0, 5], np.float64, x_scale=3.0)

    def f(x, w_gate_up, w_down, row_scale):
        return mlp_reference.glu_mlp(
            x, w_gate_up, w_down, jnp.asarray(sizes), activation=activation, row_scale=row_scale
        )

    with jax.enable_x64(True):
        args = tuple(map(jnp.asarray, (x, w_gate_up, w_down, row_scale)))
        check_grads(jax.jit(f), args, order=1, modes=("rev",))  # jitted: op by op, each operation would compile


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(activation="relu"), ValueError, "activation"),
        (dict(w_down=jnp.ones((3, 9, 16), jnp.bfloat16)), ValueError, "w_down"),
        (dict(row_scale=jnp.ones((7,))), ValueError, "row_scale"),
        (dict(w_gate_up=moe_jax.pack_gate_up(jnp.ones((3, 16, 16)), transposed=True)), ValueError, "transposed"),
        (dict(backend="pallas"), NotImplementedError, "glu_mlp: D must be a positive multiple of 64"),
        (dict(x=jnp.ones((6, 16))), TypeError, "x and w_gate_up must have the same dtype"),
        (dict(w_down=jnp.ones((3, 8, 16))), TypeError, r"x \(the hidden activations' dtype\) and w_down must have"),
        (dict(x=jnp.ones((6, 15), jnp.bfloat16)), ValueError, r"w_gate_up must have shape \[G, D, 2F\] with D=15"),
    ],
)
def test_glu_mlp_rejects_bad_arguments(overrides, error, match):
    args = dict(
        x=jnp.ones((6, 16), jnp.bfloat16),
        w_gate_up=jnp.ones((3, 16, 16), jnp.bfloat16),
        w_down=jnp.ones((3, 8, 16), jnp.bfloat16),
        group_sizes=jnp.array([2, 2, 2], jnp.int32),
        activation="swiglu",
    )
    with pytest.raises(error, match=match):
        moe_jax.glu_mlp(**(args | overrides))


# --------------------------------------------------------------------------------- dense_glu_mlp: one group, all rows

BF16_DENSE_TOL = 2e-2  # bf16 operands, the pre-activation and hidden rows rounded to bf16 (a few bf16 epsilons)


@pytest.mark.parametrize(
    "packed, dtype, tol, activation",
    pairwise_by_default([False, True], [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_DENSE_TOL)], glu.ACTIVATIONS),
)
def test_dense_glu_mlp_matches_the_oracle_and_its_gradients(activation, dtype, tol, packed):
    """Values and gradients against float64 NumPy (the gradients through ``oracle.moe_ffn_gradients`` as a layer of one
    expert that every token picks with weight 1, as the module test of the shared experts does)."""
    t, d, f = 24, 16, 2 * PACK_BLOCK  # two packed blocks of gate and up columns each
    x, w_gate_up, w_down, _, _ = _mlp_problem(7, t, d, f, [t], x_scale=2.0)
    weights = jnp.asarray(w_gate_up, dtype)
    w_gate_up_arg = moe_jax.pack_gate_up(weights) if packed else weights
    args = (jnp.asarray(x, dtype), w_gate_up_arg, jnp.asarray(w_down, dtype))
    exact = [np.asarray(a, np.float64) for a in (args[0], weights, args[2])]
    cotangent = np.random.default_rng(8).normal(size=(t, d))
    layer = functools.partial(moe_jax.dense_glu_mlp, activation=activation, backend="pallas")
    y, d_x, d_w_gate_up, d_w_down = jitted_vjp(layer, args, jnp.asarray(cotangent, dtype))
    hidden = oracle.grouped_matmul(exact[0], exact[1], [t], activation=activation)
    assert y.shape == (t, d) and y.dtype == dtype
    assert oracle.relative_error(y, oracle.grouped_matmul(hidden, exact[2], [t])) < tol

    one_expert_router = np.zeros((d, 1))
    expected = oracle.moe_ffn_gradients(
        exact[0], one_expert_router, *exact[1:], cotangent, top_k=1, activation=activation, load_balancing_weight=0.0
    )
    if packed:
        d_w_gate_up = moe_jax.unpack_gate_up(d_w_gate_up)
    for actual, name in ((d_x, "x"), (d_w_gate_up, "w_gate_up"), (d_w_down, "w_down")):
        assert oracle.relative_error(actual, expected[name]) < tol, name


def test_dense_glu_mlp_quantized_is_the_one_group_glu_mlp():
    """With a quantization the one-group FP8 glu_mlp runs (here its XLA recipe), activation passed on: equal to it
    bit for bit, and within the FP8 recipe's error (8e-2, four quantized operands) of the unquantized MLP."""
    t, d, f = 40, 128, 128
    x, w_gate_up, w_down, _, _ = _mlp_problem(9, t, d, f, [t])
    args = (jnp.asarray(x), moe_jax.pack_gate_up(jnp.asarray(w_gate_up)), jnp.asarray(w_down))
    options = dict(activation="geglu", backend="xla", quantization="fp8_block")
    y = jax.jit(functools.partial(moe_jax.dense_glu_mlp, **options))(*args)
    np.testing.assert_array_equal(
        y, jax.jit(functools.partial(moe_jax.glu_mlp, **options))(*args, jnp.array([t], jnp.int32))
    )
    hidden = oracle.grouped_matmul(x, w_gate_up, [t], activation="geglu")
    assert oracle.relative_error(y, oracle.grouped_matmul(hidden, w_down, [t])) < 8e-2


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(w_gate_up=jnp.ones((2, 16, 16), jnp.bfloat16)), r"w_gate_up must hold one group, \[1, D, 2F\]"),
        (dict(w_down=jnp.ones((2, 8, 16), jnp.bfloat16)), r"w_down must hold one group, \[1, F, D\]"),
        (dict(w_down=jnp.ones((8, 16), jnp.bfloat16)), r"w_down must have shape \[1, F, D\] \(rank 3\)"),
        (dict(activation="relu"), "activation"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_dense_glu_mlp_rejects_bad_arguments(overrides, match):
    args = dict(
        x=jnp.ones((6, 16), jnp.bfloat16),
        w_gate_up=jnp.ones((1, 16, 16), jnp.bfloat16),
        w_down=jnp.ones((1, 8, 16), jnp.bfloat16),
        activation="swiglu",
    )
    with pytest.raises(ValueError, match=match):
        moe_jax.dense_glu_mlp(**(args | overrides))


# ------------------------------------------------------------------------------------------- the partial-sum gather


@pytest.mark.parametrize("block_m", [64, 128])
def test_row_sums_gathered_from_tile_partials(block_m):
    rng = np.random.default_rng(7)
    num_rows, sizes = 400, np.array([0, 130, 3, 0, 97, 64, 1], np.int32)  # 105 rows past the sum
    # Jitted: op by op, each call would compile one small program per operation and shape.
    tiles, count = jax.jit(schedule.row_tiles, static_argnums=(1, 2))(jnp.asarray(sizes), num_rows, block_m)
    col_tiles, capacity = 3, tiles.shape[1]
    values = rng.normal(size=(col_tiles, num_rows))  # what each column tile contributes to each row
    partials = np.full((col_tiles, capacity, block_m), np.nan)  # entries no tile stores stay NaN
    for t, (_, box, skip, rows, *_) in enumerate(np.asarray(tiles).T[: int(count[0])]):
        partials[:, t, skip : skip + rows] = values[:, box + skip : box + skip + rows]
    sums = jax.jit(schedule.gather_row_partials, static_argnums=3)(jnp.asarray(partials), tiles, count, num_rows)
    np.testing.assert_allclose(sums, values.sum(0), rtol=1e-5, atol=1e-5)
