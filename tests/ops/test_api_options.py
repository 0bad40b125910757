"""The options the public functions share: ``RoutingOptions`` and its keywords, the layer's one choice of
implementations (``LayerBackends``), and the deprecated ``glu_mlp(recompute_gate_up=)``. XLA path, tiny shapes;
results compared exactly (the same computation spelled two ways) or against the float64 oracle."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax._core import backend as dispatch
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul.api import quantize_weights
from moe_jax.ops.moe_ffn.api import LayerBackends
from tests import oracle

T, D, F, E, K = 16, 64, 64, 8, 2


def _layer_inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return dict(
        x=jnp.asarray(rng.normal(size=(T, D)), jnp.float32),
        router_kernel=jnp.asarray(rng.normal(size=(D, E)) / np.sqrt(D), jnp.float32),
        w_gate_up=jnp.asarray(rng.normal(size=(E, D, 2 * F)) / np.sqrt(D), jnp.float32),
        w_down=jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32),
    )


def test_routing_options_and_keywords_route_alike_and_keywords_override():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(T, E)), jnp.float32)
    options = moe_jax.RoutingOptions(score="sigmoid", num_groups=4, top_groups=2, scale=2.5)
    by_value = moe_jax.route(logits, K, routing=options, backend="xla")
    by_keywords = moe_jax.route(logits, K, score="sigmoid", num_groups=4, top_groups=2, scale=2.5, backend="xla")
    overridden = moe_jax.route(
        logits,
        K,
        routing=moe_jax.RoutingOptions(score="softmax"),
        score="sigmoid",
        num_groups=4,
        top_groups=2,
        scale=2.5,
        backend="xla",
    )
    for other in (by_keywords, overridden):
        for a, b in zip(jax.tree.leaves(by_value), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    expected = oracle.route(np.asarray(logits, np.float64), K, score="sigmoid", num_groups=4, top_groups=2, scale=2.5)
    assert oracle.relative_error(by_value.weights, expected["weights"]) < 1e-6


def test_moe_ffn_takes_routing_options_as_a_value_or_as_keywords():
    inputs = _layer_inputs(1)
    options = moe_jax.RoutingOptions(score="sigmoid", renormalize=False, scale=0.5)
    y_value, aux_value = moe_jax.moe_ffn(**inputs, top_k=K, routing=options, backend="xla")
    y_keywords, aux_keywords = moe_jax.moe_ffn(
        **inputs, top_k=K, score="sigmoid", renormalize=False, scale=0.5, backend="xla"
    )
    np.testing.assert_array_equal(np.asarray(y_value), np.asarray(y_keywords))
    np.testing.assert_array_equal(np.asarray(aux_value.expert_counts), np.asarray(aux_keywords.expert_counts))
    default, _ = moe_jax.moe_ffn(**inputs, top_k=K, backend="xla")
    assert oracle.relative_error(y_value, default) > 1e-2  # the options changed the result


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        (dict(scor="sigmoid"), TypeError, r"unexpected keyword argument\(s\) \['scor'\]"),
        (dict(score="relu"), ValueError, "score must be one of"),
        (dict(top_groups=3, num_groups=2), ValueError, "top_groups must be in"),
        (dict(renormalize=1), TypeError, "renormalize must be a Python bool"),
    ],
)
def test_bad_routing_keywords_name_themselves(keywords, error, message):
    inputs = _layer_inputs(2)
    with pytest.raises(error, match=message):
        moe_jax.moe_ffn(**inputs, top_k=K, backend="xla", **keywords)


def test_routing_must_be_routing_options():
    with pytest.raises(TypeError, match="routing must be a RoutingOptions"):
        moe_jax.route(jnp.zeros((T, E)), K, routing={"score": "sigmoid"})


def test_a_layer_chooses_its_implementations_once():
    x = jax.ShapeDtypeStruct((T, 128), jnp.bfloat16)
    options = dict(top_k=K, activation="swiglu", routing=moe_jax.RoutingOptions())

    def weights(d_ff):
        return jax.ShapeDtypeStruct((E, 128, 2 * d_ff), jnp.bfloat16), jax.ShapeDtypeStruct(
            (E, d_ff, 128), jnp.bfloat16
        )

    on_xla = LayerBackends.select("xla", x, *weights(128), **options)
    assert on_xla == LayerBackends(route="xla", experts="xla", combine="xla")
    on_kernels = LayerBackends.select("pallas", x, *weights(128), **options)
    assert on_kernels == LayerBackends(route="pallas", experts="pallas_gather", combine="pallas")
    wide = LayerBackends.select("pallas", x, *weights(glu_mlp_api.GATHER_MAX_D_FF + 64), **options)
    assert wide.experts == "pallas_sorted"  # past the gather's width the layer permutes first
    with pytest.raises(NotImplementedError, match="glu_mlp: .*multiple of 64"):
        LayerBackends.select("pallas", x, *weights(96), **options)


def test_a_quantized_layer_takes_the_fp8_kernels_only_where_they_take_its_weights():
    """On an sm90 GPU "auto" runs fp8_block's experts on the FP8 kernels for high-precision weights and packed
    BlockScaled ones, the gate_up kernel gathering the tokens' FP8 rows where D is a multiple of 128 (sorted rows
    elsewhere: D = 192), and in XLA for a BlockScaled [gate | up] array (the GLU kernel reads packed columns)."""
    options = dict(top_k=K, activation="swiglu", routing=moe_jax.RoutingOptions(), quantization="fp8_block")
    w_gate_up = jnp.zeros((E, 128, 256), jnp.bfloat16)
    w_down = jnp.zeros((E, 128, 128), jnp.bfloat16)
    quantized_down = quantize_weights(w_down)
    cases = [
        (128, (w_gate_up, w_down), "pallas_gather"),
        (192, (jnp.zeros((E, 192, 256), jnp.bfloat16), jnp.zeros((E, 128, 192), jnp.bfloat16)), "pallas_sorted"),
        (128, (quantize_weights(moe_jax.pack_gate_up(w_gate_up)), quantized_down), "pallas_gather"),
        (128, (quantize_weights(w_gate_up), quantized_down), "xla"),
    ]
    with mock.patch.object(dispatch, "has_sm90_gpu", return_value=True):
        for d_model, weights, expected in cases:
            x = jax.ShapeDtypeStruct((T, d_model), jnp.bfloat16)
            assert LayerBackends.select("auto", x, *weights, **options).experts == expected, d_model


def test_recompute_gate_up_is_deprecated_and_changes_nothing():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(2, D, 2 * F)) / np.sqrt(D), jnp.float32)
    w_down = jnp.asarray(rng.normal(size=(2, F, D)) / np.sqrt(F), jnp.float32)
    group_sizes = jnp.asarray([5, 9], jnp.int32)
    expected = moe_jax.glu_mlp(x, w_gate_up, w_down, group_sizes, backend="xla")
    with pytest.warns(DeprecationWarning, match="recompute_gate_up"):
        got = moe_jax.glu_mlp(x, w_gate_up, w_down, group_sizes, recompute_gate_up=True, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
