"""The fused GLU kernels on the device: ``glu_mlp`` forward + backward (six kernels) and the standalone fused
``grouped_matmul`` epilogues (the NNX ``MoE`` on both backends: test_moe_module_gpu.py).

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_glu_mlp_gpu.py``.

- Named shapes at full size (qwen3-30b experts with every activation, gpt-oss-120b's): XLA's ragged_dot multiplies by
  every group there, so the oracle is ``MLPGroupOracle``, the exact f32 MLP of three groups differentiated by jax.vjp,
  plus the rows past the sum, which must be exactly zero.
- A seeded random sweep of smaller shapes and routings against the XLA reference on the same device.
Tolerance: relative-norm error ``TOL`` (bf16 inputs, f32 accumulation, bf16 outputs, cotangent and kept
pre-activation).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul import config as gmm_config
from moe_jax.ops.grouped_matmul import glu, launch
from moe_jax.ops.grouped_matmul import reference as gmm_reference
from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK, split_gate_up
from tests.oracle import MLPGroupOracle, random_group_sizes, relative_error

pytestmark = pytest.mark.gpu
TOL = 1e-2


def _inputs(key, g, m, d, d_ff, x_scale=1.0):
    keys = jax.random.split(key, 5)
    return dict(
        x=(x_scale * jax.random.normal(keys[0], (m, d), jnp.float32)).astype(jnp.bfloat16),
        w_gate_up=(jax.random.normal(keys[1], (g, d, 2 * d_ff), jnp.float32) * d**-0.5).astype(jnp.bfloat16),
        w_down=(jax.random.normal(keys[2], (g, d_ff, d), jnp.float32) * d_ff**-0.5).astype(jnp.bfloat16),
        row_scale=jax.random.uniform(keys[3], (m,), jnp.float32, 0.1, 1.0),
        cotangent=jax.random.normal(keys[4], (m, d), jnp.bfloat16),
    )


@functools.partial(jax.jit, static_argnames=("activation", "backend", "recompute"))
def _fwd_bwd(inputs, w_gate_up, group_sizes, *, activation, backend, recompute=False):
    def mlp(x, w_gate_up, w_down, row_scale):
        args = (x, w_gate_up, w_down, group_sizes, activation, row_scale, True, backend)
        return glu_mlp_api._glu_mlp(*args, recompute_gate_up=recompute)

    args = (inputs["x"], w_gate_up, inputs["w_down"], inputs["row_scale"])
    y, pullback = jax.vjp(mlp, *args)
    return (y, *pullback(inputs["cotangent"]))


@pytest.mark.parametrize(
    "model, activation",
    [
        ("qwen3-30b", "swiglu"),
        ("qwen3-30b", "geglu"),
        ("qwen3-30b", "gpt_oss"),
        ("gpt-oss-120b", "gpt_oss"),
        ("gpt-oss-120b-t128", "gpt_oss"),  # decode-sized groups: the forward on 64-row tiles, one consumer
    ],
)
def test_named_shape_against_exact_groups(model, activation):
    shape = shapes.GMM_SHAPES[f"{model}/gate_up"]
    g, m, d, d_ff = shape.g, shape.m, shape.k, shape.n // 2
    inputs = _inputs(jax.random.key(3), g, m, d, d_ff, x_scale=4.0 if activation == "gpt_oss" else 1.0)
    group_sizes = shape.group_sizes("uniform", seed=4) * 15 // 16  # rows past the sum too
    packed = moe_jax.pack_gate_up(inputs["w_gate_up"])
    y, d_x, d_packed, d_w_down, d_row_scale = _fwd_bwd(
        inputs, packed, group_sizes, activation=activation, backend="pallas"
    )
    output = (y, d_x, moe_jax.unpack_gate_up(d_packed), d_w_down, d_row_scale)
    oracle = MLPGroupOracle(
        inputs["x"],
        inputs["w_gate_up"],
        inputs["w_down"],
        group_sizes,
        inputs["row_scale"],
        activation,
        inputs["cotangent"],
    )
    for name, error in zip(("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale"), oracle.errors(output), strict=True):
        assert error < TOL, f"{name}: {error} ({oracle.describe()})"
    past = oracle.routed_rows
    for name, value in (("y", y), ("d_x", d_x), ("d_row_scale", d_row_scale)):
        assert float(jnp.max(jnp.abs(value[past:].astype(jnp.float32)))) == 0.0, name


@functools.partial(jax.jit, static_argnames=("top_k", "fused"))
def _routed_fwd_bwd(inputs, packed, group_sizes, sort_indices, *, top_k, fused):
    """routed_glu_mlp (gather fused into the gate_up kernel) or permute + glu_mlp, both on the Pallas kernels."""

    def mlp(x, w_gate_up, w_down, row_scale):
        if fused:
            return glu_mlp_api.routed_glu_mlp(
                x,
                sort_indices,
                top_k,
                w_gate_up,
                w_down,
                group_sizes,
                row_scale=row_scale,
                backend="pallas_gather",
            )
        rows = moe_jax.permute(x, sort_indices, top_k)
        return moe_jax.glu_mlp(rows, w_gate_up, w_down, group_sizes, row_scale=row_scale, backend="pallas")

    y, pullback = jax.vjp(mlp, inputs["x"], packed, inputs["w_down"], inputs["row_scale"])
    return (y, *pullback(inputs["cotangent"]))


# The gathered gate_up kernel against the same kernels on permuted rows: the products are the same arithmetic, so
# forward and weight gradients must be bit-identical; d_x sums each token's k row gradients in another order (TOL).
# qwen3's layer, a gpt-oss-width one (D = 2880: no multiple of 128, so the row kernels' last chunk overlaps), a
# deepseek-v3-width one (D = 7168, F = 2048: permuted first by default), a narrow one (2F = 512: 128-wide
# tiles, where the forward keeps its outputs across tiles) and qwen3's decode step (T = 128).
@pytest.mark.parametrize(
    "t, d, d_ff, e, top_k",
    [
        (16384, 2048, 768, 128, 8),
        (4096, 2880, 2880, 32, 4),
        (4096, 7168, 2048, 32, 8),
        (4096, 1024, 256, 16, 4),
        (128, 2048, 768, 128, 8),  # a decode step: 8 rows an expert, gathered into 64-row tiles
    ],
)
def test_routed_glu_mlp_matches_permuted_rows(t, d, d_ff, e, top_k):
    inputs = _inputs(jax.random.key(9), e, t * top_k, d, d_ff)
    inputs["x"] = inputs["x"][:t]
    experts = jax.lax.top_k(jax.random.normal(jax.random.key(10), (t, e)), top_k)[1].reshape(-1)
    sort_indices = jnp.argsort(experts, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(experts, length=e).astype(jnp.int32)
    packed = moe_jax.pack_gate_up(inputs["w_gate_up"])
    fused, unfused = (
        list(_routed_fwd_bwd(inputs, packed, group_sizes, sort_indices, top_k=top_k, fused=f)) for f in (True, False)
    )
    fused[2], unfused[2] = fused[2].array, unfused[2].array  # the packed weights' gradients, as stored
    for name, actual, exact in zip(("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale"), fused, unfused, strict=True):
        if name == "d_x":
            assert relative_error(actual, exact) < TOL, name
        else:
            np.testing.assert_array_equal(np.asarray(actual), np.asarray(exact), err_msg=name)


def _sweep_cases(count: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    for index in range(count):
        g = int(rng.choice([1, 3, 8, 16]))
        m = int(rng.integers(64, 3000))
        d, d_ff = 64 * int(rng.integers(1, 12)), 64 * int(rng.integers(1, 12))
        kind = str(rng.choice(["uniform", "empty", "hot", "tail", "zipf"]))
        activation = ("swiglu", "geglu", "gpt_oss")[index % 3]
        yield pytest.param(
            g, m, d, d_ff, random_group_sizes(rng, g, m, kind), activation, bool(index % 2), id=f"{index}-{kind}"
        )


@pytest.mark.parametrize("g, m, d, d_ff, sizes, activation, recompute", list(_sweep_cases(6)))
def test_random_shapes_against_reference(g, m, d, d_ff, sizes, activation, recompute):
    inputs = _inputs(jax.random.key(m), g, m, d, d_ff, x_scale=4.0)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    packed = moe_jax.pack_gate_up(inputs["w_gate_up"])
    kernel = list(_fwd_bwd(inputs, packed, group_sizes, activation=activation, backend="pallas", recompute=recompute))
    kernel[2] = moe_jax.unpack_gate_up(kernel[2])
    expected = _fwd_bwd(inputs, inputs["w_gate_up"], group_sizes, activation=activation, backend="xla")
    names = ("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale")
    for name, actual, exact in zip(names, kernel, expected, strict=True):
        assert actual.shape == exact.shape and actual.dtype == exact.dtype, name
        assert relative_error(actual, exact) < TOL, name


# The GLU backward's ring configs with 16 contraction steps per tile, so a tile's gate/up chunks reuse the slots of
# its steps: the 128 x 128 ring (two chunks, five or six slots; gpt_oss recomputes its outputs per store) and the
# 128 x 256 one (four chunks through four slots, or three). F = 832 ends in a 64-column tile: its last chunk (three of
# four on the wide ring) lies wholly past F, stores nothing and adds nothing to the row-scale gradient.
@pytest.mark.parametrize(
    "config, activation, d_ff",
    [
        (gmm_config.GLU_DGRAD_SHORT_D_TILES, "gpt_oss", 768),
        (gmm_config.GLU_DGRAD_LONG_D_TILES, "swiglu", 768),
        (gmm_config.GLU_DGRAD_TILES, "gpt_oss", 832),
        (dataclasses.replace(gmm_config.GLU_DGRAD_LONG_D_TILES, num_stages=3), "swiglu", 832),
    ],
    ids=["ring-128-6", "ring-256-4", "ring-128-5-f832", "ring-256-3-f832"],
)
def test_glu_backward_ring_configs_against_reference(config, activation, d_ff):
    g, m, d = 8, 4000, 1024
    keys = jax.random.split(jax.random.key(9), 4)
    d_y = jax.random.normal(keys[0], (m, d), jnp.bfloat16)
    w_down = (jax.random.normal(keys[1], (g, d_ff, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    gate, up = (4.0 * jax.random.normal(key, (m, d_ff), jnp.float32) for key in jax.random.split(keys[2]))
    gate, up = (v.astype(jnp.bfloat16).astype(jnp.float32) for v in (gate, up))
    row_scale = jax.random.uniform(keys[3], (m,), jnp.float32, 0.1, 1.0)
    group_sizes = jnp.asarray(random_group_sizes(np.random.default_rng(10), g, m, "empty"), jnp.int32)
    packed_rows = moe_jax.pack_gate_up(jnp.concatenate([gate, up], axis=1)[None]).array[0].astype(jnp.bfloat16)
    run = jax.jit(functools.partial(launch.run_glu_dgrad, activation=activation, config=config))
    d_gate_up, hidden, d_row_scale = run(d_y, w_down, group_sizes, packed_rows, row_scale)

    d_h = gmm_reference.grouped_matmul(d_y, w_down, group_sizes, transpose_rhs=True, preferred_element_type=jnp.float32)
    expected_hidden, pullback = jax.vjp(lambda a, b: glu.glu(a, b, activation), gate, up)
    expected = {
        "d_gate_up": jnp.concatenate(pullback(d_h * row_scale[:, None]), axis=1),
        "hidden": expected_hidden * row_scale[:, None],
        "d_row_scale": jnp.sum(expected_hidden * d_h, axis=1),
    }
    actual = {
        "d_gate_up": jnp.concatenate(split_gate_up(d_gate_up, PACK_BLOCK), axis=1),
        "hidden": hidden,
        "d_row_scale": d_row_scale,
    }
    for name, value in actual.items():
        assert relative_error(value, expected[name]) < TOL, name


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
def test_fused_grouped_matmul_epilogues_against_reference(activation):
    g, m, k, n = 8, 2000, 512, 768
    inputs = _inputs(jax.random.key(5), g, m, k, n // 2, x_scale=4.0)
    group_sizes = jnp.asarray(random_group_sizes(np.random.default_rng(6), g, m, "tail"), jnp.int32)

    @functools.partial(jax.jit, static_argnames="backend")
    def run(x, w, scale, backend):
        glu = moe_jax.grouped_matmul(x, w, group_sizes, activation=activation, backend=backend)
        scaled = moe_jax.grouped_matmul(x, inputs["w_gate_up"], group_sizes, row_scale=scale, backend=backend)
        return glu, scaled

    packed = moe_jax.pack_gate_up(inputs["w_gate_up"])
    actual = run(inputs["x"], packed, inputs["row_scale"], "pallas")
    expected = run(inputs["x"], inputs["w_gate_up"], inputs["row_scale"], "xla")
    for a, e in zip(actual, expected, strict=True):
        assert relative_error(a, e) < TOL


@functools.partial(jax.jit, static_argnames=("activation", "top_k", "backend", "quantization"))
def _fp8_fwd_bwd(inputs, group_sizes, sort_indices=None, *, activation, top_k=1, backend, quantization):
    """y and the gradients of (x, w_gate_up, w_down, row_scale): ``glu_mlp`` on x's rows, or with ``sort_indices``
    ``routed_glu_mlp`` on x's tokens, each token's rows summed (``combine``: the cotangent is the tokens')."""
    options = dict(activation=activation, backend=backend, quantization=quantization)

    def mlp(x, w_gate_up, w_down, row_scale):
        if sort_indices is None:
            return moe_jax.glu_mlp(x, w_gate_up, w_down, group_sizes, row_scale=row_scale, **options)
        return glu_mlp_api.routed_glu_mlp(
            x, sort_indices, top_k, w_gate_up, w_down, group_sizes, row_scale=row_scale, combine="pallas", **options
        )

    y, pullback = jax.vjp(mlp, *(inputs[name] for name in ("x", "w_gate_up", "w_down", "row_scale")))
    return (y, *pullback(inputs["cotangent"]))


# The FP8 MLP (FP8 forward kernels, the GLU backward in the FP8 dgrad's epilogue, FP8 dgrad and wgrads) against the
# XLA implementation of its recipe on the same device, at the named models' D and F (gpt-oss-120b: D = 2880, the
# GLU backward's contraction ends in a 64-wide block) with fewer groups and rows, so that XLA's ragged_dot, which
# multiplies every row by every group, stays cheap. Both sides quantize the same operands, but each computes its
# own bf16 pre-activation, which the backward keeps in e4m3: where the two differ by a rounding flip next to an e4m3
# rounding boundary, the kept values differ by a whole e4m3 step (2^-4 relative), and the gradients by up to ~3 %
# (FP8_TOL). So each side is also measured against the unquantized MLP (XLA, bf16): the kernels' error must be the
# recipe's within ACCURACY_SLACK (a wrong scale or block costs far more than that).
FP8_TOL = 5e-2
ACCURACY_SLACK = 1.15
OUTPUT_NAMES = ("y", "d_x", "d_w_gate_up", "d_w_down", "d_row_scale")
# (backend, quantization) of the kernels, the XLA recipe and the unquantized MLP.
FP8_PATHS = (("pallas", "fp8_block"), ("xla", "fp8_block"), ("xla", None))


def _assert_kernels_match_the_recipe(fwd_bwd) -> None:
    """``fwd_bwd(backend=, quantization=)`` on each of FP8_PATHS: the kernels' outputs against the recipe's and
    both against the unquantized MLP's."""
    kernel, recipe, unquantized = (fwd_bwd(backend=backend, quantization=q) for backend, q in FP8_PATHS)
    for name, actual, expected, exact in zip(OUTPUT_NAMES, kernel, recipe, unquantized, strict=True):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert bool(jnp.all(jnp.isfinite(actual.astype(jnp.float32)))), name
        assert relative_error(actual, expected) < FP8_TOL, name
        kernel_error, recipe_error = relative_error(actual, exact), relative_error(expected, exact)
        assert kernel_error < ACCURACY_SLACK * recipe_error, (name, kernel_error, recipe_error)


@pytest.mark.parametrize(
    "model, activation, kind",
    [("qwen3-30b", "swiglu", "tail"), ("gpt-oss-120b", "gpt_oss", "empty"), ("dsv3-ep8", "geglu", "zipf")],
)
def test_fp8_glu_mlp_against_the_xla_recipe(model, activation, kind):
    shape = shapes.GMM_SHAPES[f"{model}/gate_up"]
    g, m, d, d_ff = 8, 2048, shape.k, shape.n // 2
    inputs = _inputs(jax.random.key(5), g, m, d, d_ff, x_scale=4.0 if activation == "gpt_oss" else 1.0)
    group_sizes = jnp.asarray(random_group_sizes(np.random.default_rng(6), g, m, kind), jnp.int32)
    _assert_kernels_match_the_recipe(functools.partial(_fp8_fwd_bwd, inputs, group_sizes, activation=activation))


@pytest.mark.parametrize("model, activation", [("qwen3-30b", "swiglu"), ("gpt-oss-120b", "gpt_oss")])
def test_fp8_routed_glu_mlp_against_the_xla_recipe(model, activation):
    """Routed from tokens (top-4 of 8 experts), each token's rows summed inside the kernels' VJP, so the backward
    takes the tokens' dy: the gate_up kernel gathers each token's FP8 row and the GLU-backward kernel dy's (qwen3-30b),
    or x's and dy's FP8 rows and scales are permuted first (gpt-oss-120b: D = 2880, half a last K block, which a
    gathered step cannot copy; and qwen3-30b's "pallas_sorted"). The wgrads' quantizers gather the tokens' rows of x
    and dy on both. Where both kernel paths run, they quantize the same values: equal bit for bit."""
    shape = shapes.GMM_SHAPES[f"{model}/gate_up"]
    g, t, top_k, d, d_ff = 8, 512, 4, shape.k, shape.n // 2
    inputs = _inputs(jax.random.key(11), g, t * top_k, d, d_ff, x_scale=4.0 if activation == "gpt_oss" else 1.0)
    inputs["x"], inputs["cotangent"] = inputs["x"][:t], inputs["cotangent"][:t]  # the tokens
    experts = jax.lax.top_k(jax.random.normal(jax.random.key(12), (t, g)), top_k)[1].reshape(-1)
    sort_indices = jnp.argsort(experts, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(experts, length=g).astype(jnp.int32)
    routed = functools.partial(_fp8_fwd_bwd, inputs, group_sizes, sort_indices, activation=activation, top_k=top_k)
    _assert_kernels_match_the_recipe(routed)
    if d % 128 == 0:
        gathered, permuted = (routed(backend=b, quantization="fp8_block") for b in ("pallas_gather", "pallas_sorted"))
        for name, actual, expected in zip(OUTPUT_NAMES, gathered, permuted, strict=True):
            np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=name)
