"""benchmarks.profile_layer's attribution of kernels to stages (the profiling itself needs a GPU)."""

import functools

import pytest

from benchmarks import profile_layer
from moe_jax.ops.grouped_matmul import glu, sm90


def _kernel(epilogue, gathered=False) -> str:
    return sm90._kernel_name(epilogue, gathered) + profile_layer.MOSAIC_SUFFIX


@pytest.mark.parametrize(
    "kernel, stage",
    [
        (_kernel(sm90.Epilogue(activation=functools.partial(glu.glu, activation="swiglu")), gathered=True), "gate_up"),
        (_kernel(sm90.Epilogue(activation=functools.partial(glu.glu, activation="swiglu"))), "gate_up"),
        (_kernel(sm90.Epilogue(row_scale=True)), "down"),
        (_kernel(sm90.Epilogue(activation_grad=glu.glu_grad, row_scale=True)), "other"),  # a backward kernel
        ("moe_gating_mosaic_gpu_kernel", "gating"),
        ("moe_gather_rows_mosaic_gpu_kernel", "combine"),
        ("moe_scatter_rows_mosaic_gpu_kernel", "permute"),
        ("nvjet_sm90_tss_64x128_64x8_2x1_v_bz_NNN", "router"),
        ("gemm_fusion_dot_general_1", "router"),
        ("input_scatter_fusion", "xla-glue"),
        ("loop_compare_gather_fusion", "xla-glue"),
    ],
)
def test_stage_of_names_each_forward_kernel(kernel, stage):
    assert profile_layer.stage_of(kernel) == stage


def test_medians_sum_stages_per_call_and_measure_the_span():
    # Two calls (name, start ns, duration ns): the second with a gap between its kernels, which the span counts.
    calls = [
        [("gemm_fusion", 0, 10_000), ("moe_gating_mosaic_gpu_kernel", 10_000, 5_000), ("loop_a", 15_000, 1_000)],
        [
            ("gemm_fusion", 100_000, 12_000),
            ("moe_gating_mosaic_gpu_kernel", 112_000, 7_000),
            ("loop_a", 129_000, 3_000),
        ],
    ]
    assert profile_layer.stage_times(calls[1]) == {"router": 12.0, "gating": 7.0, "xla-glue": 3.0, "span": 32.0}
    assert profile_layer.medians(calls) == {"router": 11.0, "gating": 6.0, "xla-glue": 2.0, "span": 24.0}


def test_kernel_medians_sum_a_kernels_launches_per_call():
    calls = [
        [("loop_a", 0, 1_000), ("loop_b", 1_000, 4_000), ("loop_a", 5_000, 2_000)],
        [("loop_a", 9_000, 5_000), ("loop_b", 14_000, 6_000), ("loop_a", 20_000, 1_000)],
    ]
    assert profile_layer.kernel_medians(calls) == {"loop_a": 4.5, "loop_b": 5.0}


def test_gather_cost_is_the_gate_up_difference_only_where_the_layer_gathers():
    sorted_rows = {"gate_up": 100.0, "down": 50.0}
    assert profile_layer.gather_cost_us({"gate_up": 107.5, "combine": 9.0}, sorted_rows) == pytest.approx(7.5)
    assert profile_layer.gather_cost_us({"gate_up": 93.0, "permute": 20.0}, sorted_rows) == 0.0


def test_glue_markdown_compares_spans():
    glue = {
        f"{stage}:{backend}": {"span_us": span, "kernels_us": span - 1.0, "launches": 3}
        for stage, spans in (("glue", (300.0, 150.0)), ("glue-fused", (90.0, 60.0)))
        for backend, span in zip(profile_layer.GLUE_BACKENDS, spans, strict=True)
    }
    table = profile_layer.glue_markdown("demo", glue)
    assert "| glue | 300.0 | 299.0 (3) | 150.0 | 149.0 (3) | 2.00x |" in table
    assert "| glue-fused | 90.0 | 89.0 (3) | 60.0 | 59.0 (3) | 1.50x |" in table


def test_a_gather_that_speeds_the_kernel_up_counts_as_no_glue():
    # A faster gathered kernel is the GEMM's gain: the glue is then its kernels alone, never less.
    assert profile_layer.layer_glue_us(800.0, 65.5) == pytest.approx(865.5)
    assert profile_layer.layer_glue_us(800.0, -926.0) == 800.0
