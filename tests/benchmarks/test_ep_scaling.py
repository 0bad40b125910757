"""benchmarks.expert_parallel.weak_scaling_points: the ep records the notebook's scaling section plots."""

import json

import pytest

from benchmarks.expert_parallel import dispatch_name, weak_scaling_points


def _write_run(path, date, platform, records):
    meta = dict(date=date, platform=platform, device_kind="GPU X", num_devices=4, git_revision="0" * 40, command="c",
                jax="0", flop_model="")  # fmt: skip
    lines = [{"meta": meta}] + [
        dict(bench=bench, shape="s", routing="uniform", impl=impl, flops=1, status="ok", note="",
             dims=dict(devices=devices, tokens_per_device=1000, memory=dict(temp=1, arguments=2, outputs=4)),
             timing=dict(median_s=median_s, p10_s=median_s, p90_s=median_s, min_s=median_s, samples=3, reps=1,
                         first_call_s=1.0, timer="wall"))
        for bench, impl, devices, median_s in records
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_picks_the_run_with_the_most_gpu_counts_and_converts_its_records(tmp_path):
    two = [("ep-bwd", "moe_jax:pallas", 1, 0.01), ("ep-bwd", "ep2-all_gather:pallas", 2, 0.02)]
    four = two + [("ep-bwd", "ep4-all_to_all-slots:pallas", 4, 0.004), ("ep-bwd", "dp4:pallas", 4, 0.1)]
    _write_run(tmp_path / "a_four.jsonl", "2026-01-01", "gpu", four)
    _write_run(tmp_path / "b_two_newer.jsonl", "2026-02-01", "gpu", two)
    _write_run(tmp_path / "c_cpu.jsonl", "2026-03-01", "cpu", four + [("ep-bwd", "dp8:xla", 8, 1.0)])
    points = weak_scaling_points(str(tmp_path))
    assert {p.run for p in points} == {"a_four.jsonl"}
    by_dispatch = {(p.dispatch, p.devices): p for p in points}
    assert set(by_dispatch) == {("one device", 1), ("all_gather", 2), ("all_to_all-slots", 4), ("dp", 4)}
    assert by_dispatch["all_to_all-slots", 4].tokens_per_s_per_device == pytest.approx(1000 / 0.004)
    assert by_dispatch["dp", 4].memory_bytes == 7


def test_dispatch_names():
    assert dispatch_name("ep4-all_to_all-ragged-decomposed:pallas") == "all_to_all-ragged-decomposed"
    assert dispatch_name("ep2-all_gather:xla") == "all_gather"
    assert dispatch_name("dp2:pallas") == "dp"
    assert dispatch_name("moe_jax:pallas") == "one device"
