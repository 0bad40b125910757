"""The benchmark CLI's CPU smoke run (``--tiny``) and the harness pieces it rests on: FLOP model, timer, failures."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import pytest

import moe_jax
from benchmarks import common, grouped_matmul, routing
from benchmarks.__main__ import main
from benchmarks.shapes import GMM_SHAPES, GroupedMatmulShape
from tests.helpers import virtual_devices_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLOP_BENCHES = {"gmm", "gmm-bwd", "skew", "layer", "layer-bwd", "glu", "glu-bwd", "glu-mlp"}
BENCHES = FLOP_BENCHES | {"routing", "ep", "ep-bwd", "quant"}  # routing, quant: no FLOP model; ep: a table of its own
# Off the tuned table with 1024 rows per group: the heuristic's fwd / dgrad walk group bands in step.
LARGE_GROUPS_SHAPE = GroupedMatmulShape("layer/gate_up", g=32, m=32768, k=1024, n=1024, tag="ci")


def run_cli(out_dir, *args: str, env: dict | None = None) -> tuple[str, dict, list[dict]]:
    """Runs ``python -m benchmarks --tiny ARGS`` as a user would (``env`` added to the environment); returns stdout,
    the JSON and the JSONL lines."""
    json_path, jsonl_path = str(out_dir / "run.json"), str(out_dir / "run.jsonl")
    command = [sys.executable, "-m", "benchmarks", "--tiny", *args, "--out", json_path, "--jsonl", jsonl_path]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(json_path) as f:
        data = json.load(f)
    with open(jsonl_path) as f:
        lines = [json.loads(line) for line in f]
    return result.stdout, data, lines


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Every bench at one ci shape with the XLA backend (kernels run under the slow GPU interpreter on CPU: below)."""
    return run_cli(
        tmp_path_factory.mktemp("bench"),
        *("--shapes", "ci/ragged", "--skew-shapes", "ci/ragged", "--routing-shapes", "ci/layer", "--backends", "xla"),
    )


def test_prints_a_markdown_table_per_bench(tiny_run):
    stdout, _, _ = tiny_run
    for title in ("Grouped matmul, forward", "Grouped matmul, forward + backward", "moe_ffn layer, forward"):
        assert f"### {title}" in stdout
    assert "skewed routings" in stdout
    assert stdout.count(common.TABLE_HEADER[0]) == len(FLOP_BENCHES)
    assert "| ci/ragged | uniform | moe_jax:xla |" in stdout
    assert "### Routing glue" in stdout and "| shape | stage | moe_jax:xla ms |" in stdout
    for stage in routing.STAGES:
        assert f"| ci/layer | {stage} | " in stdout
    assert common.FLOP_MODEL in stdout


def test_json_records_every_bench_with_metadata(tiny_run):
    _, data, lines = tiny_run
    meta = data["meta"]
    for key in ("date", "device_kind", "jax", "jaxlib", "git_revision", "command", "flop_model"):
        assert meta[key], key
    assert meta["command"].startswith("python -m benchmarks --tiny")
    assert {r["bench"] for r in data["records"]} == BENCHES
    # The streamed JSONL holds the same records, after one metadata line.
    assert lines[0] == {"meta": meta}
    assert lines[1:] == data["records"]


def test_baselines_and_xla_backend_have_positive_numbers(tiny_run):
    _, data, _ = tiny_run
    xla = ("dense", "ragged_dot", "moe_jax:xla")
    timed = [r for r in data["records"] if r["impl"] in xla or r["impl"].endswith(":xla")]  # glu: "<what>:xla"
    assert {r["bench"] for r in timed} == BENCHES
    for r in timed:
        assert r["status"] == "ok", r
        if r["bench"] in ("routing", "quant"):  # no FLOP model: milliseconds only
            assert r["flops"] == 0 and r["tflops"] is None
            assert r["bench"] == "quant" or r["stage"] in routing.STAGES
        else:
            assert r["flops"] > 0 and r["tflops"] > 0
        timing = r["timing"]
        assert 0 < timing["min_s"] <= timing["median_s"] <= timing["p90_s"]
        assert timing["samples"] >= 1 and timing["reps"] >= 1


