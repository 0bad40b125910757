"""``python -m benchmarks --report``: ``benchmarks/RESULTS.md``, the current results, rebuilt from the records.

It reads every record under ``benchmarks/results/`` and writes, per bench and GPU, the newest measurement of each
shape: for each (bench, GPU, shape) the run that timed it last wins, runs in GPU kernel time (``--timer device``)
before wall-clock ones, since their numbers leave out the host's dispatch. A winning run's records of that shape are
shown as the run printed them (``TABLES`` of ``python -m benchmarks``), so every ratio in a table (vs dense, vs xla,
speed-up over one device) compares numbers of one run. Each table says which run it comes from: date, GPU, jax
version, git revision, timer and the command. The other kinds of record (kernel-by-kernel profiles, training
throughput, compile and lowering reports, step profiles) get a section each, in ``build_report``'s order.

Record files, by what their lines or keys hold:
  ``*.jsonl`` with ``{"meta"}`` lines   ``python -m benchmarks --jsonl``: each meta line starts a run, records follow
  ``*.json`` ``{meta, records}``        ``python -m benchmarks --out``
  ``*.json`` ``{meta, results}``        ``python -m benchmarks.profile_layer --out``
  ``*.json`` ``{meta, results}``        ``python -m train.compile_report`` and ``python -m train.profile_step``
  ``*.json`` ``{meta, results[, compiled]}`` ``python -m benchmarks.lowering --out``, told by its command
  ``*_train_gpu-moe*.jsonl``            ``python -m train --config gpu-moe --metrics``: one row per file
  ``*_train_gpu_<backend>.jsonl``       ``python -m train --metrics``: a run is a pair of files, xla and pallas, named
                                        ``<date>_<gpu>_<git>``; the records hold no date, so it comes from the name;
                                        ``pallas-fp8_block`` (``--quantization fp8_block``) joins a pair as a third row
Anything else (notes of one-off experiments) is not read.
"""

import dataclasses
import glob
import json
import os
import re
from collections.abc import Callable

from benchmarks import common, lowering
from train.metrics import steady_state

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPORT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
TIMER_WORDS = {"device": "GPU kernel time (CUPTI)", "wall": "wall clock"}
PROFILE_STAGES = ("router", "gating", "xla-glue", "permute", "gate_up", "down", "combine")
TRAIN_SUFFIX = "_train_gpu_"
TRAIN_BACKENDS = ("xla", "pallas")
TRAIN_VARIANTS = ("pallas-fp8_block",)  # optional rows beside a pair: same config, seed and data
# Expert-parallel training runs: <date>_<gpus>_<git>_train_gpu_ep<N>-<dispatch>.jsonl.
EXPERT_PARALLEL_RUN = re.compile(r"ep(\d+)-(\w+)")
# The kernel lowering bench's records are told apart from the other {meta, results} records by their command.
LOWERING_COMMAND = "python -m benchmarks.lowering"


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """One benchmark command's output: its metadata and records, and the file that holds them."""

    meta: dict
    records: tuple[common.Record, ...]
    path: str

    @property
    def timer(self) -> str:
        """How the run's samples were taken (all of one run's records share the timer)."""
        return next((r.timing.timer for r in self.records if r.timing), "wall")

    def provenance(self) -> str:
        """One line: date, GPU, jax version, git revision, timer, record file and command."""
        meta = self.meta
        gpus = (
            f"{meta['num_devices']} x {meta['device_kind']}" if meta.get("num_devices", 1) > 1 else meta["device_kind"]
        )
        return (
            f"{meta['date'][:10]}, {gpus}, jax {meta['jax']}, git {short_revision(meta['git_revision'])}, "
            f"{TIMER_WORDS[self.timer]}; "
            f"record `{os.path.basename(self.path)}`: `{meta['command']}`"
        )


def short_revision(revision: str) -> str:
    """A commit hash cut to 7 digits, its suffix (``-dirty``) kept."""
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]+", r"\1", revision)


