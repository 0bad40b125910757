"""The lowering bench's table: instances and median seconds per kernel, largest first, and the median of the runs'
totals."""

from benchmarks.lowering import summary


def test_the_table_counts_instances_and_takes_medians():
    runs = [
        {"trace_s": 1.0, "lower_s": 5.0, "kernels": [("gmm", 1.0), ("gmm", 2.0), ("gating", 0.5)]},
        {"trace_s": 2.0, "lower_s": 7.0, "kernels": [("gmm", 1.5), ("gmm", 2.5), ("gating", 0.1)]},
        {"trace_s": 3.0, "lower_s": 6.0, "kernels": [("gmm", 2.0), ("gmm", 2.0), ("gating", 0.3)]},
    ]
    lines = summary("layer", runs)
    assert lines[4:7] == ["| gmm | 2 | 4.00 |", "| gating | 1 | 0.30 |", "| all 3 kernels | | 4.10 |"]
    assert "trace 2.00 s, lower 6.00 s (medians of 3)" in lines
