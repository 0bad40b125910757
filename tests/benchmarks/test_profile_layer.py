"""benchmarks.profile_layer's attribution of kernels to stages (the profiling itself needs a GPU)."""

import functools

import pytest

from benchmarks import profile_layer
from benchmarks.shapes import LAYER_SHAPES
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


def test_glue_budget_is_the_target_share_of_the_span_it_would_leave():
    span, glue = 2139.4, 340.9
    budget = profile_layer.glue_budget_us(span, glue)
    assert budget / (span - glue + budget) == pytest.approx(profile_layer.GLUE_TARGET_SHARE)
    assert profile_layer.glue_budget_us(1000.0, 100.0, share=0.25) == pytest.approx(300.0)


def test_row_bytes_count_the_expert_rows_and_the_tokens_rows_once_per_direction():
    shape = LAYER_SHAPES["qwen3-30b-a3b"]  # T 16384, D 2048, k 8: 537 MB of expert rows read, 67 MB of y written
    assert profile_layer.row_bytes(shape, permutes=False) == 2 * 16384 * 2048 * (8 + 1)
    assert profile_layer.row_bytes(shape, permutes=True) == 2 * profile_layer.row_bytes(shape, permutes=False)


def test_markdown_states_the_allowance_and_the_rows_floor():
    stages = {"router": 20.0, "gating": 10.0, "xla-glue": 5.0, "gate_up": 600.0, "down": 250.0, "combine": 100.0}
    stages["span"] = 1000.0
    result = {
        "shape": "demo",
        "stages_us": stages,
        "sorted_rows_gate_up_us": 585.0,
        "gather_cost_us": 15.0,
        "glue_kernels_us": 115.0,
        "glue_us": 130.0,
        "glue_share": 0.13,
        "glue_budget_us": profile_layer.glue_budget_us(1000.0, 130.0),
        "row_bytes": 300_000_000,
        "read_rate_tbs": 3.0,
        "row_floor_us": 100.0,
        "kernels": {},
    }
    table = profile_layer.markdown(result)
    assert "| glue allowed at <= 10% (the other kernels' 870.0 µs x 0.1 / 0.9) | 96.7 | |" in table
    assert "| the rows' floor: combine, 300 MB at the read rate (3.00 TB/s) | 100.0 | 10.0% |" in table
    assert "| left of the allowance for the rest of the glue, were the rows at their floor | -3.3 | |" in table
