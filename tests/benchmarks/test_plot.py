"""``python -m benchmarks --plot``: which bars a recorded run becomes, and the PNG it writes."""

import dataclasses

import numpy as np
import pytest

from benchmarks import common, plot
from benchmarks.__main__ import TITLES, main

META = {
    "date": "2026-01-01T00:00:00+00:00",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "platform": "gpu",
    "jax": "0",
    "jaxlib": "0",
    "git_revision": "abc",
    "command": "python -m benchmarks",
    "peers": {"tokamax": "0"},
    "flop_model": common.FLOP_MODEL,
}
FLOPS = 10**12


def _record(bench, shape, routing, impl, seconds, **fields) -> common.Record:
    timing = common.Timing(seconds, seconds, seconds, seconds, samples=3, reps=1, first_call_s=1.0, timer="device")
    return common.Record(bench, shape, routing, impl, flops=FLOPS, dims={}, timing=timing, **fields)


@pytest.fixture
def run():
    """A gmm run at two shapes (one with tokamax's default and two swept configs, one whose tokamax ran out of
    memory), a skew run at two routings of one shape, and routing records (not plotted), with seeded random times;
    and the seconds drawn, by (bench, shape, routing, impl)."""
    rng = np.random.default_rng(0)
    seconds = {}

    def timed(bench, shape, routing, impl, **fields):
        seconds[(bench, shape, routing, impl)] = float(rng.uniform(1e-3, 5e-3))
        return _record(bench, shape, routing, impl, seconds[(bench, shape, routing, impl)], **fields)

    records = [
        timed("gmm", "a/gate_up", "-", "dense"),
        timed("gmm", "a/gate_up", "-", "hbm-floor"),
        timed("gmm", "a/gate_up", "uniform", "moe_jax:pallas"),
        timed("gmm", "a/gate_up", "uniform", "tokamax"),
        timed("gmm", "a/gate_up", "uniform", "tokamax[128x64x128 s4 persistent N/8]", config={"block_m": 128}),
        timed("gmm", "a/gate_up", "uniform", "tokamax[128x128x64 s2 grid M/1]", config={"block_m": 128}),
        timed("gmm", "a/gate_up", "uniform", "ragged_dot"),
        timed("gmm", "b/down", "-", "dense"),
        timed("gmm", "b/down", "uniform", "moe_jax:pallas"),
        common.Record("gmm", "b/down", "uniform", "tokamax", FLOPS, {}, status="OOM", note="Out of memory"),
        timed("skew", "a/gate_up", "-", "dense"),
        timed("skew", "a/gate_up", "uniform", "moe_jax:pallas"),
        timed("skew", "a/gate_up", "zipf", "moe_jax:pallas"),
        common.Record("routing", "layer", "router", "moe_jax:pallas", 0, {}, stage="route"),
    ]
    return records, seconds


def _tflops(seconds: float) -> float:
    return FLOPS / seconds / 1e12


def test_a_row_per_shape_with_each_family_at_its_best(run):
    records, seconds = run
    rows = {row.label: row for row in plot.bench_rows(records, "gmm")}
    assert list(rows) == ["a/gate_up", "b/down"]
    a, b = rows["a/gate_up"], rows["b/down"]
    tokamax = min(t for (bench, shape, _, impl), t in seconds.items() if shape == "a/gate_up" and "tokamax" in impl)
    assert a.tflops["tokamax"] == pytest.approx(_tflops(tokamax))
    assert a.tflops["dense"] == pytest.approx(_tflops(seconds[("gmm", "a/gate_up", "-", "dense")]))
    assert a.floor_tflops == pytest.approx(_tflops(seconds[("gmm", "a/gate_up", "-", "hbm-floor")]))
    assert set(a.tflops) == {"moe_jax:pallas", "tokamax", "ragged_dot", "dense"}
    assert set(b.tflops) == {"moe_jax:pallas", "dense"}  # tokamax ran out of memory: no bar
    assert b.floor_tflops is None


def test_our_bar_says_its_ratios_to_dense_and_to_tokamax(run):
    records, seconds = run
    a, b = plot.bench_rows(records, "gmm")
    ours = seconds[("gmm", "a/gate_up", "uniform", "moe_jax:pallas")]
    dense = seconds[("gmm", "a/gate_up", "-", "dense")]
    tokamax = min(t for (_, shape, _, impl), t in seconds.items() if shape == "a/gate_up" and "tokamax" in impl)
    assert a.annotation() == f" {_tflops(ours):.0f} TF/s = {dense / ours:.2f}x dense, {tokamax / ours:.2f}x tokamax"
    assert b.annotation().endswith("x dense")


def test_routings_of_a_shape_are_rows_of_their_own_sharing_its_dense_bar(run):
    records, seconds = run
    rows = plot.bench_rows(records, "skew")
    assert [row.label for row in rows] == ["a/gate_up (uniform)", "a/gate_up (zipf)"]
    dense = _tflops(seconds[("skew", "a/gate_up", "-", "dense")])
    assert [row.tflops["dense"] for row in rows] == pytest.approx([dense, dense])


def test_the_figure_has_a_panel_per_bench_and_a_bar_per_family(run):
    records, _ = run
    fig = plot.figure(META, records, TITLES)
    gmm_panel, skew_panel = fig.axes  # in the order of TITLES; the routing records have none
    assert gmm_panel.get_title() == TITLES["gmm"] and skew_panel.get_title() == TITLES["skew"]
    assert len(gmm_panel.patches) == 4 + 2 and len(skew_panel.patches) == 2 + 2
    first_row = plot.bench_rows(records, "gmm")[0]
    assert sum(line.get_label() == plot.LEGEND["hbm-floor"] for line in gmm_panel.lines) == (
        first_row.floor_tflops < first_row.tflops["dense"]
    )


def test_the_floor_is_drawn_only_where_it_binds():
    row = plot.Row("a", {"moe_jax:pallas": 400.0, "dense": 800.0}, floor_tflops=600.0)
    assert row.binding_floor() == 600.0
    assert dataclasses.replace(row, floor_tflops=900.0).binding_floor() is None  # compute-bound
    assert dataclasses.replace(row, tflops={"moe_jax:pallas": 400.0}, floor_tflops=900.0).binding_floor() == 900.0


def test_cli_writes_a_png(run, tmp_path):
    records, _ = run
    path = tmp_path / "run.jsonl"
    stream = common.JsonlWriter(str(path))
    stream.write({"meta": META})
    for record in records:
        stream.write(record.to_json())
    assert main(["--plot", str(path)]) == records
    with open(tmp_path / "run.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_flop_records_is_refused():
    records = [common.Record("routing", "layer", "router", "moe_jax:pallas", 0, {}, stage="route")]
    with pytest.raises(SystemExit, match="nothing to plot"):
        plot.figure(META, records, TITLES)


def test_plot_out_without_a_run_is_refused():
    with pytest.raises(SystemExit, match="give --plot RUN.jsonl too"):
        main(["--plot-out", "figure.png"])
