"""The FP8 layer profile's bookkeeping: kernel classes by name, the per-call medians (hand-made traces) and which
layers a run profiles."""

import pytest

from benchmarks import profile_fp8_layer as profile


@pytest.mark.parametrize(
    "name, kernel_class",
    [
        ("moe_gmm_fp8_glu_mosaic_gpu_kernel", "gemm"),
        ("moe_gmm_wgrad_fp8_mosaic_gpu_kernel", "gemm"),
        ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_TNN", "gemm"),
        ("moe_quantize_blockwise_mosaic_gpu_kernel", "quantize"),
        ("moe_quantize_square_blocks_mosaic_gpu_kernel", "quantize"),
        ("moe_quantize_row_blocks_transposed_mosaic_gpu_kernel", "quantize"),
        ("loop_convert_f8e4m3fn_fusion", "quantize"),
        ("input_reduce_fusion_amax", "quantize"),
        ("transpose_fusion_3", "layout"),
        ("moe_gating_mosaic_gpu_kernel", "other"),
    ],
)
def test_kernels_are_classified_by_name(name, kernel_class):
    assert profile.kernel_class(name) == kernel_class


def test_summary_takes_medians_per_class_and_kernel():
    # Per call: the GEMM launched 1, 3, 2 times (median 2; neither the last call's count nor the largest), the
    # transpose 5, 4, 6 times (median 5).
    calls = [
        [("moe_gmm_fp8_mosaic_gpu_kernel", 0, 1000 * us)] * gemms + [("transpose_fusion", 0, 2000)] * transposes
        for us, gemms, transposes in ((10, 1, 5), (30, 3, 4), (20, 2, 6))
    ]
    summary = profile.summarize(calls)
    assert summary["total_us"] == 52.0
    assert summary["classes_us"] == {"gemm": 40.0, "quantize": 0.0, "layout": 10.0, "other": 0.0}
    assert list(summary["top_kernels_us"]) == ["moe_gmm_fp8_mosaic_gpu_kernel", "transpose_fusion"]
    assert summary["top_kernel_launches"] == {"moe_gmm_fp8_mosaic_gpu_kernel": 2.0, "transpose_fusion": 5.0}


def test_runs_profile_the_bf16_layer_then_each_fp8_weights_kind():
    assert profile.runs("fp8_block", ("per-call", "stored")) == [
        (None, None),
        ("fp8_block", "per-call"),
        ("fp8_block", "stored"),
    ]


def test_unknown_weights_kind_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--weights", "cached"])
    assert "--weights must name some of ('per-call', 'stored'), got 'cached'" in capsys.readouterr().err
