"""The lowering bench's tables: instances and median seconds per kernel, largest first, and the median of the
runs' totals; the compile table's kernels, longest first, and their sum."""

import pytest

from benchmarks.lowering import compile_on_gpu, compile_summary, summary


def test_the_table_counts_instances_and_takes_medians():
    runs = [
        {"trace_s": 1.0, "lower_s": 5.0, "kernels": [("gmm", 1.0), ("gmm", 2.0), ("gating", 0.5)]},
        {"trace_s": 2.0, "lower_s": 7.0, "kernels": [("gmm", 1.5), ("gmm", 2.5), ("gating", 0.1)]},
        {"trace_s": 3.0, "lower_s": 6.0, "kernels": [("gmm", 2.0), ("gmm", 2.0), ("gating", 0.3)]},
    ]
    lines = summary("layer", runs)
    assert lines[4:7] == ["| gmm | 2 | 4.00 |", "| gating | 1 | 0.30 |", "| all 3 kernels | | 4.10 |"]
    assert "trace 2.00 s, lower 6.00 s (medians of 3)" in lines


def test_the_compile_table_sorts_kernels_and_sums_them():
    result = {"kernels": [("moe_gating", 0.5), ("moe_gmm_wgrad", 3.25), ("moe_gmm", 1.0)], "program_s": 2.0}
    lines = compile_summary("layer", result)
    assert lines[4:8] == [
        "| moe_gmm_wgrad | 3.25 |",
        "| moe_gmm | 1.00 |",
        "| moe_gating | 0.50 |",
        "| all 3 kernels, one after another | 4.75 |",
    ]
    assert lines[8] == "| the program, its kernels compiled (XLA's own compilation) | 2.00 |"


def test_compiling_needs_a_gpu():
    with pytest.raises(RuntimeError, match="--compile needs a GPU"):
        compile_on_gpu(lambda: pytest.fail("nothing is built off a GPU"))
