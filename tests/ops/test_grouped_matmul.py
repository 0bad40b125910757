"""Reference grouped matmul (backend "xla") against the NumPy float64 oracle, including ragged edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import moe_jax
from moe_jax.ops.grouped_matmul import reference
from tests import oracle
from tests.helpers import grouped_matmul_inputs

F32_TOL = 1e-5  # relative-norm error of f32 inputs with f32 accumulation
BF16_TOL = 1e-2  # bf16 inputs and output, f32 accumulation

KINDS = ["uniform", "empty", "hot", "tail"]


def _problem(seed, num_rows, contraction, num_cols, num_groups, kind, dtype=np.float32):
    rng = np.random.default_rng(seed)
    lhs, rhs = grouped_matmul_inputs(rng, num_rows, contraction, num_cols, num_groups)
    group_sizes = oracle.random_group_sizes(rng, num_groups, num_rows, kind)
    return lhs.astype(dtype), rhs.astype(dtype), group_sizes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows, num_groups", [(37, 5), (64, 1), (20, 8)])
def test_matches_oracle_on_ragged_groups(kind, num_rows, num_groups):
    lhs, rhs, group_sizes = _problem(0, num_rows, 24, 16, num_groups, kind)
    out = moe_jax.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes), backend="xla")
    expected = oracle.grouped_matmul(lhs, rhs, group_sizes)
    assert out.shape == (num_rows, 16) and out.dtype == jnp.float32
    assert oracle.relative_error(out, expected) < F32_TOL
    past_the_sum = int(group_sizes.sum())
    np.testing.assert_array_equal(np.asarray(out)[past_the_sum:], 0.0)


def test_negative_group_sizes_count_as_zero():
    lhs, rhs, _ = _problem(1, 40, 24, 16, 3, "uniform")
    out = moe_jax.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.array([-8, 30, 5], jnp.int32), backend="xla")
    expected = oracle.grouped_matmul(lhs, rhs, np.array([0, 30, 5]))
    assert oracle.relative_error(out, expected) < F32_TOL
    np.testing.assert_array_equal(np.asarray(out)[35:], 0.0)


def test_rows_past_m_are_dropped():
    lhs, rhs, _ = _problem(3, 40, 24, 16, 3, "uniform")
    out = moe_jax.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.array([10, 25, 30], jnp.int32), backend="xla")
    expected = oracle.grouped_matmul(lhs, rhs, np.array([10, 25, 5]))  # group 2 keeps the 5 rows left of M = 40
    assert oracle.relative_error(out, expected) < F32_TOL


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gpt_oss"])
@pytest.mark.parametrize("with_row_scale", [False, True])
def test_gated_activations_and_row_scale(activation, with_row_scale):
    lhs, rhs, group_sizes = _problem(1, 40, 16, 24, 4, "tail")
    lhs *= 4.0  # push gpt_oss's gate and up beyond its +-7 clamp
    row_scale = np.random.default_rng(2).uniform(size=40).astype(np.float32) if with_row_scale else None
    out = moe_jax.grouped_matmul(
        jnp.asarray(lhs),
        jnp.asarray(rhs),
        jnp.asarray(group_sizes),
        activation=activation,
        row_scale=None if row_scale is None else jnp.asarray(row_scale),
    )
    expected = oracle.grouped_matmul(lhs, rhs, group_sizes, activation=activation, row_scale=row_scale)
    assert out.shape == (40, 12)
    assert oracle.relative_error(out, expected) < F32_TOL
    if activation == "gpt_oss":
        gate_up = oracle.grouped_matmul(lhs, rhs, group_sizes)
        assert np.abs(gate_up).max() > 7.0, "the clamp was not exercised"


def test_k_major_rhs_and_bf16():
    lhs, rhs, group_sizes = _problem(3, 48, 32, 16, 3, "uniform")
    k_major = np.ascontiguousarray(rhs.transpose(0, 2, 1))
    bf16 = jnp.bfloat16
    out = moe_jax.grouped_matmul(
        jnp.asarray(lhs, bf16), jnp.asarray(k_major, bf16), jnp.asarray(group_sizes), transpose_rhs=True
    )
    assert out.dtype == bf16
    assert oracle.relative_error(out, oracle.grouped_matmul(lhs, rhs, group_sizes)) < BF16_TOL
    out_f32 = moe_jax.grouped_matmul(
        jnp.asarray(lhs, bf16), jnp.asarray(rhs, bf16), jnp.asarray(group_sizes), preferred_element_type=jnp.float32
    )
    assert out_f32.shape == (48, 16) and out_f32.dtype == jnp.float32
    # bf16 inputs with f32 accumulation and an f32 output: against the oracle on the same bf16-rounded inputs, only the
    # summation order differs (the bf16 products are exact in f32), hence the f32 tolerance.
    rounded = [np.asarray(jnp.asarray(a, bf16), np.float64) for a in (lhs, rhs)]
    assert oracle.relative_error(out_f32, oracle.grouped_matmul(*rounded, group_sizes)) < F32_TOL


@pytest.mark.parametrize("activation", [None, "swiglu", "geglu", "gpt_oss"])
def test_gradients(activation):
    lhs, rhs, group_sizes = _problem(4, 13, 6, 8, 3, "tail", np.float64)
    row_scale = np.random.default_rng(5).uniform(size=13)

    def f(lhs, rhs, row_scale):
        return reference.grouped_matmul(lhs, rhs, jnp.asarray(group_sizes), activation=activation, row_scale=row_scale)

    with jax.enable_x64(True):  # jitted: op by op, each operation would compile a program of its own
        check_grads(jax.jit(f), (jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(row_scale)), order=1, modes=("rev",))
