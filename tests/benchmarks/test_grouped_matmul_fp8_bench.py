"""The grouped matmul's FP8 forward bench (``--quantization``) on CPU: its rows, its floor's bytes and its check.

The XLA path's bf16 output against the same implementation's f32 on three groups differs by bf16 rounding only
(2^-9 relative): ``BF16_TOL``."""

import pytest

from benchmarks import common, grouped_matmul
from benchmarks.__main__ import main
from benchmarks.shapes import GMM_SHAPES

TINY = common.Options(backends=("xla",), iters=1, warmup=0, max_seconds=0.05, min_samples=1, quantization="fp8_block")
BF16_TOL = 4e-3


def test_floor_bytes_are_fp8_weights_and_bf16_activations_and_output():
    s = GMM_SHAPES["ci/gate_up"]
    assert grouped_matmul.fp8_hbm_floor_bytes(s) == 4 * 128 * 256 + 2 * (256 * 128 + 256 * 256)


def test_tiny_run_times_the_dense_fp8_matmul_and_checks_the_op():
    records = grouped_matmul.run("gmm", [GMM_SHAPES["ci/gate_up"]], TINY, emit=lambda record: None)
    assert [(r.bench, r.impl) for r in records] == [
        ("gmm-fp8", "dense"),
        ("gmm-fp8", "hbm-floor"),
        ("gmm-fp8", "moe_jax:xla-fp8"),
        ("gmm-fp8", "moe_jax:xla-dgrad-fp8"),
    ]
    assert all(r.status == "ok" and r.timing is not None for r in records)
    for record in records[2:]:
        assert record.rel_err < BF16_TOL and "XLA fp8_block implementation" in record.checked_against


def test_quantization_is_for_the_forward_bench_only():
    with pytest.raises(SystemExit, match="--bench gmm or layer"):
        main(["--tiny", "--bench", "gmm-bwd", "--quantization", "fp8_block"])
