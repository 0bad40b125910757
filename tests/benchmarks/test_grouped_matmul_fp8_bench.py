"""The grouped matmul's FP8 forward bench (``--quantization``) on CPU: its rows, its floor's bytes and its check.

The XLA path's bf16 output against the same implementation's f32 on three groups differs by bf16 rounding only
(2^-9 relative): ``BF16_TOL``. The unquantized bf16 wgrad against the quantized one differs by the e4m3
quantization: ``UNQUANTIZED_TOL``."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, grouped_matmul
from benchmarks.__main__ import main
from benchmarks.shapes import GMM_SHAPES
from tests.helpers import checked_interpreter

TINY = common.Options(backends=("xla",), iters=1, warmup=0, max_seconds=0.05, min_samples=1, quantization="fp8_block")
BF16_TOL = 4e-3
UNQUANTIZED_TOL = 5e-2  # two e4m3 operands: 3.7-3.8% (tests/ops/test_grouped_matmul_fp8.py)


def test_floor_bytes_are_fp8_weights_and_bf16_activations_and_output():
    s = GMM_SHAPES["ci/gate_up"]
    assert grouped_matmul.fp8_hbm_floor_bytes(s) == 4 * 128 * 256 + 2 * (256 * 128 + 256 * 256)


@pytest.mark.parametrize("quantization", ["fp8_block", "mxfp8"])
def test_tiny_run_times_the_dense_fp8_matmul_and_checks_the_op(quantization):
    """Both recipes' forward rows (x quantized in the call, and beforehand) and dgrad row (mxfp8's on weights
    quantized again along N) against the XLA implementation of the same recipe."""
    options = dataclasses.replace(TINY, quantization=quantization)
    records = grouped_matmul.run("gmm", [GMM_SHAPES["ci/gate_up"]], options, emit=lambda record: None)
    bench = {"fp8_block": "gmm-fp8", "mxfp8": "gmm-mxfp8"}[quantization]  # each recipe's table of RESULTS.md
    assert [(r.bench, r.impl) for r in records] == [
        (bench, "dense"),
        (bench, "hbm-floor"),
        (bench, "moe_jax:xla-fp8"),
        (bench, "moe_jax:xla-x-stored-fp8"),
        (bench, "moe_jax:xla-dgrad-fp8"),
    ]
    assert all(r.status == "ok" and r.timing is not None for r in records)
    for record in records[2:]:
        assert record.rel_err < BF16_TOL and f"XLA {quantization} implementation" in record.checked_against


def test_quantization_is_for_the_forward_bench_only():
    with pytest.raises(SystemExit, match="--bench gmm or layer"):
        main(["--tiny", "--bench", "gmm-bwd", "--quantization", "fp8_block"])


def test_wgrad_rows_match_the_recipes_wgrad():
    """The FP8 and bf16 wgrad rows' ops (kernels under the interpreter) on a ragged routing against
    ``QuantizedWgradOracle``: the FP8 kernel's bf16 output differs from it by bf16 rounding; the bf16 kernel's by the
    e4m3 quantization the oracle has (``UNQUANTIZED_TOL``)."""
    s = GMM_SHAPES["ci/gate_up"]
    lhs, d_out = (
        jax.random.normal(key, shape, jnp.bfloat16)
        for key, shape in zip(jax.random.split(jax.random.key(0)), [(s.m, s.k), (s.m, s.n)], strict=True)
    )
    group_sizes = jnp.asarray([100, 0, 129, 20], jnp.int32)
    oracle = grouped_matmul.QuantizedWgradOracle(lhs, d_out, group_sizes, "fp8_block")
    rows = {
        impl: (operands, op)
        for impl, gemm, operands, op in grouped_matmul._fp8_candidates("fp8_block", ("pallas",), s)
        if gemm == "wgrad"
    }
    assert list(rows) == ["moe_jax:pallas-wgrad-fp8", "moe_jax:pallas-wgrad-bf16"]
    inputs = dict(lhs=lhs, d_out=d_out)
    with checked_interpreter():
        for (impl, (operands, op)), tol in zip(rows.items(), (BF16_TOL, UNQUANTIZED_TOL), strict=True):
            out = op(*(inputs[o] for o in operands), group_sizes)
            assert out.shape == (s.g, s.n, s.k) and out.dtype == jnp.bfloat16, impl
            assert oracle.errors(out)[0] < tol, impl


@pytest.mark.slow  # test_wgrad_rows_match_the_recipes_wgrad checks the rows' ops and oracle; this, their wiring
def test_pallas_run_times_the_wgrad_kernels_and_checks_the_fp8_one():
    """The FP8 and bf16 wgrad rows in a whole pallas run, the FP8 one checked."""
    options = dataclasses.replace(TINY, backends=("pallas",), baselines=())
    with checked_interpreter():
        records = grouped_matmul.run("gmm", [GMM_SHAPES["ci/gate_up"]], options, emit=lambda record: None)
    wgrad = {r.impl: r for r in records if "wgrad" in r.impl}
    assert list(wgrad) == ["moe_jax:pallas-wgrad-fp8", "moe_jax:pallas-wgrad-bf16"]
    assert all(r.status == "ok" and r.timing is not None for r in wgrad.values())
    checked = wgrad["moe_jax:pallas-wgrad-fp8"]
    assert checked.rel_err < BF16_TOL and "XLA fp8_block wgrad" in checked.checked_against
