"""The named-shape registry (benchmarks/shapes.py): the models' shapes, and group sizes drawn under each routing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import shapes
from moe_jax.ops.grouped_matmul import config

# The named shapes of docs/design.md ("Benchmarks"), copied by hand: a change to the registry must be a deliberate
# change to this table too.
DESIGN_SHAPES = {
    "qwen3-30b/gate_up": (128, 32768, 2048, 1536),
    "qwen3-30b/down": (128, 32768, 768, 2048),
    "gpt-oss-120b/gate_up": (128, 32768, 2880, 5760),
    "gpt-oss-120b/down": (128, 32768, 2880, 2880),
    "dsv3-ep8/gate_up": (32, 32768, 7168, 4096),
    "dsv3-ep8/down": (32, 32768, 2048, 7168),
    "mixtral/gate_up": (8, 16384, 4096, 28672),
    "mixtral/down": (8, 16384, 14336, 4096),
}


def test_bench_shapes_are_design_section_6():
    bench = {s.name: (s.g, s.m, s.k, s.n) for s in shapes.gmm_shapes("bench")}
    assert bench == DESIGN_SHAPES


def _off_the_tuned_table(shape) -> bool:
    """No kernel kind has a tuned-table entry at the shape, so the heuristic picks every config there."""
    return not any((kind, shape.g, shape.m, shape.k, shape.n) in config.tuned_configs() for kind in config.KINDS)


def test_heuristic_shapes_are_other_models_off_the_tuned_table():
    """Each "heuristic" model has a gate_up [M, D] x [E, D, 2F] and a down [M, F] x [E, F, D] projection that the
    kernels take (K and N multiples of 64) and that no tuned-table entry covers, so the heuristic picks the configs."""
    models = {}
    for shape in shapes.gmm_shapes("heuristic"):
        model, projection = shape.name.split("/")
        models.setdefault(model, {})[projection] = shape
    assert len(models) == 6 and all(set(projections) == {"gate_up", "down"} for projections in models.values())
    for model, projections in models.items():
        gate_up, down = projections["gate_up"], projections["down"]
        assert (gate_up.g, gate_up.m) == (down.g, down.m), model
        assert (gate_up.n, gate_up.k) == (2 * down.k, down.n), model
        for shape in (gate_up, down):
            assert shape.k % 64 == 0 and shape.n % 64 == 0, shape
            assert _off_the_tuned_table(shape), shape


def test_decode_shapes_are_the_bench_models_at_few_tokens():
    """Each "decode" grouped matmul is a bench model's projection (same G, K, N) at fewer rows, 4-64 a group, off the
    tuned table; each "decode" layer is a bench layer at T = 128 with the same router and experts."""
    bench = {s.name: s for s in shapes.gmm_shapes("bench")}
    decode = shapes.gmm_shapes("decode")
    assert len(decode) == 6
    for shape in decode:
        model, projection = shape.name.split("/")
        full = bench[f"{model.rsplit('-t', 1)[0]}/{projection}"]
        assert (shape.g, shape.k, shape.n) == (full.g, full.k, full.n), shape
        assert 4 <= shape.m // shape.g <= config.TINY_GROUP_ROWS and shape.m < full.m, shape
        assert _off_the_tuned_table(shape), shape
    layers = shapes.layer_shapes("decode")
    assert [s.name for s in layers] == ["qwen3-30b-a3b-t128", "gpt-oss-120b-t128"]
    for layer in layers:
        full = shapes.LAYER_SHAPES[layer.name.removesuffix("-t128")]
        assert layer.t == 128
        assert dataclasses.replace(layer, name=full.name, t=full.t, tag=full.tag) == full


def test_ci_shapes_are_tiny():
    for shape in shapes.gmm_shapes("ci"):
        assert shape.m * shape.k * shape.n <= 2**23, shape  # milliseconds on a CPU, seconds under the interpreter
    for shape in shapes.layer_shapes("ci"):
        assert shape.t <= 64 and shape.d <= 128 and shape.e <= 16, shape  # one 64-token block of the routing kernel


def test_model_layers_are_registered_with_their_routers():
    qwen3 = shapes.LAYER_SHAPES["qwen3-30b-a3b"]
    assert (qwen3.t, qwen3.d, qwen3.f, qwen3.e, qwen3.top_k) == (16384, 2048, 768, 128, 8)
    assert qwen3.m == 16384 * 8
    assert qwen3.route_options() == dict(score="softmax", renormalize=True, num_groups=1, top_groups=1, scale=1.0)
    assert not qwen3.selection_bias
    deepseek = shapes.LAYER_SHAPES["deepseek-v3"]
    assert (deepseek.t, deepseek.d, deepseek.f, deepseek.e, deepseek.top_k) == (16384, 7168, 2048, 256, 8)
    assert deepseek.route_options() == dict(score="sigmoid", renormalize=True, num_groups=8, top_groups=4, scale=2.5)
    assert deepseek.selection_bias
    gpt_oss = shapes.LAYER_SHAPES["gpt-oss-120b"]
    assert (gpt_oss.t, gpt_oss.d, gpt_oss.f, gpt_oss.e, gpt_oss.top_k) == (16384, 2880, 2880, 128, 4)
    assert (gpt_oss.activation, gpt_oss.score, gpt_oss.renormalize) == ("gpt_oss", "softmax", True)
    mixtral = shapes.LAYER_SHAPES["mixtral-8x7b"]
    assert (mixtral.t, mixtral.d, mixtral.f, mixtral.e, mixtral.top_k) == (16384, 4096, 14336, 8, 2)
    assert (mixtral.activation, mixtral.score) == ("swiglu", "softmax")
    bench = {"qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b", "deepseek-v3"}
    assert {s.name for s in shapes.layer_shapes("bench")} == bench
    assert all(s.tag == "ci" for s in shapes.layer_shapes("ci"))


def test_shapes_are_frozen_and_validated():
    shape = shapes.GMM_SHAPES["ci/gate_up"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.m = 1
    with pytest.raises(ValueError, match="tag"):
        shapes.GroupedMatmulShape("x", g=1, m=1, k=1, n=1, tag="big")
    with pytest.raises(ValueError, match="x: k must be >= 1, got 0"):
        shapes.GroupedMatmulShape("x", g=1, m=1, k=0, n=1, tag="ci")
    with pytest.raises(TypeError, match="x: n must be a Python int"):
        shapes.GroupedMatmulShape("x", g=1, m=1, k=1, n=1.0, tag="ci")
    with pytest.raises(ValueError, match="x: d must be >= 1"):
        shapes.LayerShape("x", t=4, d=0, f=8, e=2, top_k=1, activation="swiglu", tag="ci")
    with pytest.raises(ValueError, match="top_k"):
        shapes.LayerShape("x", t=4, d=8, f=8, e=2, top_k=3, activation="swiglu", tag="ci")
    with pytest.raises(ValueError, match="num_groups must divide"):
        shapes.LayerShape("x", t=4, d=8, f=8, e=6, top_k=1, activation="swiglu", tag="ci", num_groups=4)
    with pytest.raises(ValueError, match="top_k"):  # 1 group of 2 experts eligible
        shapes.LayerShape("x", t=4, d=8, f=8, e=8, top_k=3, activation="swiglu", tag="ci", num_groups=4)
    with pytest.raises(ValueError, match="score"):
        shapes.LayerShape("x", t=4, d=8, f=8, e=2, top_k=1, activation="swiglu", tag="ci", score="relu")
    with pytest.raises(ValueError, match="routing"):
        shape.group_sizes("skewed")


@pytest.mark.parametrize("routing", shapes.ROUTINGS)
@pytest.mark.parametrize("g, m", [(1, 37), (5, 200), (128, 32768)])
def test_group_sizes_cover_every_row(routing, g, m):
    sizes = shapes.make_group_sizes(jax.random.key(3), g, m, routing)
    assert sizes.shape == (g,) and sizes.dtype == jnp.int32
    sizes = np.asarray(sizes)
    assert sizes.sum() == m and (sizes >= 0).all()


def test_routings_have_the_stated_skew():
    shape = shapes.GMM_SHAPES["qwen3-30b/gate_up"]
    mean = shape.m / shape.g
    uniform = np.asarray(shape.group_sizes("uniform", seed=1))
    # Binomial(M, 1/G): std ~ 16 rows around a mean of 256; 128 experts stay well within +-40%.
    assert np.abs(uniform - mean).max() < 0.4 * mean
    half = np.asarray(shape.group_sizes("half", seed=1))
    assert half.max() == shape.m // 2
    assert np.sort(half)[-2] < 0.05 * shape.m
    zipf = np.sort(np.asarray(shape.group_sizes("zipf1.2", seed=1)))[::-1]
    # P(rank 1) = 1 / sum_r r^-1.2 ~ 0.22 for G = 128; rank 2 gets 2^-1.2 ~ 0.44 of that.
    top_share = 1 / np.sum(np.arange(1, shape.g + 1) ** -1.2)
    assert abs(zipf[0] / shape.m - top_share) < 0.02
    assert abs(zipf[1] / zipf[0] - 2**-1.2) < 0.05


def test_group_sizes_depend_on_the_seed_only():
    shape = shapes.GMM_SHAPES["ci/ragged"]
    for routing in shapes.ROUTINGS:
        np.testing.assert_array_equal(shape.group_sizes(routing, seed=4), shape.group_sizes(routing, seed=4))
    assert not np.array_equal(shape.group_sizes("uniform", seed=4), shape.group_sizes("uniform", seed=5))
