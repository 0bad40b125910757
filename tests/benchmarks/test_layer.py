"""The layer bench's FP8 rows on CPU (backend "auto", which runs the XLA path here): the "-stored" row's plumbing.

On the XLA path a ``QuantizedMaster`` is quantized again from its master, so these tests check what the bench builds
around the layer (the copies' layouts, the arguments, the gradients reaching the bf16 weights as passed, the check
against the reference), not that kernels read the copies: the kernels' use of a QuantizedMaster is checked against
quantizing in the call in tests/ops/test_grouped_matmul_fp8.py and test_glu_mlp_fp8_pallas.py."""

import dataclasses

import pytest

from benchmarks import common, layer, shapes

# D and F multiples of 128, so that the weights hold whole 128 x 128 blocks.
SHAPE = dataclasses.replace(shapes.LAYER_SHAPES["ci/layer"], d=128, f=128)
OPTIONS = common.Options(
    backends=("auto",), baselines=(), iters=1, warmup=0, max_seconds=0.05, min_samples=1, quantization="fp8_block"
)
# Four e4m3 operands (x, the weights, the hidden rows; with the backward dy and its gradients) against bf16.
QUANTIZED_TOL = 1.5e-1


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_stored_copies_row_matches_the_layer_that_quantizes_per_call(backward):
    records = layer.bench_shape(SHAPE, OPTIONS, backward=backward, emit=lambda record: None)
    by_impl = {record.impl: record for record in records}
    assert list(by_impl) == ["moe_jax:auto", "moe_jax:auto-fp8_block", "moe_jax:auto-fp8_block-stored"]
    per_call, stored = by_impl["moe_jax:auto-fp8_block"], by_impl["moe_jax:auto-fp8_block-stored"]
    assert per_call.status == stored.status == "ok", (per_call.note, stored.note)
    assert stored.checked_against == per_call.checked_against == "moe_jax:auto"
    # Both are checked leaf by leaf against the bf16 layer: y (and with the backward the gradients to x, the router
    # and both weights). The same quantization of the same weights gives the same errors, leaf for leaf.
    assert 0 < per_call.rel_err < QUANTIZED_TOL
    assert stored.rel_err_leaves == per_call.rel_err_leaves
    assert len(stored.rel_err_leaves) == (5 if backward else 3)


def test_stored_copies_are_the_kernels_two_layouts_of_each_weight():
    input_set = layer.make_inputs(SHAPE, seed=1)[0]
    copies = layer.stored_copies(input_set)
    gate_up, down = copies["gate_up_copies"].array, copies["down_copies"]
    assert gate_up.master is input_set["w_gate_up"].array and down.master is input_set["w_down"]
    e, d, f = SHAPE.e, SHAPE.d, SHAPE.f
    assert (gate_up.forward.shape, gate_up.dgrad.shape) == ((e, 2 * f, d), (e, d, 2 * f))
    assert (down.forward.shape, down.dgrad.shape) == ((e, d, f), (e, f, d))
