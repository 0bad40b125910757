"""``python -m benchmarks --report``: RESULTS.md from small synthetic records, checked number by number."""

import dataclasses
import json
import os

import pytest

from benchmarks import common, report
from benchmarks.__main__ import main

GPU = "NVIDIA H100 80GB HBM3"
FLOPS = 2 * 10**12  # 2 TFLOP: 1 ms is 2000 TF/s
GMM_TITLE = "## Grouped matmul, forward: " + GPU


def meta(date: str, revision: str, command: str, *, device_kind: str = GPU, num_devices: int = 1) -> dict:
    return {
        "date": f"{date}T12:00:00+00:00",
        "device_kind": device_kind,
        "platform": "gpu",
        "num_devices": num_devices,
        "jax": "0.11.2",
        "jaxlib": "0.11.2",
        "git_revision": revision,
        "command": command,
        "peers": {},
        "flop_model": common.FLOP_MODEL,
    }


def record(shape: str, impl: str, ms: float, *, bench: str = "gmm", timer: str = "wall", **fields) -> dict:
    seconds = ms / 1e3
    timing = common.Timing(seconds, 0.99 * seconds, 1.01 * seconds, 0.98 * seconds, 10, 1, 1.0, timer)
    dims = {"g": 8, "m": 4096, "k": 1024, "n": 1024}
    return common.Record(bench, shape, "uniform", impl, FLOPS, dims, timing=timing, **fields).to_json()