def test_checks_agree_with_the_oracle(tiny_run):
    _, data, _ = tiny_run
    gmm_benches = {"gmm", "gmm-bwd", "skew"}
    checked = [r for r in data["records"] if r["impl"] in ("ragged_dot", "moe_jax:xla") and r["bench"] in gmm_benches]
    assert {r["bench"] for r in checked} == gmm_benches
    for r in checked:
        assert r["checked_against"].startswith("f32 oracle"), r
        assert len(r["rel_err_leaves"]) == (3 if r["bench"] == "gmm-bwd" else 1)
        # bf16 operands, f32 accumulation, bf16 outputs: a few 1e-3.
        assert 0 < r["rel_err"] < 1e-2, r


def test_glu_benches_check_every_output_and_print_the_targets(tiny_run):
    stdout, data, _ = tiny_run
    glu = [r for r in data["records"] if r["bench"] in ("glu", "glu-bwd", "glu-mlp")]
    assert {r["impl"] for r in glu if r["bench"] == "glu"} == {
        "dense",
        "tokamax+xla-glu",
        "gemm:xla",
        "gemm+xla-glu:xla",
        "fused:xla",
    }
    assert {r["impl"] for r in glu if r["bench"] == "glu-bwd"} == {"tokamax-gemms", "unfused:xla", "fused:xla"}
    for r in glu:
        assert r["shape"] == "ci swiglu" and r["dims"]["activation"] == "swiglu", r
        if r["impl"].endswith(":xla"):
            assert r["checked_against"].startswith("f32"), r
            assert len(r["rel_err_leaves"]) == (1 if r["bench"] == "glu" else 5)  # y and four gradients
            assert 0 < r["rel_err"] < 1e-2, r
    assert "### GLU targets (xla)" in stdout and "| ci swiglu | swiglu | " in stdout


def test_missing_peer_is_reported_not_raised(tiny_run):
    _, data, _ = tiny_run
    for r in data["records"]:
        if r["impl"].startswith("tokamax"):
            assert r["status"] == "n/a" and r["note"], r  # no tokamax / no GPU here
        else:
            assert r["status"] == "ok", r


def test_shape_options_take_names_and_tags():
    """The benchmarks' and the tuner's shape options take names and tags (common.named_shapes); a tag stands for the
    shapes the bench would take of it (--glu-shapes: the <model>/gate_up ones); anything else is refused, naming it."""
    from benchmarks import glu, shapes

    heuristic = shapes.gmm_shapes("heuristic")
    chosen = common.named_shapes("heuristic,ci/ragged", GMM_SHAPES, shapes.gmm_shapes, [])
    assert chosen == [*heuristic, GMM_SHAPES["ci/ragged"]]
    assert common.named_shapes("heuristic", GMM_SHAPES, glu.glu_shapes, []) == [
        s for s in heuristic if s.name.endswith("/gate_up")
    ]
    assert common.named_shapes("bench", shapes.LAYER_SHAPES, shapes.layer_shapes, []) == shapes.layer_shapes("bench")
    assert common.named_shapes(None, GMM_SHAPES, shapes.gmm_shapes, ["default"]) == ["default"]
    with pytest.raises(SystemExit, match=r"unknown shape\(s\) \['gpt-oss'\]"):
        common.named_shapes("ci/ragged,gpt-oss", GMM_SHAPES, shapes.gmm_shapes, [])


def test_pallas_backend_is_picked_up(tmp_path):
    """The harness times moe_jax.grouped_matmul(backend="pallas"): the sm90 kernel, here under the interpreter."""
    _, data, _ = run_cli(
        tmp_path, "--bench", "gmm", "--shapes", "ci/ragged", "--backends", "pallas", "--baselines", "dense"
    )
    (record,) = [r for r in data["records"] if r["impl"] == "moe_jax:pallas"]
    assert record["status"] == "ok" and record["tflops"] > 0, record
    assert record["rel_err"] < 1e-2, record


