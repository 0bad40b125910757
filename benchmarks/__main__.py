"""``python -m benchmarks``: time moe_jax against its baselines, print markdown tables, write JSON.

Examples:
  python -m benchmarks --tiny                                    # CPU smoke run on the "ci" shapes
  python -m benchmarks --bench gmm,gmm-bwd --shapes qwen3-30b/gate_up --out bench_out/gmm.json
  python -m benchmarks --bench gmm --quantization fp8_block --backends pallas   # FP8 forward vs a dense FP8 matmul
  python -m benchmarks --bench all --out bench_out/all.json     # every bench (GPU machine)
  python -m benchmarks --bench routing --routing-shapes deepseek-v3 --routing-stages glue,glue-bwd
  python -m benchmarks --bench glu --glu-activations swiglu,gpt_oss --backends pallas   # the GLU's targets
  python -m benchmarks --bench ep --backends pallas     # expert (by dispatch) vs data parallel on 1, 2, 4 GPUs
  python -m benchmarks --bench ep --backends pallas --ep-exchanges slots --time-limit 280   # weak scaling, one exchange
  python -m benchmarks --plot benchmarks/results/<run>.jsonl   # bar charts of a recorded run (<run>.png)
  python -m benchmarks --report                                 # benchmarks/RESULTS.md from benchmarks/results/
"""

import argparse
import json
import os
import shlex
import sys
import time

import jax

from benchmarks import common, expert_parallel, glu, grouped_matmul, layer, plot, quant, report, routing, tokamax_peer
from benchmarks import shapes as shape_registry
from moe_jax._core.hardware import configure_cpu_interpreter
from moe_jax.ops.grouped_matmul.glu import ACTIVATIONS

# Run in this order of priority, so that a --time-limit leaves out the least needed.
BENCHES = ("gmm", "layer", "skew", "gmm-bwd", "routing", "glu", "ep", "quant")
TITLES = {
    "gmm": "Grouped matmul, forward",
    "gmm-fp8": "Grouped matmul, forward, block-scaled FP8 (vs a per-tensor FP8 dense matmul)",
    "gmm-mxfp8": "Grouped matmul, forward, MXFP8 (vs a per-tensor FP8 dense matmul)",
    "gmm-bwd": "Grouped matmul, forward + backward (gradients of lhs and rhs)",
    "skew": "Grouped matmul, forward, skewed routings",
    "layer": "moe_ffn layer, forward",
    "layer-bwd": "moe_ffn layer, forward + backward (gradients of x, router kernel, both expert weights)",
    "routing": "Routing glue (route, permute, combine, aux losses), forward and forward + backward",
    "glu": "Gate_up grouped matmul + GLU, forward (fused epilogue vs GEMM, GEMM + XLA GLU)",
    "glu-bwd": "GLU MLP (gate_up, GLU, down, row scale), backward alone from the forward's residuals",
    "glu-mlp": "GLU MLP (gate_up, GLU, down, row scale), forward + backward",
    "ep": "moe_ffn layer on 1, 2, 4 devices at a fixed batch per device (expert parallel by dispatch, data parallel)",
    "ep-bwd": "the ep bench's layers, forward + backward",
    "quant": "Block-scaled FP8 quantization (sm90 kernel vs XLA), fraction of the HBM roofline",
}
TABLES = {  # benches without a FLOP model (routing) or with a baseline of their own (ep) have their own table
    "routing": routing.markdown_table,
    "ep": expert_parallel.scaling_table,
    "ep-bwd": expert_parallel.scaling_table,
    "quant": quant.markdown_table,
}
TABLE_NOTE = (
    "spread = (p90 - p10) / median of the samples; vs dense = TF/s over the dense row's TF/s; hbm-floor = the least "
    "bytes the grouped matmul moves (weights, x and output once; three times that with the backward) at the read rate "
    "measured in this run, the fastest rate of any HBM stream (the record's note); rel err = max over outputs and "
    "gradients of ||out - ref|| / ||ref||; ref = exact f32 products of three groups (grouped matmul), the first layer "
    "implementation that ran (layer)"
)
DEVICE_TIMER_NOTE = (
    "--timer device: ms = the median over calls of the sum of a call's GPU kernel durations (CUPTI): the host's "
    "dispatch and sync and the gaps between kernels are not counted"
)
DEFAULT_SKEW_SHAPE = {"bench": "qwen3-30b/gate_up", "ci": "ci/gate_up"}
# --tiny times the routing kernels under the (slow) GPU interpreter: one ci layer, the one with a group-limited router.
DEFAULT_ROUTING_SHAPES = {"bench": None, "ci": "ci/grouped"}


