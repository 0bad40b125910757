"""The fused GLU kernels under the Mosaic GPU interpreter (races detected, memory NaN-poisoned) against the reference.

``glu_mlp(backend="pallas")`` runs six kernels per forward + backward: gate_up with the GLU epilogue (keeping the
packed pre-activation), down with the row-scale epilogue, the down projection's dgrad with the GLU backward in its
epilogue (d gate/up, h * row_scale, row-scale partial sums), two wgrads and the gate_up dgrad. Each case below crosses
other ragged edges: empty groups, sizes off 8, rows past the sum, one hot expert, M off 8 (padded), G = 1; F = 64
leaves the backward's 128-column tile half empty, F = 128 gives it two packed gate/up blocks; gpt_oss runs with
pre-activations far beyond its +-7 clamp.

The interpreter's time grows with the simulated SMs (``hardware.num_sms`` reads an abstract device's core count): the
cases with a row scale run on 2 (more than one CTA sharing the persistent tile loop, half the time of the default 4),
those without on 1.

Tolerances (relative-norm error against the f32-accumulating reference on the same bf16 inputs): Y_TOL for the MLP's
output, where both sides round the same f32 values to bf16 at the same points (measured 0-1e-7; the margin is for
the odd rounding flip of h); OUT_TOL for the GLU backward's bf16 h; GRAD_TOL for gradients (the cotangent and the kept
pre-activation are rounded to bf16).
"""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.glu_mlp import reference as mlp_reference
from moe_jax.ops.grouped_matmul import launch, reference
from moe_jax.ops.grouped_matmul.config import GLU_DGRAD_LONG_D_TILES, GLU_DGRAD_TILES, Config, get_config
from tests import oracle
from tests.helpers import (
    check_glu_backward,
    checked_interpreter,
    expert_weights,
    glu_mlp_inputs,
    jitted_vjp,
    simulated_sms,
)

Y_TOL = 1e-3
OUT_TOL = 5e-3
GRAD_TOL = 1e-2

# (M, D, F, group sizes, x scale)
CASES = {
    "ragged": (136, 64, 128, [0, 61, 3, 0, 40], 1.0),  # empty groups, sizes off 8, 32 rows past the sum
    "hot expert": (128, 64, 64, [0, 128, 0], 1.0),  # one group takes every row
    "beyond the clamp": (150, 64, 64, [70, 65], 5.0),  # M off 8 (padded)
    "single group": (72, 64, 64, [69], 1.0),  # G = 1, 3 rows past the sum
}


@pytest.fixture
def interpret(request):
    """Runs the test's kernels under the checking interpreter on ``num_sms`` (parameter, default 2) simulated SMs and
    fails it on any detected race."""
    num_sms = request.node.callspec.params.get("num_sms", 2) if hasattr(request.node, "callspec") else 2
    with simulated_sms(num_sms), checked_interpreter():
        yield


def _inputs(case):
    m, d, f, sizes, x_scale = CASES[case]
    rng = np.random.default_rng(len(case))
    inputs = glu_mlp_inputs(rng, m, d, f, len(sizes), x_scale)
    inputs["cotangent"] = rng.normal(size=(m, d))
    dtypes = dict(row_scale=jnp.float32)
    inputs = {name: jnp.asarray(value, dtypes.get(name, jnp.bfloat16)) for name, value in inputs.items()}
    return inputs | dict(group_sizes=jnp.asarray(sizes, jnp.int32))


def _overlapped_get_config(*args, **kwargs) -> Config:
    """config.get_config with the overlapped epilogue switched on (the small shapes here get heuristic configs)."""
    return dataclasses.replace(get_config(*args, **kwargs), overlap_epilogue=True)


# zero_tail=False: the rows past the sum are left unwritten (compared before it only), every backward kernel skips
# them, and the gradients must not see what is there.
# overlap: every kernel of the MLP with the overlapped epilogue (all six keep their outputs in registers at these
# tile shapes): the GLU forward's kept pre-activation, the row-scale forward, the GLU backward's three outputs and
# its partial sums accumulated over the column chunks of a tile that is stored during the next one.
# Every pair of values in this table runs by default: the first row's pairs all appear in the others (`slow`).
@pytest.mark.parametrize(
    "activation, case, with_row_scale, recompute, num_sms, overlap, zero_tail",
    [
        pytest.param("swiglu", "ragged", True, False, 2, False, True, marks=pytest.mark.slow),
        ("geglu", "hot expert", True, True, 2, False, True),
        ("gpt_oss", "beyond the clamp", True, False, 2, False, True),
        ("swiglu", "single group", False, True, 1, False, True),
        ("swiglu", "ragged", True, False, 2, True, True),
        ("gpt_oss", "beyond the clamp", True, False, 2, True, True),
        ("geglu", "ragged", True, True, 2, False, False),
    ],
)
@pytest.mark.usefixtures("interpret")
def test_glu_mlp_forward_and_gradients_match_reference(
    activation, case, with_row_scale, recompute, num_sms, overlap, zero_tail
):
    if overlap:
        with mock.patch.object(launch, "get_config", _overlapped_get_config):
            _check_glu_mlp(activation, case, with_row_scale, recompute, zero_tail)
    else:
        _check_glu_mlp(activation, case, with_row_scale, recompute, zero_tail)