def read_runs(path: str) -> list[Run]:
    """The benchmark runs in one record file (none where it holds something else)."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        runs: list[tuple[dict, list]] = []
        for line in lines:
            if "meta" in line:
                runs.append((line["meta"], []))
            elif "bench" in line and runs:
                runs[-1][1].append(common.Record.from_json(line))
        return [Run(meta, tuple(records), path) for meta, records in runs]
    with open(path) as f:
        content = json.load(f)
    if isinstance(content, dict) and "meta" in content and "records" in content:
        return [Run(content["meta"], tuple(common.Record.from_json(r) for r in content["records"]), path)]
    return []


def latest_runs(runs: list[Run]) -> dict[tuple[str, str], list[tuple[Run, list[common.Record]]]]:
    """Per (bench, GPU): the runs that measured some shape last, newest first, each with its records of those shapes
    (in the run's order). A device-timer run beats a wall-clock one whatever their dates."""
    winner: dict[tuple[str, str, str], int] = {}  # (bench, GPU, shape) -> index of the run
    for index, run in enumerate(runs):
        for record in run.records:
            key = (record.bench, run.meta["device_kind"], record.shape)
            if record.timing is not None and (key not in winner or _rank(run) > _rank(runs[winner[key]])):
                winner[key] = index
    shapes_of: dict[tuple[str, str], dict[int, set[str]]] = {}
    for (bench, gpu, shape), index in winner.items():
        shapes_of.setdefault((bench, gpu), {}).setdefault(index, set()).add(shape)
    sections = {}
    for (bench, gpu), by_run in sorted(shapes_of.items()):
        newest_first = sorted(by_run, key=lambda index: _rank(runs[index]), reverse=True)
        sections[(bench, gpu)] = [
            (runs[i], [r for r in runs[i].records if r.bench == bench and r.shape in by_run[i]]) for i in newest_first
        ]
    return sections


def _rank(run: Run) -> tuple[bool, str]:
    return run.timer == "device", run.meta["date"]


def bench_report(runs: list[Run], titles: dict[str, str], tables: dict[str, Callable]) -> list[str]:
    """Markdown of the benches, in ``titles``' order: a heading per (bench, GPU), a table per winning run."""
    sections = latest_runs(runs)
    lines = []
    for bench, title in titles.items():
        for gpu in sorted(g for b, g in sections if b == bench):
            lines += [f"## {title}: {gpu}", ""]
            for run, records in sections[(bench, gpu)]:
                lines += [run.provenance(), "", tables.get(bench, common.markdown_table)(records), ""]
    return lines


def read_result_files(paths: list[str]) -> list[tuple[dict, str]]:
    """(content, path) of every ``{meta, results}`` record among the JSON files at ``paths``."""
    found = []
    for path in paths:
        with open(path) as f:
            content = json.load(f)
        if isinstance(content, dict) and "meta" in content and "results" in content:
            found.append((content, path))
    return found


def read_records(paths: list[str], result_key: str) -> list[tuple[dict, dict, str]]:
    """(meta, result, path) of every result holding ``result_key`` in the ``{meta, results}`` records at ``paths``
    (``results`` a list of results, or one result): "stages_us" picks ``profile_layer``'s, "classes_us"
    ``profile_fp8_layer``'s, "runs" ``train.compile_report``'s, "parts_us" ``train.profile_step``'s."""
    found = []
    for content, path in read_result_files(paths):
        results = content["results"] if isinstance(content["results"], list) else [content["results"]]
        found += [(content["meta"], result, path) for result in results if result_key in result]
    return found


def fp8_profile_report(profiles: list[tuple[dict, dict, str]]) -> list[str]:
    """Every FP8 layer profile, kernel time by class (``benchmarks.profile_fp8_layer``)."""
    if not profiles:
        return []
    lines = [
        "## FP8 moe_ffn (pallas), kernel time by class: `python -m benchmarks.profile_fp8_layer`",
        "",
        "GPU kernel time per call, µs (median over the calls); the classes are the module docstring's.",
        "",
        "| GPU | shape | pass | quantization | total | gemm | quantize | layout | other | record |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for meta, result, path in profiles:
        classes = result["classes_us"]
        cells = [meta["device_kind"], result["shape"], "fwd+bwd" if result["backward"] else "fwd"]
        # A result without "weights" is one whose FP8 layer quantized its weights in the call.
        stored = ", stored weights" if result.get("weights") == "stored" else ""
        cells += [f"{result['quantization']}{stored}", f"{result['total_us']:.0f}"]
        cells += [f"{classes[name]:.0f}" for name in ("gemm", "quantize", "layout", "other")]
        cells.append(f"{meta['date'][:10]}, git {short_revision(meta['git_revision'])}: `{os.path.basename(path)}`")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def compile_report(reports: list[tuple[dict, dict, str]]) -> list[str]:
    """Every training compile report (``train.compile_report``): its runs and each measured layer's compile times."""
    if not reports:
        return []
    lines = ["## Training compile time and throughput: `python -m train.compile_report`", ""]
    for meta, result, path in reports:
        lines += [
            f"{meta['date'][:10]}, {meta['device_kind']}, git {short_revision(meta['git_revision'])}, "
            f"`--config {result['config']}`: `{meta['command']}` (`{os.path.basename(path)}`)",
            "",
            "| run | status | stored step | trace, s | lower, s | compile, s | first step ends, s | launch to first "
            "step end, s | tokens/s | MFU | peak GB |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for run in result["runs"]:
            # A run that ended early (a timeout after its first step) still shows what it wrote; one that stopped before
            # its compile record has no "aot" and no launch time.
            cells = [run["status"], run.get("aot", "-")]
            for key in ("trace_s", "lower_s", "compile_s", "time_to_first_step_s", "launch_to_first_step_s"):
                cells.append(f"{run[key]:.1f}" if key in run else "-")
            if "tokens_per_s" in run:
                mfu = "-" if run["mfu"] is None else f"{run['mfu']:.3f}"  # no known peak off a GPU
                cells += [f"{run['tokens_per_s']:.0f}", mfu, f"{run['peak_memory_gb']:.1f}"]
            else:
                cells += ["-", "-", "-"]
            lines.append(f"| {run['run']} | " + " | ".join(cells) + " |")
        lines += ["", "| layer | jit | trace, s | lower, s | compile, s | total, s |", "|---|---|---:|---:|---:|---:|"]
        for name, layer in result["layers"].items():
            for jit, times in layer["times"].items():
                row = f"| {name} (T {layer['tokens']}, D {layer['d_model']}) | {jit} | "
                if "total_s" not in times:  # the process did not finish
                    lines.append(row + f"{times['status']} | | | |")
                    continue
                lines.append(
                    row + " | ".join(f"{times[k]:.1f}" for k in ("trace_s", "lower_s", "compile_s", "total_s")) + " |"
                )
        lines.append("")
    return lines


def lowering_report(paths: list[str]) -> list[str]:
    """Every kernel lowering record (``python -m benchmarks.lowering --out``), oldest first: per lowered function,
    each kernel's lowering seconds and, from a record made with ``--compile``, each kernel's compile seconds."""
    records = [
        (c, path) for c, path in read_result_files(paths) if c["meta"].get("command", "").startswith(LOWERING_COMMAND)
    ]
    if not records:
        return []
    lines = [f"## Kernel lowering and compile time: `{LOWERING_COMMAND}`", ""]
    for content, path in sorted(records, key=lambda item: item[0]["meta"]["date"]):
        meta = content["meta"]
        lines += [
            f"{meta['date'][:10]}, {meta['device_kind']}, git {short_revision(meta['git_revision'])}: "
            f"`{meta['command']}` (`{os.path.basename(path)}`)",
            "",
        ]
        tables = [lowering.summary(name, runs) for name, runs in content["results"].items()]
        tables += [lowering.compile_summary(name, result) for name, result in content.get("compiled", {}).items()]
        # The bench's tables head their own sections; here they sit one level down, under the record.
        lines += [f"#{line}" if line.startswith("## ") else line for table in tables for line in table]
    return lines


def profile_report(profiles: list[tuple[dict, dict, str]]) -> list[str]:
    """The newest profile of each (GPU, layer shape), a table per GPU: µs per stage, the span and the glue's share."""
    newest: dict[tuple[str, str], tuple[dict, dict, str]] = {}
    for meta, result, path in profiles:
        key = (meta["device_kind"], result["shape"])
        if key not in newest or meta["date"] > newest[key][0]["date"]:
            newest[key] = (meta, result, path)
    if not newest:
        return []
    lines = [
        "## moe_ffn forward (pallas), kernel by kernel: `python -m benchmarks.profile_layer`",
        "",
        "GPU kernel time per call, µs (median over the calls); glue = gating + XLA's glue kernels + permute + combine "
        "+ what gathering the rows costs the gate_up kernel (over the same kernel on sorted rows; a gain counts 0).",
        "",
    ]
    for gpu in sorted({gpu for gpu, _ in newest}):
        lines += [f"### {gpu}", ""]
        header = ["shape", *PROFILE_STAGES, "span", "glue", "glue / span", "record"]
        lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 2) + "---|"]
        for (g, _), (meta, result, path) in sorted(newest.items()):
            if g != gpu:
                continue
            stages = result["stages_us"]
            cells = [result["shape"], *(f"{stages[s]:.1f}" if s in stages else "-" for s in PROFILE_STAGES)]
            cells += [f"{stages['span']:.1f}", f"{result['glue_us']:.1f}", f"{result['glue_share']:.1%}"]
            revision = short_revision(meta["git_revision"])
            cells.append(f"{meta['date'][:10]}, jax {meta['jax']}, git {revision}: `{os.path.basename(path)}`")
            lines.append("| " + " | ".join(cells) + " |")
        commands = sorted({meta["command"] for (g, _), (meta, _, _) in newest.items() if g == gpu})
        lines += ["", "Commands: " + "; ".join(f"`{c}`" for c in commands), ""]
    return lines


def step_profile_report(profiles: list[tuple[dict, dict, str]]) -> list[str]:
    """Every training-step profile (``train.profile_step``): the step's wall time and MFU, the share in our kernels,
    and its kernel time by part."""
    if not profiles:
        return []
    lines = ["## A training step, kernel by kernel: `python -m train.profile_step`", ""]
    for meta, result, path in profiles:
        total = result["kernel_us"]
        mfu = "-" if result["mfu"] is None else f"{result['mfu']:.1%}"
        lines += [
            f"{meta['date'][:10]}, {meta['device_kind']}, git {short_revision(meta['git_revision'])}: "
            f"`{meta['command']}` (`{os.path.basename(path)}`): `--config {result['config']}`, backend "
            f"{result['backend']}, quantization {result['quantization']}; step {result['step_ms']:.1f} ms wall, "
            f"{total / 1e3:.1f} ms of kernels, MFU {mfu}; our kernels {result['our_kernels_share']:.1%} of the "
            f"kernel time, unattributed (no HLO op in the trace: cuBLAS GEMMs, copies) "
            f"{result['unattributed_us'] / total:.1%}.",
            "",
            "| part | ms per step | share |",
            "|---|---:|---:|",
            *(f"| {part} | {us / 1e3:.2f} | {us / total:.1%} |" for part, us in result["parts_us"].items()),
            "",
        ]
    return lines


FINE_GRAINED_TRAINING = "_train_gpu-moe"


def fine_grained_training_report(paths: list[str]) -> list[str]:
    """Every training record of the fine-grained config (``python -m train --config gpu-moe``), one row each."""
    paths = [p for p in paths if FINE_GRAINED_TRAINING in os.path.basename(p)]
    if not paths:
        return []
    lines = [
        "## Fine-grained MoE training: `python -m train --config gpu-moe`",
        "",
        "The records `<date>_<gpu>_<git>_train_gpu-moe[-<variant>]_<backend>[-<quantization>].jsonl` (the command: "
        "`python -m train --config gpu-moe --backend B [--quantization Q] --steps N --metrics FILE`); tokens/s is the "
        "median over the intervals after the first.",
        "",
        "| record | GPU | tokens/s | MFU | peak GPU memory, GB | first step (compile), s | last step | its loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in paths:
        records = read_jsonl(path)
        setup = next(r for r in records if r["kind"] == "setup")
        name = os.path.basename(path).removesuffix(".jsonl")
        lines.append(table_row([name, setup["device_kind"], *training_cells(records)[:-1]]))  # no validation loss
    return [*lines, ""]


def read_training(paths: list[str]) -> dict[str, dict[str, list[dict]]]:
    """{run name: {backend: records}} of the training records that come as an xla / pallas pair (and the variants
    recorded beside it)."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for path in paths:
        name = os.path.basename(path)
        run, _, backend = name.removesuffix(".jsonl").rpartition(TRAIN_SUFFIX)
        if backend in TRAIN_BACKENDS + TRAIN_VARIANTS:
            runs.setdefault(run, {})[backend] = read_jsonl(path)
    return {run: pair for run, pair in runs.items() if set(TRAIN_BACKENDS) <= set(pair)}


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def training_cells(records: list[dict]) -> list[str]:
    """A training run's cells: tokens/s, MFU and peak memory (``train.metrics.steady_state``: the MFU from the setup
    record, over all its devices' peak), the time to the first step's end, the last step, its loss and the validation
    loss."""
    steady = steady_state(records)
    compile_s = next(r["seconds"] for r in records if r["kind"] == "compile")
    validation = next((r["validation_loss"] for r in records if r["kind"] == "final"), None)
    last = [r for r in records if r["kind"] == "train"][-1]
    return [
        f"{steady['tokens_per_s']:.0f}",
        f"{steady['mfu']:.4f}",
        f"{steady['peak_memory_gb']:.2f}",
        f"{compile_s:.1f}",
        f"{last['step']}",
        f"{last['loss']:.4f}",
        "-" if validation is None else f"{validation:.4f}",
    ]


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def training_report(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Every training pair by GPU, newest date first (runs of one date, which the records do not order, by name):
    tokens/s, MFU, peak memory, compile time and loss per backend."""
    by_gpu: dict[str, list[str]] = {}
    for run in sorted(runs, key=lambda run: (run[:10], run), reverse=True):  # <date>_<gpu>_<git>
        setup = next(r for r in runs[run]["pallas"] if r["kind"] == "setup")
        by_gpu.setdefault(setup["device_kind"], []).append(run)
    if not by_gpu:
        return []
    lines = ["## Toy MoE LM training throughput: `python -m train --config gpu`", ""]
    for gpu, gpu_runs in sorted(by_gpu.items()):
        lines += [f"### {gpu}", ""]
        for run in gpu_runs:
            lines += _training_run(gpu, run, runs[run])
    return lines


def _training_run(gpu: str, run: str, by_backend: dict[str, list[dict]]) -> list[str]:
    setup = next(r for r in by_backend["pallas"] if r["kind"] == "setup")
    parameters = setup["parameters"]
    return [
        f"{run[:10]}, {gpu}, git {run.split('_')[2]}; records `{run}{TRAIN_SUFFIX}{{xla,pallas}}.jsonl` (the "
        "records hold the config, not the command line: `python -m train --config gpu --backend {xla,pallas} "
        "--metrics FILE`, the pallas-fp8_block row with `--quantization fp8_block`, same seed and data); "
        f"{parameters['total'] / 1e6:.1f}M parameters, {parameters['active'] / 1e6:.1f}M "
        f"active per token, batch {setup['config']['batch_size']} x {setup['config']['seq_len']} bytes.",
        "",
        "| backend | tokens/s | MFU | peak GPU memory, GB | first step (compile), s | last step | its loss | "
        "validation loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            table_row([name, *training_cells(by_backend[name])])
            for name in TRAIN_BACKENDS + TRAIN_VARIANTS
            if name in by_backend
        ),
        "",
    ]


def build_report(results_dir: str, titles: dict[str, str], tables: dict[str, Callable], notes: list[str]) -> str:
    """RESULTS.md's text from the records in ``results_dir``; ``titles`` / ``tables`` / ``notes``: the benchmark
    CLI's bench titles, table functions and the notes that explain the tables."""
    jsonl = sorted(glob.glob(os.path.join(results_dir, "*.jsonl")))
    json_files = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    bench_files = [
        p for p in jsonl if TRAIN_SUFFIX not in os.path.basename(p) and FINE_GRAINED_TRAINING not in os.path.basename(p)
    ] + json_files
    runs = [run for path in bench_files for run in read_runs(path)]
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks --report` from the records in `results/`: edit those, not this file. Per "
        "bench, GPU and shape it shows the newest run (runs in GPU kernel time before wall-clock ones), as that run "
        "printed it; every ratio compares numbers of one run. How the benches measure: `docs/design.md`, "
        '"Benchmarks".',
        "",
        *(f"{note}\n" for note in notes),
    ]
    lines += bench_report(runs, titles, tables)
    lines += profile_report(read_records(json_files, "stages_us"))
    lines += fp8_profile_report(read_records(json_files, "classes_us"))
    lines += compile_report(read_records(json_files, "runs"))
    lines += lowering_report(json_files)
    lines += step_profile_report(read_records(json_files, "parts_us"))
    training = [p for p in jsonl if TRAIN_SUFFIX in os.path.basename(p)]
    lines += training_report(read_training(training))
    lines += expert_parallel_training_report(training)
    lines += fine_grained_training_report(jsonl)
    lines += notes_report(results_dir)
    return "\n".join(lines).rstrip() + "\n"


def notes_report(results_dir: str) -> list[str]:
    """The records written as notes (``*.md``: one change against its base in one call, kept or reverted, each
    with its date, GPU, commands and tables), newest first, their headings moved under this section's."""
    paths = sorted(glob.glob(os.path.join(results_dir, "*.md")), reverse=True)
    if not paths:
        return []
    lines = ["## Comparisons recorded as notes (A/B runs, tried variants)", ""]
    for path in paths:
        with open(path) as f:
            text = re.sub(r"^(#+) ", r"##\1 ", f.read().strip(), flags=re.MULTILINE)
        lines += [text, "", f"Record `{os.path.basename(path)}`.", ""]
    return lines


def expert_parallel_training_report(paths: list[str]) -> list[str]:
    """One row per expert-parallel run of ``python -m train --config gpu --expert-parallel N``: the same model, seed,
    data and global batch as the single-GPU pairs above, over N GPUs."""
    rows = []
    for path in paths:
        run, _, name = os.path.basename(path).removesuffix(".jsonl").rpartition(TRAIN_SUFFIX)
        match = EXPERT_PARALLEL_RUN.fullmatch(name)
        if match is None:
            continue
        records = read_jsonl(path)
        setup = next(r for r in records if r["kind"] == "setup")
        cells = [run[:10], f"git {run.split('_')[2]}", f"{setup['devices']} x {setup['device_kind']}", match.group(2)]
        rows.append(table_row([*cells, *training_cells(records)]))
    if not rows:
        return []
    return [
        "## Expert-parallel training: `python -m train --config gpu --expert-parallel N --dispatch D`",
        "",
        "The records `<date>_<gpus>_<git>_train_gpu_ep<N>-<dispatch>.jsonl`; the model, seed, data and global batch of "
        "the single-GPU runs above, over a mesh of one data and N expert devices.",
        "",
        "| date | git | devices | dispatch | tokens/s | MFU | peak GPU memory, GB | first step (compile), s | "
        "last step | its loss | validation loss |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def write_report(results_dir: str, out: str, titles, tables, notes) -> str:
    """Writes ``build_report``'s text to ``out``; returns it."""
    text = build_report(results_dir, titles, tables, notes)
    with open(out, "w") as f:
        f.write(text)
    return text
