"""compile_report's runs: what a run wrote is read back however it ended, and the budget bounds every process."""

import json

from train import compile_report
from train.compile_report import Budget, layer_compile_times, train_run


def test_a_run_the_budget_no_longer_covers_is_skipped(tmp_path):
    result = train_run("cold", ["--config", "tiny"], tmp_path, Budget(0), limit=100)
    assert result["status"].startswith("skipped")
    assert not list(tmp_path.iterdir())  # nothing was launched


def test_a_run_stopped_after_its_first_step_still_reports_it(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_report, "run_process", lambda *args: ("timed out after 5 s", None))
    compile_record = {"kind": "compile", "trace_s": 1.0, "lower_s": 2.0, "compile_s": 3.0, "first_step_s": 0.5}
    compile_record |= {"aot": "saved", "seconds": 6.5, "unix_time": 4e9}
    (tmp_path / "pallas_cold_cache.jsonl").write_text(json.dumps({"kind": "setup"}) + "\n" + json.dumps(compile_record))
    result = train_run("pallas cold cache", [], tmp_path, Budget(100), limit=100)
    assert result["status"] == "timed out after 5 s"
    assert (result["time_to_first_step_s"], result["aot"], result["lower_s"]) == (6.5, "saved", 2.0)
    assert result["launch_to_first_step_s"] > 0
    assert "tokens_per_s" not in result  # no interval was logged


def test_the_layer_probe_times_each_phase():
    layer = dict(tokens=64, d_model=32, d_ff=16, num_experts=4, top_k=2, score="softmax")
    times = layer_compile_times(layer, "xla")
    assert all(times[k] > 0 for k in ("trace_s", "lower_s", "compile_s"))
    assert times["total_s"] == times["trace_s"] + times["lower_s"] + times["compile_s"]


def test_the_xla_run_trains_its_own_config(tmp_path, monkeypatch):
    """The XLA backend's run takes --xla-config (gpu by default, where it fits one GPU), its config's micro-batches
    unless --xla-grad-accum says otherwise, and names its config in the report."""
    commands = []

    def run_process(command, *args):
        commands.append(command)
        return "failed", None

    monkeypatch.setattr(compile_report, "run_process", run_process)
    compile_report.main(["--out", str(tmp_path / "report.json")])
    xla = commands[-1]
    assert xla[xla.index("--config") + 1] == "gpu" and xla[xla.index("--backend") + 1] == "xla"
    assert "--grad-accum" not in xla
    record = json.loads((tmp_path / "report.json").read_text())
    assert record["results"]["runs"][-1]["run"] == "xla, --config gpu"
    compile_report.main(["--out", str(tmp_path / "again.json"), "--xla-config", "tiny", "--xla-grad-accum", "2"])
    xla = commands[-1]
    assert xla[xla.index("--config") + 1] == "tiny" and xla[xla.index("--grad-accum") + 1] == "2"