def _check_glu_mlp(activation, case, with_row_scale, recompute, zero_tail):
    inputs = _inputs(case)
    x, w_gate_up, w_down, group_sizes = (inputs[k] for k in ("x", "w_gate_up", "w_down", "group_sizes"))
    row_scale = inputs["row_scale"] if with_row_scale else None
    packed = moe_jax.pack_gate_up(w_gate_up)

    def vjp(fn, w_gate_up):
        primals = (x, w_gate_up, w_down, row_scale)
        return jitted_vjp(lambda a, b, c, s: fn(a, b, c, group_sizes, s), primals, inputs["cotangent"])

    kernel = vjp(
        lambda *a: glu_mlp_api._glu_mlp(*a[:4], activation, a[4], zero_tail, "pallas", recompute_gate_up=recompute),
        packed,
    )
    expected = vjp(lambda *a: mlp_reference.glu_mlp(*a[:4], activation=activation, row_scale=a[4]), w_gate_up)
    past = int(np.sum(CASES[case][3]))
    kernel = (kernel[0] if zero_tail else kernel[0][:past], kernel[1], moe_jax.unpack_gate_up(kernel[2]), *kernel[3:])
    expected = (expected[0] if zero_tail else expected[0][:past], *expected[1:])
    names = ("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale")
    for name, actual, exact in zip(names, kernel, expected, strict=True):
        if exact is None:
            assert actual is None, name
            continue
        assert actual.shape == exact.shape and actual.dtype == exact.dtype, name
        assert oracle.relative_error(actual, exact) < (Y_TOL if name == "y" else GRAD_TOL), name
    # x's rows past the sum get zero gradients either way; y's are zeros only when written.
    zero_rows = {"y": kernel[0], "d_x": kernel[1]} if zero_tail else {"d_x": kernel[1]}
    for name, value in zero_rows.items():
        np.testing.assert_array_equal(np.asarray(value, np.float32)[past:], 0.0, err_msg=name)
    if with_row_scale:
        np.testing.assert_array_equal(np.asarray(kernel[4])[past:], 0.0)
    if case == "beyond the clamp":
        gate_up = reference.grouped_matmul(x, w_gate_up, group_sizes, preferred_element_type=jnp.float32)
        assert float(jnp.mean(jnp.abs(gate_up) > 7.0)) > 0.1, "the clamp was not exercised"