def _choices(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    chosen = tuple(item for item in text.split(",") if item)
    unknown = [item for item in chosen if item not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {allowed}")
    return chosen


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default="all", help=f"comma-separated from {BENCHES}, or 'all' (default)")
    parser.add_argument(
        "--shapes",
        help="grouped-matmul shapes for gmm/gmm-bwd, by name or tag, e.g. 'heuristic' for the models off the tuned "
        "table (default: every 'bench' shape)",
    )
    parser.add_argument("--skew-shapes", help=f"shapes for skew (default: {DEFAULT_SKEW_SHAPE['bench']})")
    parser.add_argument(
        "--layer-shapes",
        help="layer shapes for layer and ep (default: every 'bench' layer shape; ep: expert_parallel.DEFAULT_SHAPES)",
    )
    parser.add_argument(
        "--routing-shapes",
        help="layer shapes for routing (default: every 'bench' layer shape; with --tiny: "
        f"{DEFAULT_ROUTING_SHAPES['ci']})",
    )
    parser.add_argument(
        "--routing-stages",
        default=",".join(routing.STAGES),
        help=f"comma-separated from {routing.STAGES} (default: all)",
    )
    parser.add_argument(
        "--glu-shapes",
        help="gate_up shapes for glu, by name or tag (a tag's <model>/gate_up shapes; default: every 'bench' one; "
        "with --tiny: ci/gate_up)",
    )
    parser.add_argument(
        "--quant-shapes",
        help="arrays for quant, by name (benchmarks/quant.py's SHAPES) or tag (default: every 'bench' one; with "
        "--tiny: the 'ci' ones)",
    )
    parser.add_argument("--glu-activations", default="swiglu", help="comma-separated activations for glu")
    parser.add_argument(
        "--ep-exchanges",
        default=",".join(expert_parallel.EXCHANGES),
        help=f"the all-to-all exchanges ep times, comma-separated from {expert_parallel.EXCHANGES} (default: all; "
        "the ragged ones on GPUs only)",
    )
    parser.add_argument("--routing", default="uniform", choices=shape_registry.ROUTINGS, help="for gmm/gmm-bwd/glu")
    parser.add_argument("--backends", default="xla,pallas", help="moe_jax backends to time (default: xla,pallas)")
    parser.add_argument(
        "--quantization",
        choices=("fp8_block", "mxfp8"),
        help="gmm: time grouped_matmul(quantization=...) against a dense FP8 matmul (the gmm-fp8 bench); layer: also "
        "time moe_ffn(quantization=...)",
    )
    parser.add_argument(
        "--baselines",
        default="dense,ragged_dot,tokamax",
        help="baselines to time, from dense,ragged_dot,tokamax,experts (default: the first three; experts: the "
        "layer bench's expert kernels alone)",
    )
    parser.add_argument(
        "--tokamax-sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time tokamax_peer.SWEEP_CONFIGS in gmm (default: on)",
    )
    parser.add_argument("--iters", type=int, help="timed samples per measurement (default 20; 3 with --tiny)")
    parser.add_argument("--warmup", type=int, help="untimed calls after the first (default 2; 0 with --tiny)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        help="cap on one measurement's timed samples, in seconds (default 1; 0.05 with --tiny)",
    )
    parser.add_argument(
        "--timer",
        default="wall",
        choices=common.TIMERS,
        help="wall: host clock per call, dispatch included (default); device: the sum of each call's GPU kernel "
        "times (CUPTI; needs a GPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="inputs and group sizes")
    parser.add_argument(
        "--time-limit",
        type=float,
        help="seconds after start past which measurements are skipped (the tables still print)",
    )
    parser.add_argument("--tiny", action="store_true", help="'ci' shapes and few iterations: a CPU smoke run")
    parser.add_argument("--out", help="write {meta, records} JSON here")
    parser.add_argument("--jsonl", help="stream one JSON line per record here while running")
    parser.add_argument(
        "--render",
        metavar="JSONL",
        help="time nothing: print the tables of a run streamed with --jsonl (one cut short before it printed)",
    )
    parser.add_argument(
        "--plot",
        metavar="JSONL",
        help="time nothing: draw a run streamed with --jsonl as bar charts of TF/s per shape (PNG; needs matplotlib)",
    )
    parser.add_argument("--plot-out", metavar="PNG", help="where --plot writes (default: the JSONL's name with .png)")
    parser.add_argument(
        "--report",
        nargs="?",
        const=report.RESULTS_DIR,
        metavar="DIR",
        help="time nothing: write the current results of the records in DIR (default: benchmarks/results) as markdown",
    )
    parser.add_argument(
        "--report-out",
        metavar="MD",
        help="where --report writes (default: benchmarks/RESULTS.md)",
    )
    return parser.parse_args(argv)


def print_header(meta: dict) -> None:
    print(
        f"# moe_jax benchmarks\n\n{meta['date']} | {meta['device_kind']} ({meta['platform']}) | jax {meta['jax']} | "
        f"jaxlib {meta['jaxlib']} | tokamax {meta['peers']['tokamax']} | git {meta['git_revision']}\n\n"
        f"command: `{meta['command']}`\n\nFLOP model: {meta['flop_model']}\n",
        flush=True,
    )


def print_tables(records: list[common.Record]) -> None:
    for bench, title in TITLES.items():
        rows = [r for r in records if r.bench == bench]
        if rows:
            print(f"\n### {title}\n\n{TABLES.get(bench, common.markdown_table)(rows)}")
    print(f"\n{TABLE_NOTE}")
    if any(r.timing is not None and r.timing.timer == "device" for r in records):
        print(f"\n{DEVICE_TIMER_NOTE}")
    if any(r.bench == "routing" for r in records):
        print(f"\n{routing.TABLE_NOTE}")
    if any(r.bench == "quant" for r in records):
        print(f"\n{quant.TABLE_NOTE}")
    glu_backends = sorted({r.impl.split(":")[1] for r in records if r.bench in glu.BENCHES and ":" in r.impl})
    for backend in glu_backends:
        print(f"\n### GLU targets ({backend})\n\n{glu.targets_table(records, backend)}")
    if glu_backends:
        print(f"\n{glu.TARGETS_NOTE}")


def render(path: str) -> list[common.Record]:
    """Prints the header and tables of a --jsonl stream, exactly as the run would have printed them at its end."""
    meta, records = common.read_run(path)
    print_header(meta)
    print(f"(rendered from {os.path.basename(path)}: {len(records)} records)")
    print_tables(records)
    return records


def main(argv: list[str] | None = None) -> list[common.Record]:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    if args.plot:
        return plot.plot_run(args.plot, TITLES, args.plot_out)
    if args.plot_out:
        raise SystemExit("--plot-out names where --plot writes; give --plot RUN.jsonl too")
    if args.report:
        notes = [
            TABLE_NOTE,
            DEVICE_TIMER_NOTE,
            routing.TABLE_NOTE,
            quant.TABLE_NOTE,
            f"FLOP model: {common.FLOP_MODEL}",
        ]
        out = args.report_out or report.REPORT_PATH
        report.write_report(args.report, out, TITLES, TABLES, notes)
        print(f"wrote {out}")
        return []
    if args.report_out:
        raise SystemExit("--report-out names where --report writes; give --report too")
    backends = _choices(args.backends, ("xla", "pallas", "auto"), "backend")
    if "pallas" in backends:
        # Off a GPU (--tiny) the kernels run under the Mosaic GPU interpreter, which needs XLA:CPU set up first.
        configure_cpu_interpreter()
    platform = jax.devices()[0].platform
    if args.timer == "device" and platform != "gpu":
        raise SystemExit(f"--timer device reads GPU kernel times (CUPTI); this machine's jax runs on {platform}")
    tag = "ci" if args.tiny else "bench"
    benches = BENCHES if args.bench == "all" else _choices(args.bench, BENCHES, "bench")
    if args.quantization and not set(benches) <= {"gmm", "layer"}:
        raise SystemExit("--quantization times the grouped matmul's GEMMs or the layer: pass --bench gmm or layer")
    options = common.Options(
        backends=backends,
        baselines=_choices(args.baselines, ("dense", "ragged_dot", "tokamax", "experts"), "baseline"),
        tokamax_sweep=args.tokamax_sweep,
        iters=args.iters or (3 if args.tiny else 20),
        warmup=args.warmup if args.warmup is not None else (0 if args.tiny else 2),
        max_seconds=args.max_seconds or (0.05 if args.tiny else 1.0),
        min_samples=1 if args.tiny else 3,
        seed=args.seed,
        timer=args.timer,
        deadline=time.perf_counter() + args.time_limit if args.time_limit else None,
        quantization=args.quantization,
    )
    gmms, layers = shape_registry.GMM_SHAPES, shape_registry.LAYER_SHAPES
    gmm_shapes = common.named_shapes(args.shapes, gmms, shape_registry.gmm_shapes, shape_registry.gmm_shapes(tag))
    skew_shapes = common.named_shapes(
        args.skew_shapes, gmms, shape_registry.gmm_shapes, [gmms[DEFAULT_SKEW_SHAPE[tag]]]
    )
    layer_shapes = common.named_shapes(
        args.layer_shapes, layers, shape_registry.layer_shapes, shape_registry.layer_shapes(tag)
    )
    default_routing = DEFAULT_ROUTING_SHAPES[tag]
    routing_shapes = common.named_shapes(
        args.routing_shapes,
        layers,
        shape_registry.layer_shapes,
        [layers[default_routing]] if default_routing else shape_registry.layer_shapes(tag),
    )
    routing_stages = _choices(args.routing_stages, routing.STAGES, "routing stage")
    glu_shapes = common.named_shapes(args.glu_shapes, gmms, glu.glu_shapes, glu.glu_shapes(tag))
    glu_activations = _choices(args.glu_activations, ACTIVATIONS, "activation")
    quant_shapes = common.named_shapes(args.quant_shapes, quant.SHAPES, quant.shapes, quant.shapes(tag))

    command = shlex.join(["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)])
    meta = common.run_metadata(command, {"tokamax": tokamax_peer.version()})
    print_header(meta)

    stream = common.JsonlWriter(args.jsonl)
    stream.write({"meta": meta})

    def emit(record: common.Record) -> None:
        stream.write(record.to_json())
        if record.timing is None:
            result = f"{record.status}: {record.note}"
        elif record.tflops is None:
            result = f"{record.timing.median_s * 1e3:.3f} ms" + (
                f" ({record.status}: {record.note})" * bool(record.note)
            )
        else:
            result = f"{record.tflops:.1f} TF/s"
        print(f"  {(record.stage + ' ' + record.impl).strip():<48} {result}", file=sys.stderr, flush=True)

    records: list[common.Record] = []
    for bench in benches:
        if bench in ("gmm", "gmm-bwd"):
            records += grouped_matmul.run(
                bench, gmm_shapes, options, routings=(args.routing,), earlier=records, emit=emit
            )
        elif bench == "skew":
            records += grouped_matmul.run(
                "skew", skew_shapes, options, routings=shape_registry.ROUTINGS, earlier=records, emit=emit
            )
        elif bench == "layer":
            records += layer.run(layer_shapes, options, emit=emit)
        elif bench == "ep":
            ep_shapes = (
                expert_parallel.default_shapes() if args.layer_shapes is None and tag == "bench" else layer_shapes
            )
            exchanges = _choices(args.ep_exchanges, expert_parallel.EXCHANGES, "exchange")
            records += expert_parallel.run(ep_shapes, options, emit=emit, exchanges=exchanges)
        elif bench == "glu":
            records += glu.run(glu_shapes, options, activations=glu_activations, routing=args.routing, emit=emit)
        elif bench == "quant":
            records += quant.run(quant_shapes, options, emit=emit)
        else:
            records += routing.run(routing_shapes, options, stages=routing_stages, emit=emit)

    print_tables(records)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": [r.to_json() for r in records]}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