def test_expert_parallel_bench_over_two_devices(tmp_path):
    """--bench ep on two virtual CPU devices: one device, data parallel and both dispatches (the all-to-all by the
    slots and owners exchanges, --ep-exchanges), uniform and skewed routing; checked against data parallelism, with
    bytes per token, skew, overflowed rows and memory, and tabled."""
    stdout, data, _ = run_cli(
        tmp_path,
        "--bench",
        "ep",
        "--backends",
        "xla",
        "--layer-shapes",
        "ci/layer",
        "--ep-exchanges",
        "slots,owners",
        env={"XLA_FLAGS": virtual_devices_flags(2)},
    )
    parallel = ("dp2:xla", "ep2-all_gather:xla", "ep2-all_to_all-slots:xla", "ep2-all_to_all-owners:xla")
    expected = [("uniform", "moe_jax:xla")] + [
        (routing, impl) for routing in ("uniform", "skewed") for impl in parallel
    ]
    assert sorted((r["bench"], r["routing"], r["impl"]) for r in data["records"]) == sorted(
        (bench, *case) for bench in ("ep", "ep-bwd") for case in expected
    )
    for r in data["records"]:
        assert r["status"] == "ok" and r["timing"]["median_s"] > 0, r
        assert r["dims"]["devices"] == (1 if r["impl"] == "moe_jax:xla" else 2)
        assert r["dims"]["memory"]["temp"] > 0, r
        traffic = r["dims"]["bytes_per_token"]
        row = 2 * 128 * 2 + 8  # a routed row there and back (D = 128, bf16) and its 8 bytes of weight and expert id
        if r["impl"].startswith("ep2-all_to_all-owners"):
            # One slot of tokens (each with 8 bytes per k) to the other device; its padded fallback's on overflow.
            assert traffic["ideal"] <= traffic["sent"] and "overflowed_rows" in r["dims"], r
        if r["impl"].startswith("ep2-all_to_all-slots"):
            # One slot of ceil(1.25 * T_dev * k / 2) rows to the other device; the padded exchange's too on overflow.
            tokens = r["dims"]["tokens_per_device"]
            slot = -(-5 * tokens * 2 // 8)
            fallback = tokens * 2 if r["dims"]["overflowed_rows"] else 0
            assert traffic["sent"] == pytest.approx(row * (slot + fallback) / tokens), r
        if r["impl"].startswith("ep2"):
            assert r["dims"]["skew"] >= 1.0, r
        if r["impl"].startswith("ep2"):
            assert r["checked_against"] == "dp2:xla", r
            # forward + backward: y and 4 gradients, bf16 (summed in another order).
            assert len(r["rel_err_leaves"]) == (5 if r["bench"] == "ep-bwd" else 1) and r["rel_err"] < 1e-2, r
    assert "| shape | routing | devices | impl | ms | tokens/s per device | vs one device |" in stdout
    assert "| ci/layer | uniform | 2 | ep2-all_to_all-slots:xla |" in stdout


def test_routing_kernels_side_by_side_with_xla(tmp_path):
    """--tiny's routing bench on both backends at ci/grouped (sigmoid, groups, bias, scale), checked against xla.

    route (exact selection) and glue-bwd (every kernel, forward and backward) only: the interpreter takes seconds per
    kernel call."""
    stages = ("route", "glue-bwd")
    stdout, data, _ = run_cli(
        tmp_path, "--bench", "routing", "--backends", "xla,pallas", "--routing-stages", ",".join(stages)
    )
    records = data["records"]
    assert {(r["stage"], r["impl"]) for r in records} == {
        (stage, f"moe_jax:{backend}") for stage in stages for backend in ("xla", "pallas")
    }
    for r in records:
        assert r["status"] == "ok" and r["shape"] == "ci/grouped" and r["timing"]["median_s"] > 0, r
        if r["impl"] == "moe_jax:pallas":
            assert r["checked_against"].startswith("moe_jax:xla: integer outputs equal"), r
            # f32 routing exact to a few ulps; a bf16 output of the glue may round one element the other way.
            assert r["rel_err"] < 1e-4, r
    (route,) = [r for r in records if r["stage"] == "route" and r["impl"] == "moe_jax:pallas"]
    assert route["checked_against"].endswith("probs, selected_scores, weights")
    assert "| ci/grouped | glue-bwd | " in stdout and "equal, rel err <= " in stdout


def test_routing_check_names_unequal_integer_outputs():
    expected = {"experts": jnp.array([[0, 1], [2, 3]]), "weights": jnp.array([1.0, 2.0])}
    actual = {"experts": jnp.array([[0, 1], [3, 2]]), "weights": jnp.array([1.0, 2.0 + 2e-3])}
    names, errors, unequal = routing.compare(actual, expected)
    assert names == ["weights"] and errors[0] == pytest.approx(2e-3 / 5**0.5, rel=1e-3)
    assert unequal == "experts: 2 of 4 entries differ"
    assert routing.compare(expected, expected)[2] == ""


def test_hbm_floor_is_the_bytes_at_the_measured_read_rate(tiny_run):
    _, data, _ = tiny_run
    floors = [r for r in data["records"] if r["impl"] == "hbm-floor" and r["bench"] != "quant"]  # quant: its own
    assert {r["bench"] for r in floors} == {"gmm", "gmm-bwd", "skew"}  # bytes (tests/benchmarks/test_quant_bench.py)
    for r in floors:
        assert r["status"] == "ok" and r["timing"]["median_s"] > 0, r
        shape = GMM_SHAPES[r["shape"]]
        num_bytes = grouped_matmul.hbm_floor_bytes(shape, backward=r["bench"] == "gmm-bwd")
        gigabytes, rate = re.match(r"([\d.e+-]+) GB at ([\d.e+-]+) TB/s, the read rate", r["note"]).groups()
        assert float(gigabytes) == pytest.approx(num_bytes / 1e9, rel=1e-2)
        assert r["timing"]["median_s"] == pytest.approx(num_bytes / (float(rate) * 1e12), rel=1e-2)
    shape = GroupedMatmulShape("floor", g=2, m=8, k=16, n=32, tag="ci")
    assert grouped_matmul.hbm_floor_bytes(shape, backward=False) == 2 * (2 * 16 * 32 + 8 * 16 + 8 * 32)
    assert grouped_matmul.hbm_floor_bytes(shape, backward=True) == 3 * 2 * (2 * 16 * 32 + 8 * 16 + 8 * 32)


def test_flop_model():
    assert common.gmm_flops(8, 16, 32, backward=False) == 2 * 8 * 16 * 32
    assert common.gmm_flops(8, 16, 32, backward=True) == 3 * 2 * 8 * 16 * 32
    t, d, f, e, k = 16, 32, 8, 4, 2
    forward = 2 * t * d * e + 2 * t * k * d * 2 * f + 2 * t * k * f * d
    assert common.moe_ffn_flops(t, d, f, e, k, backward=False) == forward
    assert common.moe_ffn_flops(t, d, f, e, k, backward=True) == 3 * forward


def test_timer_rotates_input_sets_and_returns_the_first_output():
    used = []

    def fn(x):
        used.append(int(x[0]))
        return x * 2

    sets = [(jnp.full((4,), i, jnp.float32),) for i in range(3)]
    timing, first = common.time_fn(fn, sets, iters=5, warmup=1, max_seconds=10.0, min_sample_seconds=0)
    assert first.tolist() == [0.0] * 4
    assert set(used) == {0, 1, 2}
    assert timing.samples == 5 and timing.reps == 1
    assert 0 < timing.min_s <= timing.p10_s <= timing.median_s <= timing.p90_s


def test_timings_say_which_timer_took_them():
    timing, _ = common.time_fn(lambda x: x + 1, [(jnp.ones(4),)], iters=2, warmup=0, max_seconds=1.0)
    assert timing.timer == "wall"
    # A record streamed before the option existed has no "timer": its samples were the wall clock's.
    data = {**dataclasses.asdict(timing)}
    del data["timer"]
    assert common.Timing(**data).timer == "wall"


def test_kernel_events_are_cut_into_equal_calls():
    events = [("gemm", 300, 5), ("glu", 100, 4), ("gemm", 0, 5), ("glu", 400, 4)]  # two calls, out of start order
    calls = common.split_calls(events, 2)
    assert calls == [[("gemm", 0, 5), ("glu", 100, 4)], [("gemm", 300, 5), ("glu", 400, 4)]]
    with pytest.raises(RuntimeError, match="3 GPU kernel events for 2 calls"):
        common.split_calls(events[:3], 2)
    with pytest.raises(RuntimeError, match="0 GPU kernel events"):
        common.split_calls([], 2)


def test_device_timer_is_used_when_chosen_and_needs_a_gpu():
    # Off a GPU the trace holds no kernel: the device timer fails where the wall clock would have timed the call, so
    # a measurement with timer="device" that came back "ok" would mean the option was not passed down.
    record = common.Record("gmm", "ci/ragged", "uniform", "dense", flops=1, dims={})
    common.measure(record, jax.jit(lambda x: x @ x), [(jnp.ones((8, 8)),)], common.Options(timer="device", iters=2))
    assert record.status == "error" and "GPU kernel events" in record.note

    with pytest.raises(SystemExit, match="--timer device reads GPU kernel times"):
        main(["--tiny", "--bench", "gmm", "--timer", "device"])


def test_input_sets_rotate_only_below_the_l2_bound():
    assert common.input_sets_needed(common.ROTATE_BYTES * 4) == 1
    assert common.input_sets_needed(common.ROTATE_BYTES // 4) == 4
    assert common.input_sets_needed(1) == common.MAX_INPUT_SETS


@pytest.mark.parametrize(
    "error, status",
    [
        (NotImplementedError("grouped_matmul: no Pallas Mosaic GPU kernel exists yet"), "n/a"),
        (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 24.00GiB"), "OOM"),
        (ValueError("Mosaic GPU kernel exceeds available shared memory"), "error"),
    ],
)
def test_failures_are_classified(error, status):
    assert common.classify_failure(error)[0] == status


def test_measurements_past_the_time_limit_are_skipped():
    def never_called(*_):
        raise AssertionError("called past the deadline")

    record = common.Record("gmm", "ci/ragged", "uniform", "dense", flops=1, dims={})
    options = common.Options(deadline=0.0)  # perf_counter() is already past 0
    assert common.measure(record, never_called, [()], options) is None
    assert record.status == "skipped" and record.timing is None


def test_records_of_older_runs_load_with_defaults():
    record = common.Record("gmm", "ci/ragged", "uniform", "dense", flops=8, dims={"m": 2})
    data = record.to_json()
    for missing in ("timing", "rel_err_leaves", "checked_against", "config"):
        del data[missing]
    assert common.Record.from_json(data) == record


def test_render_reprints_a_streamed_run(tmp_path, capsys):
    meta = {
        "date": "2026-01-01T00:00:00+00:00",
        "device_kind": "cpu",
        "platform": "cpu",
        "jax": "0",
        "jaxlib": "0",
        "git_revision": "abc",
        "command": "python -m benchmarks",
        "peers": {"tokamax": "absent"},
        "flop_model": common.FLOP_MODEL,
    }
    timing = common.Timing(2e-3, 1e-3, 3e-3, 1e-3, samples=5, reps=1, first_call_s=0.5)
    records = [
        common.Record("gmm", "ci/ragged", "-", "dense", flops=4 * 10**9, dims={}, timing=timing),
        common.Record(
            "gmm",
            "ci/ragged",
            "uniform",
            "moe_jax:pallas",
            flops=4 * 10**9,
            dims={},
            status="OOM",
            note="Out of memory while trying to allocate 1GiB",
        ),
    ]
    fast = common.Timing(1e-3, 5e-4, 1.5e-3, 5e-4, samples=5, reps=2, first_call_s=0.5)
    records += [
        common.Record("routing", "qwen3-30b-a3b", "router", "moe_jax:xla", 0, {}, timing=timing, stage="route"),
        common.Record(
            "routing",
            "qwen3-30b-a3b",
            "router",
            "moe_jax:pallas",
            0,
            {},
            status="wrong",
            note="experts: 3 of 131072 entries differ",
            timing=fast,
            stage="route",
        ),
    ]
    stream = common.JsonlWriter(str(tmp_path / "run.jsonl"))
    stream.write({"meta": meta})
    for record in records:
        stream.write(record.to_json())
    assert main(["--render", str(tmp_path / "run.jsonl")]) == records
    stdout = capsys.readouterr().out
    assert "| ci/ragged | - | dense | 4.0 | 2.000 | 100% | 2.0 | 1.00 |  |" in stdout
    assert "| moe_jax:pallas | 4.0 | OOM: Out of memory while trying to allocate 1GiB |" in stdout
    assert "| qwen3-30b-a3b | route | 2.000 (100%) | 1.000 (100%) | 2.00x | WRONG: experts: 3 of 131072" in stdout


def test_glu_memory_table_counts_what_the_backward_keeps():
    """``python -m benchmarks.glu``'s table, at the ci layer: traced only, so exact byte counts."""
    from benchmarks import glu, shapes

    layer = shapes.LAYER_SHAPES["ci/layer"]
    m, d, d_ff, e = layer.m, layer.d, layer.f, layer.e
    kept = glu.kept_for_backward(layer)

    def activation_bytes(name):
        return common.nbytes([aval for _, aval in kept[name][0]])

    # fused: x, the packed pre-activation [M, 2F] in bf16, row_scale, group_sizes; recompute: all but the second.
    assert activation_bytes("fused (glu_mlp)") == 2 * m * d + 2 * m * 2 * d_ff + 4 * m + 4 * e
    assert activation_bytes("fused, recompute_gate_up") == 2 * m * d + 4 * m + 4 * e
    assert [source for source, _ in kept["fused (glu_mlp)"][0]].count("computed") == 1
    for name, (_, weights) in kept.items():
        assert weights == ["w_down", "w_gate_up"], name
        assert activation_bytes(name) >= activation_bytes("fused, recompute_gate_up"), name
    table = glu.memory_table(layer)
    assert table.count("\n| ") == len(kept) + 1 and "fused, recompute_gate_up" in table


def test_layer_memory_table_keeps_tokens_not_rows():
    """The layer's table at the ci layer (F doubled): bf16 and FP8 keep the same per-token arrays (x [T, D] in bf16,
    not its k permuted rows; no f32 copy of x for the router's gradient) but the packed pre-activation [M, 2F]: bf16,
    or with FP8 its e4m3 values and one f32 scale per row and 128 columns, and the FP8 weight copies are left out."""
    from benchmarks import glu, shapes

    layer = dataclasses.replace(shapes.LAYER_SHAPES["ci/layer"], f=128)  # 2F = 256 apart from D = 128
    kept = {q: glu.layer_kept_for_backward(layer, q) for q in (None, "fp8_block")}
    pre_activation = {None: [((layer.m, 2 * layer.f), "bfloat16")]}
    pre_activation["fp8_block"] = [
        ((layer.m, 2 * layer.f), "float8_e4m3fn"),
        ((layer.m, 2 * layer.f // 128), "float32"),
    ]
    for quantization, arrays in kept.items():
        shapes_kept = [(aval.shape, aval.dtype.name) for _, aval in arrays]
        assert ((layer.t, layer.d), "bfloat16") in shapes_kept, quantization
        for kept_pre in pre_activation[quantization]:
            assert kept_pre in shapes_kept, quantization
        assert not any(shape == (layer.m, layer.d) for shape, _ in shapes_kept), quantization
        assert not any(shape == (layer.t, layer.d) and dtype == "float32" for shape, dtype in shapes_kept), quantization
    assert ((layer.m, 2 * layer.f), "bfloat16") not in [(a.shape, a.dtype.name) for _, a in kept["fp8_block"]]
    bf16_bytes, fp8_bytes = (common.nbytes([a for _, a in kept[q]]) for q in (None, "fp8_block"))
    # The pre-activation, 75 % of the bf16 layer's bytes here, halves (plus an f32 scale per 128 values); both keep
    # the same routing arrays (the FP8 path's combine runs inside its kernels' VJP, from the MLP's residuals).
    saved = layer.m * 2 * layer.f * (1 - 4 / 128)
    assert fp8_bytes == bf16_bytes - saved
    assert "| fp8_block |" in glu.layer_memory_table(layer)


def test_layer_composition_matches_moe_ffn_on_packed_weights():
    """The tokamax-gemms composition (here over the reference grouped matmul) computes moe_ffn's layer from the same
    packed input set, and the pallas layer reads those weights as stored: no transpose of a weight-sized array in its
    trace (a plain [gate | up] array would be repacked there on every call)."""
    from benchmarks import layer, shapes
    from moe_jax.ops.grouped_matmul import reference as gmm_reference

    shape = shapes.LAYER_SHAPES["ci/layer"]
    inputs = layer.make_inputs(shape, seed=3)[0]
    args = [inputs[name] for name in ("x", "router_kernel", "w_gate_up", "w_down")]
    assert isinstance(inputs["w_gate_up"], moe_jax.PackedGateUp)
    route_kwargs = common.routing_kwargs(shape, seed=3)
    composed = layer.moe_ffn_with_gmm(
        gmm_reference.grouped_matmul, *args, activation=shape.activation, route_kwargs=route_kwargs
    )
    layer_fn = common.moe_ffn_layer(shape, "xla", route_kwargs)
    expected = layer_fn(*args)
    for actual, exact in zip(jax.tree.leaves(composed), jax.tree.leaves(expected), strict=True):
        assert common.relative_errors(actual, exact)[0] < 1e-2

    def transposed_sizes(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "transpose":
                yield eqn.outvars[0].aval.size
            for inner in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from transposed_sizes(inner)

    pallas_layer = common.moe_ffn_layer(shape, "pallas", route_kwargs)
    weight_size = inputs["w_gate_up"].array.size
    assert max(transposed_sizes(jax.make_jaxpr(pallas_layer)(*args).jaxpr), default=0) < weight_size


def test_best_tokamax_config_comes_from_the_forward_sweep_of_that_shape():
    """gmm-bwd and skew time tokamax with its best *forward* config: a faster fwd+bwd record or another shape's
    sweep must not be picked."""

    def record(bench, shape, config, median_s):
        timing = common.Timing(median_s, median_s, median_s, median_s, samples=3, reps=1, first_call_s=1.0)
        return common.Record(bench, shape, "uniform", "tokamax", flops=1, dims={}, timing=timing, config=config)

    records = [
        record("gmm", "a", None, 1e-3),  # the default config: not a swept one
        record("gmm", "a", {"block_n": 64}, 3e-3),
        record("gmm", "a", {"block_n": 128}, 2e-3),
        record("gmm", "b", {"block_n": 256}, 1e-4),
        record("gmm-bwd", "a", {"block_n": 64}, 1e-5),
    ]
    assert grouped_matmul.best_tokamax_config(records, "a") == {"block_n": 128}
    assert grouped_matmul.best_tokamax_config(records, "c") is None


def test_git_revision_prefers_the_declared_commit(monkeypatch):
    """A tree copied to the GPU machine may carry a stale .git: the declared commit must win over it."""
    monkeypatch.setenv("MOE_JAX_GIT_REVISION", "db33ef4")
    assert common.git_revision() == "db33ef4"
    monkeypatch.delenv("MOE_JAX_GIT_REVISION")
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", common.git_revision())


def test_tuner_config_specs_round_trip_and_table_variants():
    from benchmarks import tune_grouped_matmul as tune
    from moe_jax.ops.grouped_matmul.config import Config

    shape = LARGE_GROUPS_SHAPE
    specs = (Config(), Config(block_n=128, num_stages=6), Config(overlap_epilogue=True))
    for config in (*specs, Config(grid_minor="m", overlap_epilogue=True, keep_ctas_in_step=True)):
        assert tune.parse_config(tune.label(config))("fwd", shape) == config
    table = tune.parse_config("table")("fwd", shape)
    assert table == tune.table_config("fwd", shape)
    replaced = tune.parse_config("table/grid_minor=n/grid_width=3/num_stages=3/overlap_epilogue=false")("fwd", shape)
    changed = {"grid_minor": "n", "grid_width": 3, "num_stages": 3, "overlap_epilogue": False}
    assert table.overlap_epilogue and replaced == Config(**{**vars(table), **changed})
    for spec in ("128x256x64s4e64", "table/block_q=64", "table/block_n", "table-c"):
        with pytest.raises(SystemExit, match="bad config"):
            tune.parse_config(spec)
    # The sweep's winner comes out as an entry of the tuned table's file.
    entry = json.loads(tune.tuned_entry("fwd", shape, table))
    key = (entry.pop("kind"), entry.pop("g"), entry.pop("m"), entry.pop("k"), entry.pop("n"))
    assert key == ("fwd", shape.g, shape.m, shape.k, shape.n) and Config(**entry.pop("config")) == table and not entry


def test_tuner_sweep_has_group_bands_in_step():
    """The sweep around the table's or the heuristic's config (itself a candidate) walks group bands with the CTAs in
    step (without that group bands re-read weights), the other orders as the base config does; wgrad, whose tiles are
    one group's, never walks group bands."""
    from benchmarks import tune_grouped_matmul as tune
    from moe_jax.ops.grouped_matmul import config

    # The heuristic in step (large groups), and the qwen3-30b table entry without it (small groups and weights).
    for shape in (LARGE_GROUPS_SHAPE, GMM_SHAPES["qwen3-30b/gate_up"]):
        for kind in ("fwd", "dgrad"):
            base = tune.table_config(kind, shape)
            candidates = tune.candidate_configs(kind, shape)
            assert config.GROUP_BANDS in candidates
            assert all(c.keep_ctas_in_step for c in candidates if c.grid_minor == "g" and c != base)
            assert all(c.keep_ctas_in_step == base.keep_ctas_in_step for c in candidates if c.grid_minor != "g")
    assert not tune.table_config("fwd", GMM_SHAPES["qwen3-30b/gate_up"]).keep_ctas_in_step
    assert all(c.grid_minor != "g" for c in tune.candidate_configs("wgrad", LARGE_GROUPS_SHAPE))


def test_tuner_sweeps_the_glu_backward_with_wide_tiles_through_the_ring():
    """glu_dgrad's sweep has 256-column tiles, which only the pipeline's ring can serve (their own [gate | up] buffer
    would be 512 columns): every candidate must pass the epilogue's check."""
    from benchmarks import tune_grouped_matmul as tune
    from moe_jax.ops.grouped_matmul import config, sm90

    epilogue = sm90.Epilogue(activation_grad=lambda gate, up, d_h: (gate, up, d_h), row_scale=True)
    candidates = tune.candidate_configs("glu_dgrad", GMM_SHAPES["qwen3-30b/down"])
    wide = [c for c in candidates if c.block_n == 256]
    assert wide and all(config.gate_up_ring_slots(c) == 4 for c in wide)
    for candidate in candidates:
        epilogue.check(candidate)