# routed_glu_mlp gathers the gate_up kernel's rows from the tokens (no permuted copy): its output and gradients must
# be the permute-then-MLP reference's. T = 40 tokens with k = 3 distinct experts each over G = 4 (expert 2 never
# chosen); with "dropped", the last group is cut by 7 rows (as a capacity drop does), which must come out as zeros and
# send no gradient to their tokens. "pallas_sorted" takes the permute-then-glu_mlp path that wide layers get.
# zero_tail=False (what moe_ffn runs): the dropped rows are left unwritten, compared before the sum only. `slow`: the
# gather with no row dropped (test_grouped_matmul_pallas.py gathers all M rows, test_moe_ffn_pallas.py runs the
# dropless layer) and the permuted path with zero_tail (the fused path runs both zero_tail settings).
@pytest.mark.parametrize(
    "activation, dropped, fuse_gather, zero_tail",
    [
        pytest.param("swiglu", False, True, True, marks=pytest.mark.slow),
        ("gpt_oss", True, True, True),
        pytest.param("swiglu", True, False, True, marks=pytest.mark.slow),
        ("geglu", True, True, False),
        ("swiglu", True, False, False),
    ],
)
@pytest.mark.usefixtures("interpret")
def test_routed_glu_mlp_matches_permuted_reference(activation, dropped, fuse_gather, zero_tail):
    num_tokens, top_k, d, f, num_experts = 40, 3, 64, 128, 4
    rng = np.random.default_rng(51)
    experts = np.stack([rng.choice(3, size=top_k, replace=False) for _ in range(num_tokens)]).reshape(-1)
    experts = np.where(experts == 2, 3, experts)  # expert 2 stays empty
    sort_indices = np.argsort(experts, kind="stable").astype(np.int32)
    sizes = np.bincount(experts, minlength=num_experts)
    if dropped:
        sizes[3] -= 7  # the last 7 sorted rows fall past the sum
    m = num_tokens * top_k
    x = jnp.asarray(4.0 * rng.normal(size=(num_tokens, d)), jnp.bfloat16)
    w_gate_up, w_down = (jnp.asarray(w, jnp.bfloat16) for w in expert_weights(rng, num_experts, d, f))
    row_scale = jnp.asarray(rng.uniform(0.1, 1.0, size=m), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    group_sizes, indices = jnp.asarray(sizes, jnp.int32), jnp.asarray(sort_indices)

    def vjp(fn, w):
        return jitted_vjp(fn, (x, w, w_down, row_scale), cotangent)

    kernel = vjp(
        lambda a, b, c, s: glu_mlp_api.routed_glu_mlp(
            a,
            indices,
            top_k,
            b,
            c,
            group_sizes,
            activation=activation,
            row_scale=s,
            zero_tail=zero_tail,
            backend="pallas_gather" if fuse_gather else "pallas_sorted",
        ),
        moe_jax.pack_gate_up(w_gate_up),
    )
    expected = vjp(
        lambda a, b, c, s: mlp_reference.glu_mlp(
            a[indices // top_k], b, c, group_sizes, activation=activation, row_scale=s
        ),
        w_gate_up,
    )
    past = int(sizes.sum())
    kernel = (kernel[0] if zero_tail else kernel[0][:past], kernel[1], moe_jax.unpack_gate_up(kernel[2]), *kernel[3:])
    expected = (expected[0] if zero_tail else expected[0][:past], *expected[1:])
    for name, actual, exact in zip(
        ("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale"), kernel, expected, strict=True
    ):
        assert actual.shape == exact.shape and actual.dtype == exact.dtype, name
        assert oracle.relative_error(actual, exact) < (Y_TOL if name == "y" else GRAD_TOL), name
    if zero_tail:
        np.testing.assert_array_equal(np.asarray(kernel[0], np.float32)[past:], 0.0)


@pytest.mark.usefixtures("interpret")
def test_glu_mlp_without_rows_and_zero_tail_off_gives_zero_gradients():
    """No group has a row (an expert-parallel device none of whose experts was chosen): with zero_tail=False no
    kernel computes anything, and every gradient is exactly zero, whatever the unwritten output holds."""
    inputs = _inputs("ragged")
    group_sizes = jnp.zeros_like(inputs["group_sizes"])

    def mlp(x, w_gate_up, w_down, row_scale):
        return moe_jax.glu_mlp(
            x, w_gate_up, w_down, group_sizes, row_scale=row_scale, zero_tail=False, backend="pallas"
        )

    args = (inputs["x"], moe_jax.pack_gate_up(inputs["w_gate_up"]), inputs["w_down"], inputs["row_scale"])
    _, *gradients = jitted_vjp(mlp, args, inputs["cotangent"])
    for gradient in jax.tree.leaves(gradients):
        np.testing.assert_array_equal(np.asarray(gradient, np.float32), 0.0)


# None: the table's / heuristic's config (128 x 128 ring tiles, on which geglu and gpt_oss compute h, d_gate and d_up
# each in its own store's branch: launch.RECOMPUTED_GRADS). 64-column tiles cannot carry the gate/up rows in the
# ring (config.gate_up_ring_slots): each consumer loads them into a buffer of its own. The wide ring (dsv3-ep8 down's
# entry, here with 3 stages) carries each tile's four gate/up chunks through a ring of three slots, with a row scale.
@pytest.mark.parametrize(
    "activation, config, with_row_scale",
    [
        ("geglu", None, False),
        ("gpt_oss", None, True),
        ("swiglu", Config(block_n=64, num_stages=4), False),
        ("swiglu", dataclasses.replace(GLU_DGRAD_LONG_D_TILES, num_stages=3), True),
    ],
    ids=["geglu", "gpt_oss-row-scale", "swiglu-own-buffer", "swiglu-wide-ring-row-scale"],
)
@pytest.mark.usefixtures("interpret")
def test_glu_backward_epilogue(activation, config, with_row_scale):
    """The down projection's dgrad with the GLU backward, against jax.vjp of the reference GLU on the same kept
    pre-activation (the MLP cases above reach only the heuristic's configs, and without a row scale swiglu only)."""
    inputs = _inputs("ragged")
    group_sizes, w_down, d_y = inputs["group_sizes"], inputs["w_down"], inputs["cotangent"]
    row_scale = inputs["row_scale"] if with_row_scale else None
    d_ff = w_down.shape[1]
    gate_up = 5.0 * jax.random.normal(jax.random.key(1), (d_y.shape[0], 2 * d_ff), jnp.float32)
    gate, up = (half.astype(jnp.bfloat16).astype(jnp.float32) for half in jnp.split(gate_up, 2, axis=1))
    packed_rows = moe_jax.pack_gate_up(jnp.concatenate([gate, up], axis=1)[None]).array[0]  # [M, 2F], packed
    d_gate_up, hidden, d_row_scale = launch.run_glu_dgrad(
        d_y, w_down, group_sizes, packed_rows.astype(d_y.dtype), row_scale, activation, config=config
    )
    d_h = reference.grouped_matmul(d_y, w_down, group_sizes, transpose_rhs=True, preferred_element_type=jnp.float32)
    routed_rows = int(np.sum(CASES["ragged"][3]))
    outputs = (d_gate_up, hidden, d_row_scale)
    check_glu_backward(
        outputs, gate, up, d_h, row_scale, activation, routed_rows, hidden_tol=OUT_TOL, grad_tol=GRAD_TOL
    )


# Epilogue.recompute_grads moves where h, d_gate and d_up are computed (each in its store's branch), not what: on the
# 128 x 128 ring (5 stages) and the 128 x 256 one (4), with a row scale, F = 192 (each ring's last tile has chunks
# wholly past F).
@pytest.mark.parametrize("config", [GLU_DGRAD_TILES, GLU_DGRAD_LONG_D_TILES], ids=["ring-128", "ring-256"])
@pytest.mark.usefixtures("interpret")
def test_glu_backward_recomputed_per_store_is_bit_identical(monkeypatch, config):
    m, d, d_ff, sizes = 136, 64, 192, [0, 61, 3, 0, 40]
    rng = np.random.default_rng(15)
    d_y = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    w_down = jnp.asarray(rng.normal(size=(len(sizes), d_ff, d)) / np.sqrt(d_ff), jnp.bfloat16)
    gate_up = jnp.asarray(5.0 * rng.normal(size=(1, m, 2 * d_ff)), jnp.float32)
    packed_rows = moe_jax.pack_gate_up(gate_up).array[0].astype(jnp.bfloat16)
    row_scale = jnp.asarray(rng.uniform(0.1, 1.0, size=m), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    monkeypatch.setattr(launch, "RECOMPUTE_MAX_BLOCK_N", config.block_n)
    outputs = []
    for recomputed in ((), ("gpt_oss",)):
        monkeypatch.setattr(launch, "RECOMPUTED_GRADS", recomputed)
        outputs.append(launch.run_glu_dgrad(d_y, w_down, group_sizes, packed_rows, row_scale, "gpt_oss", config=config))
    for together, per_store in zip(*outputs, strict=True):
        assert np.isfinite(np.asarray(per_store, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(together), np.asarray(per_store))


@pytest.mark.usefixtures("interpret")
def test_grouped_matmul_fuses_glu_and_row_scale_with_k_major_packed_weights():
    """The standalone op: GLU + row scale in one epilogue from [G, 2F, K] packed weights, f32 output. (Its gradient,
    the epilogue differentiated in XLA from the kept pre-activation, is test_grouped_matmul_pallas.py's.)"""
    inputs = _inputs("beyond the clamp")
    x, group_sizes, row_scale = inputs["x"], inputs["group_sizes"], inputs["row_scale"]
    k_major = jnp.swapaxes(inputs["w_gate_up"], 1, 2)  # [G, 2F, K]
    options = dict(activation="gpt_oss", row_scale=row_scale, preferred_element_type=jnp.float32, transpose_rhs=True)
    packed = moe_jax.pack_gate_up(k_major, transposed=True)
    out = moe_jax.grouped_matmul(x, packed, group_sizes, backend="pallas", **options)
    expected = reference.grouped_matmul(x, k_major, group_sizes, **options)
    assert out.shape == (x.shape[0], CASES["beyond the clamp"][2]) and out.dtype == jnp.float32
    assert oracle.relative_error(out, expected) < 1e-5  # f32 output: only the summation order differs