def write_jsonl(path, *runs: tuple[dict, list[dict]]) -> None:
    with open(path, "w") as f:
        for run_meta, records in runs:
            f.write(json.dumps({"meta": run_meta}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in records)


def table_rows(text: str, provenance: str) -> list[list[str]]:
    """The cells of the table that follows the line starting with ``provenance``, header and rule left out."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(provenance))
    rows = []
    for line in lines[start + 4 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def build(results_dir) -> str:
    return report.build_report(str(results_dir), {"gmm": "Grouped matmul, forward"}, {}, ["a note"])


def test_each_shape_comes_from_its_newest_run(tmp_path):
    older = meta("2026-01-01", "aaaaaaa1234", "python -m benchmarks --bench gmm --shapes a,b")
    newer = meta("2026-01-02", "bbbbbbb5678", "python -m benchmarks --bench gmm --shapes a")
    write_jsonl(
        tmp_path / "old.jsonl",
        (older, [record("a", "dense", 1.0), record("a", "moe_jax:pallas", 2.0)]),
    )
    write_jsonl(
        tmp_path / "more.jsonl",
        (older, [record("b", "dense", 1.0), record("b", "moe_jax:pallas", 1.6)]),
    )
    write_jsonl(tmp_path / "new.jsonl", (newer, [record("a", "dense", 1.0), record("a", "moe_jax:pallas", 1.25)]))
    text = build(tmp_path)

    assert text.count(GMM_TITLE) == 1
    new_line = f"2026-01-02, {GPU}, jax 0.11.2, git bbbbbbb, wall clock; record `new.jsonl`: `{newer['command']}`"
    assert new_line in text.splitlines()
    assert text.index(new_line) < text.index("2026-01-01")  # newest run first
    # Shape a from the newer run only: 1.25 ms is 1600 TF/s, 0.80 of the dense 2000.
    assert table_rows(text, "2026-01-02") == [
        ["a", "uniform", "dense", "2000.0", "1.000", "2%", "2000.0", "1.00", ""],
        ["a", "uniform", "moe_jax:pallas", "2000.0", "1.250", "2%", "1600.0", "0.80", ""],
    ]
    # Shape b, which the newer run did not time, from the older one.
    assert table_rows(text, "2026-01-01, ") == [
        ["b", "uniform", "dense", "2000.0", "1.000", "2%", "2000.0", "1.00", ""],
        ["b", "uniform", "moe_jax:pallas", "2000.0", "1.600", "2%", "1250.0", "0.62", ""],
    ]
    assert "2.000" not in text  # the older run's time of shape a is superseded


def test_device_time_wins_over_a_newer_wall_clock_run(tmp_path):
    device = meta("2026-01-01", "ccccccc", "python -m benchmarks --bench gmm --timer device")
    wall = meta("2026-01-05", "ddddddd", "python -m benchmarks --bench gmm")
    write_jsonl(tmp_path / "device.jsonl", (device, [record("a", "dense", 1.0, timer="device")]))
    write_jsonl(tmp_path / "wall.jsonl", (wall, [record("a", "dense", 0.5)]))
    text = build(tmp_path)
    assert "GPU kernel time (CUPTI); record `device.jsonl`" in text
    assert "wall.jsonl" not in text


def test_runs_of_one_stream_and_json_records_are_read_and_untimed_records_do_not_count(tmp_path):
    first = meta("2026-01-01", "eeeeeee", "first")
    second = meta("2026-01-02", "fffffff", "second")
    skipped = dataclasses.replace(common.Record.from_json(record("a", "dense", 1.0)), timing=None, status="skipped")
    write_jsonl(tmp_path / "ab.jsonl", (first, [record("a", "dense", 1.0)]), (second, [skipped.to_json()]))
    two_gpus = meta("2026-01-03", "0123456", "json", device_kind="NVIDIA H200", num_devices=2)
    with open(tmp_path / "run.json", "w") as f:
        json.dump({"meta": two_gpus, "records": [record("a", "dense", 4.0)]}, f)
    with open(tmp_path / "note.json", "w") as f:
        json.dump({"note": "an A/B of two trees", "runs": []}, f)
    text = build(tmp_path)
    # The second run of the stream timed nothing: shape a comes from the first.
    assert "record `ab.jsonl`: `first`" in text and "`second`" not in text
    assert "## Grouped matmul, forward: NVIDIA H200" in text
    assert table_rows(text, "2026-01-03, 2 x NVIDIA H200")[0][4] == "4.000"


def test_every_bench_gets_its_own_table_function(tmp_path):
    run = meta("2026-01-01", "1111111", "python -m benchmarks --bench routing")
    write_jsonl(tmp_path / "r.jsonl", (run, [record("layer", "moe_jax:xla", 3.0, bench="routing", stage="glue")]))

    def stage_table(records):
        return "| stage | ms |\n|---|---:|\n" + "\n".join(
            f"| {r.stage} | {r.timing.median_s * 1e3:.1f} |" for r in records
        )

    text = report.build_report(str(tmp_path), {"routing": "Routing glue"}, {"routing": stage_table}, [])
    assert "## Routing glue: " + GPU in text
    assert table_rows(text, "2026-01-01") == [["glue", "3.0"]]


def profile_result(shape: str, gate_up: float) -> dict:
    stages = {"router": 10.0, "gating": 20.0, "xla-glue": 5.0, "gate_up": gate_up, "down": 50.0, "combine": 15.0}
    stages["span"] = sum(stages.values())
    return {"shape": shape, "stages_us": stages, "glue_us": 40.0, "glue_share": 40.0 / stages["span"]}


def test_profile_section_takes_each_layers_newest_profile(tmp_path):
    old = {"meta": meta("2026-01-01", "2222222", "old profile"), "results": [profile_result("layer", 900.0)]}
    new = {"meta": meta("2026-01-02", "3333333", "new profile"), "results": [profile_result("layer", 100.0)]}
    for name, content in (("old.json", old), ("new.json", new)):
        with open(tmp_path / name, "w") as f:
            json.dump(content, f)
    text = build(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| layer |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # router, gating, xla-glue, permute (none), gate_up, down, combine, span, glue, its share of the span.
    assert cells[1:11] == ["10.0", "20.0", "5.0", "-", "100.0", "50.0", "15.0", "200.0", "40.0", "20.0%"]
    assert "`new profile`" in text and "old profile" not in text


def test_fp8_profile_and_compile_report_sections_print_their_records(tmp_path):
    fp8_result = {
        "shape": "layer",
        "backward": True,
        "quantization": "fp8_block",
        "total_us": 1000.0,
        "classes_us": {"gemm": 600.0, "quantize": 100.0, "layout": 200.0, "other": 100.0},
        "top_kernels_us": {},
    }
    old = {"run": "pallas old record", "status": "ok", "trace_s": 1.0, "lower_s": 2.0, "compile_s": 3.0}
    old |= {"time_to_first_step_s": 7.5, "tokens_per_s": 5000.0, "mfu": 0.25, "peak_memory_gb": 40.0}
    run = old | {"run": "pallas warm cache", "aot": "loaded", "trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.5}
    run |= {"time_to_first_step_s": 3.5, "launch_to_first_step_s": 9.0}
    times = {"trace_s": 0.5, "lower_s": 1.5, "compile_s": 2.5, "total_s": 4.5}
    layer = {
        "tokens": 8192,
        "d_model": 1024,
        "times": {"cold cache": times, "warm cache": {"status": "timed out after 60 s"}},
    }
    compile_result = {
        "config": "gpu-moe",
        "runs": [run, old, {"run": "cold", "status": "timed out"}],
        "layers": {"ref": layer},
    }
    stored_result = fp8_result | {"backward": False, "weights": "stored", "total_us": 800.0}
    records = {"fp8.json": [fp8_result, stored_result], "compile.json": compile_result}
    for name, results in records.items():
        with open(tmp_path / name, "w") as f:
            json.dump({"meta": meta("2026-01-03", "4444444", name), "results": results}, f)
    lines = build(tmp_path).splitlines()
    fp8_rows = [line for line in lines if line.startswith(f"| {GPU} | layer |")]
    cells = [[c.strip() for c in row.strip("|").split("|")][2:9] for row in fp8_rows]
    # A result without "weights" is one whose FP8 layer quantized its weights in the call.
    assert cells == [
        ["fwd+bwd", "fp8_block", "1000", "600", "100", "200", "100"],
        ["fwd", "fp8_block, stored weights", "800", "600", "100", "200", "100"],
    ]
    assert "| pallas warm cache | ok | loaded | 0.0 | 0.0 | 0.5 | 3.5 | 9.0 | 5000 | 0.250 | 40.0 |" in lines
    assert "| pallas old record | ok | - | 1.0 | 2.0 | 3.0 | 7.5 | - | 5000 | 0.250 | 40.0 |" in lines
    assert "| cold | timed out | - | - | - | - | - | - | - | - | - |" in lines
    assert "| ref (T 8192, D 1024) | cold cache | 0.5 | 1.5 | 2.5 | 4.5 |" in lines
    assert "| ref (T 8192, D 1024) | warm cache | timed out after 60 s | | | |" in lines


def test_lowering_records_get_their_tables_oldest_first(tmp_path):
    """A lowering record's tables sit under its provenance line, a level below the section; the compile tables come
    only from a record made with --compile."""
    runs = [{"trace_s": 1.0, "lower_s": 3.0, "kernels": [["moe_gmm", 1.25], ["moe_gating", 0.5]]}]
    compiled = {"layer": {"kernels": [["moe_gmm", 2.5], ["moe_gating", 0.75]], "program_s": 1.5}}
    records = {
        "newer.json": ("2026-01-04", {"results": {"layer": runs}, "compiled": compiled}),
        "older.json": ("2026-01-03", {"results": {"layer": runs}}),
        "other.json": ("2026-01-05", {"results": {"layer": runs}}),
    }
    for name, (date, content) in records.items():
        command = "python -m benchmarks.lowering --compile" if name != "other.json" else "python -m something.else"
        with open(tmp_path / name, "w") as f:
            json.dump({"meta": meta(date, "5555555", command), **content}, f)
    lines = build(tmp_path).splitlines()
    section = lines[lines.index("## Kernel lowering and compile time: `python -m benchmarks.lowering`") :]
    provenance = [line for line in section if "`python -m" in line and line.startswith("2026")]
    assert [line.split(",")[0] for line in provenance] == ["2026-01-03", "2026-01-04"]  # not the other command's
    assert section.count("### layer") == 2 and section.count("### layer: compilation on the GPU") == 1
    assert "| moe_gmm | 1 | 1.25 |" in section and "| all 2 kernels | | 1.75 |" in section
    assert "| moe_gmm | 2.50 |" in section
    assert "| the program, its kernels compiled (XLA's own compilation) | 1.50 |" in section


def train_records(
    tokens_per_s: list[float], *, device_kind: str = GPU, validation_loss=None, devices: int = 1, dispatch=None
) -> list[dict]:
    setup = {
        "kind": "setup",
        "device_kind": device_kind,
        "backend": "pallas",
        "devices": devices,
        "parameters": {"total": 2_000_000, "active": 1_000_000},
        "config": {"batch_size": 8, "seq_len": 1024, "dispatch": dispatch},
        # MFU = tokens/s * 1e3 / (1e9 per device): tokens_per_s / 1e6 on one device.
        "training_flops_per_token": 1e3,
        "peak_flops": 1e9,
    }
    intervals = [
        {
            "kind": "train",
            "step": 20 * (i + 1),
            "loss": 3.0 - 0.5 * i,
            "tokens_per_s": t,
            "mfu": t / 1e6,
            "peak_memory_bytes": 1e9,
        }
        for i, t in enumerate(tokens_per_s)
    ]
    final = (
        []
        if validation_loss is None
        else [{"kind": "final", "step": 20 * len(intervals), "validation_loss": validation_loss}]
    )
    return [setup, {"kind": "compile", "step": 1, "seconds": 12.5}, *intervals, *final]


def test_training_section_takes_medians_past_the_first_interval_of_every_pair_newest_first(tmp_path):
    for run, speed in (("2026-01-01_h100_aaaaaaa", 1.0), ("2026-01-02_h100_bbbbbbb", 2.0)):
        for backend, factor in (("xla", 1.0), ("pallas", 3.0)):
            # The first interval holds the warm-up and is left out: the median of the rest is the middle one.
            records = train_records([1.0, 100.0 * speed * factor, 300.0 * speed * factor, 200.0 * speed * factor])
            with open(tmp_path / f"{run}_train_gpu_{backend}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    # An FP8 run beside the newest pair is a third row, with its validation loss.
    with open(tmp_path / "2026-01-02_h100_bbbbbbb_train_gpu_pallas-fp8_block.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train_records([1.0, 500.0, 700.0, 600.0], validation_loss=1.25))
    # A pallas run without its xla partner is not a comparison, nor is an FP8 run alone.
    for backend in ("pallas", "pallas-fp8_block"):
        with open(tmp_path / f"2026-01-03_h100_ccccccc_train_gpu_{backend}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in train_records([5.0, 5.0]))
    text = build(tmp_path)
    newest, older = (
        text.index(f"{date}, {GPU}, git {git}") for date, git in (("2026-01-02", "bbbbbbb"), ("2026-01-01", "aaaaaaa"))
    )
    assert newest < older and "ccccccc" not in text
    assert table_rows(text, "2026-01-01, " + GPU)[1] == ["pallas", "600", "0.0006", "1.00", "12.5", "80", "1.5000", "-"]
    rows = table_rows(text, "2026-01-02, " + GPU)
    assert rows == [
        ["xla", "400", "0.0004", "1.00", "12.5", "80", "1.5000", "-"],
        ["pallas", "1200", "0.0012", "1.00", "12.5", "80", "1.5000", "-"],
        ["pallas-fp8_block", "600", "0.0006", "1.00", "12.5", "80", "1.5000", "1.2500"],
    ]


def test_expert_parallel_runs_get_their_own_table_with_mfu_over_every_device(tmp_path):
    for name, devices in (
        ("2026-01-02_h100_bbbbbbb_train_gpu_xla", 1),
        ("2026-01-02_h100_bbbbbbb_train_gpu_pallas", 1),
    ):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in train_records([1.0, 100.0, 100.0], devices=devices))
    with open(tmp_path / "2026-01-03_h100x4_ccccccc_train_gpu_ep4-all_gather.jsonl", "w") as f:
        records = train_records([1.0, 400.0, 600.0, 500.0], devices=4, validation_loss=1.5)
        f.writelines(json.dumps(r) + "\n" for r in records)
    text = build(tmp_path)
    section = text[text.index("## Expert-parallel training") :]
    assert "ccccccc" not in text[: text.index("## Expert-parallel training")]
    # Medians past the first interval; MFU over four devices' peak.
    assert "| 2026-01-03 | git ccccccc | 4 x " + GPU + " | all_gather | 500 | 0.0001 |" in section


def test_cli_writes_the_report_where_asked(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", (meta("2026-01-01", "4444444", "cli"), [record("a", "dense", 1.0)]))
    out = tmp_path / "RESULTS.md"
    assert main(["--report", str(tmp_path), "--report-out", str(out)]) == []
    text = out.read_text()
    assert text.startswith("# Benchmark results")
    assert common.FLOP_MODEL in text and table_rows(text, "2026-01-01")[0][2] == "dense"


def test_notes_follow_the_tables_newest_first_under_one_section(tmp_path):
    (tmp_path / "2026-01-01_gpu_aaaaaaa_x_ab.md").write_text("# Old A/B\n\n| a | 1.0 |\n")
    (tmp_path / "2026-01-02_gpu_bbbbbbb_y_ab.md").write_text("# New A/B\n\n## Details\n\n| b | 2.0 |\n")
    text = report.build_report(str(tmp_path), {}, {}, [])
    section = text[text.index("## Comparisons recorded as notes") :]
    assert section.index("### New A/B") < section.index("#### Details") < section.index("### Old A/B")
    assert "| b | 2.0 |" in section and "Record `2026-01-01_gpu_aaaaaaa_x_ab.md`." in section
    assert "\n# Old A/B" not in text


def test_report_out_needs_report():
    with pytest.raises(SystemExit, match="--report-out"):
        main(["--report-out", "x.md"])


def test_committed_results_are_the_report_of_the_committed_records(tmp_path):
    out = tmp_path / "RESULTS.md"
    main(["--report", report.RESULTS_DIR, "--report-out", str(out)])
    with open(report.REPORT_PATH) as f:
        committed = f.read()
    assert out.read_text() == committed, "benchmarks/RESULTS.md is stale: run `python -m benchmarks --report`"


def test_short_revision_keeps_the_suffix():
    assert report.short_revision("de9ff708846d85aad33001d0450e486a768fcb8c-dirty") == "de9ff70-dirty"
    assert report.short_revision("89de3b0+h") == "89de3b0+h"
    assert report.short_revision("unknown") == "unknown"
    assert os.path.basename(report.REPORT_PATH) == "RESULTS.md"
