"""Compile time and throughput of the toy LM on one GPU: ``python -m train.compile_report`` (within ``--budget``).

Measures, each in a process of its own (so that each finds what a new launch finds), and prints as the tables
``python -m benchmarks --report`` shows for the record:
  - one ``moe_ffn`` layer's jitted forward + backward at the ``gpu`` config's coarse layer (T 8192, D 1024, F 2048,
    E 8, k 2; ``--config-layer`` adds ``--config``'s layer at one micro-batch's tokens): trace, lower and compile
    seconds (``train.compilation.compile_ahead``) from an empty persistent cache (cold), then from the cache that
    run filled (warm: XLA's compilation is a cache hit, the tracing and lowering that make its key are not), then
    cold with the Mosaic GPU kernels compiled one after another inside XLA's compilation (without
    ``moe_jax.compiling_kernels_while_lowering``), then cold with ``--quick-compile``'s options;
  - the first step of ``--config`` with ``--backend``: the trace / lower / compile seconds and the time from the
    process's launch to the first step's end, from an empty cache (cold), from the cache and the stored step that
    run left (warm: the step loads from ``train.compilation.ExecutableStore``, nothing is traced or lowered), from
    the cache alone (``--no-aot``: what the persistent cache saves by itself), and cold with ``--quick-compile``
    (what it saves at the start and costs per step);
  - tokens/s, MFU (model FLOPs / bf16 dense peak, ``train.metrics``) and peak memory over the same runs' timed steps,
    over a run with ``--remat`` where asked (the recomputation's cost and saving), and over a run with
    ``--backend xla`` unless ``--skip-xla``, at ``--xla-config`` (default ``gpu``: the XLA backend's dense-masked
    ``ragged_dot`` computes every expert for every row, which at ``gpu-moe`` does not fit one H200 even at one
    sequence a micro-batch).

Every process has a hard timeout, and all of them together stay within ``--budget`` seconds: a run that the budget
no longer covers is recorded as skipped. The record ``{meta, results}`` goes to ``--out`` (default:
benchmarks/results/, named date_device_revision_train_compile.json).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCE_LAYER = dict(tokens=8192, d_model=1024, d_ff=2048, num_experts=8, top_k=2, score="softmax")


class Budget:
    """Seconds left of the report's budget: each process's timeout is its own limit or what is left, the smaller."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def timeout(self, limit: float) -> float:
        return min(limit, self.deadline - time.monotonic())


def run_process(command: list[str], budget: Budget, limit: float) -> tuple[str, subprocess.CompletedProcess | None]:
    """Runs ``command`` in the repository under the budget: ("ok" | "failed" | why it did not finish, the process)."""
    timeout = budget.timeout(limit)
    if timeout < 5:
        return "skipped: the budget is spent", None
    try:
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s", None
    return ("failed" if completed.returncode else "ok"), completed


def train_run(name: str, args: list[str], workdir: pathlib.Path, budget: Budget, limit: float) -> dict:
    """Runs ``python -m train`` with ``args``; returns its compile record and its last train record, as far as the
    run wrote them (a run stopped after its first step still says how long that took), and how it ended."""
    metrics = workdir / f"{name.replace(' ', '_').replace(',', '')}.jsonl"
    command = [sys.executable, "-m", "train", "--no-progress", "--metrics", str(metrics), *args]
    launched = time.time()
    status, completed = run_process(command, budget, limit)
    result = {"run": name, "args": args, "status": status}
    if status == "ok":
        result["wall_s"] = time.time() - launched
    elif completed is not None:
        result["stderr"] = completed.stderr[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    compile_record = next((r for r in records if r["kind"] == "compile"), None)
    if compile_record is not None:
        result |= {k: compile_record[k] for k in ("trace_s", "lower_s", "compile_s", "first_step_s", "aot")}
        result["time_to_first_step_s"] = compile_record["seconds"]
        result["launch_to_first_step_s"] = compile_record["unix_time"] - launched
    # The interval with the most timed steps (the last one may hold only the steps after a log).
    intervals = [r for r in records if r["kind"] == "train"]
    if intervals:
        last = max(intervals, key=lambda r: len(r["step_losses"]))
        result |= {"tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"], "loss": last["loss"]}
        result["peak_memory_gb"] = (last["peak_memory_bytes"] or 0) / 1e9
    return result


def layer_step(layer: dict, backend: str):
    """(jitted forward + backward of one moe_ffn layer, its abstract arguments) at ``layer``'s shape."""
    import jax
    import jax.numpy as jnp

    import moe_jax

    t, d, f, e = layer["tokens"], layer["d_model"], layer["d_ff"], layer["num_experts"]
    shapes = [((t, d), jnp.bfloat16), ((d, e), jnp.float32), ((e, d, 2 * f), jnp.bfloat16), ((e, f, d), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]

    def loss(x, router_kernel, w_gate_up, w_down):
        packed = moe_jax.pack_gate_up(w_gate_up)
        y, aux = moe_jax.moe_ffn(
            x, router_kernel, packed, w_down, top_k=layer["top_k"], score=layer["score"], backend=backend
        )
        return y.astype(jnp.float32).sum() + aux.load_balancing_loss

    return jax.jit(lambda *a: jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*a)), args


def layer_compile_times(layer: dict, backend: str, parallel_kernels: bool = True, quick: bool = False) -> dict:
    """Trace / lower / compile seconds of one moe_ffn forward + backward, jitted in this process."""
    from train.compilation import compile_ahead, compiler_options

    jitted, args = layer_step(layer, backend)
    options = compiler_options(backend=backend, quick=quick)
    _, times = compile_ahead(jitted, *args, parallel_kernels=parallel_kernels, options=options)
    return {"trace_s": times.trace_s, "lower_s": times.lower_s, "compile_s": times.compile_s, "total_s": times.total_s}


def layer_runs(layer: dict, backend: str, workdir: pathlib.Path, budget: Budget, limit: float) -> dict:
    """``layer_compile_times`` in a fresh process on an empty persistent cache, then in another on the filled one, then
    on other empty caches with the kernels compiled one after another (what compiling them on a thread pool saves)
    and with ``--quick-compile``'s options."""
    cache = workdir / f"layer_cache_{layer['tokens']}_{layer['d_model']}_{layer['num_experts']}"
    probe = [sys.executable, "-m", "train.compile_report", "--layer-probe", json.dumps(layer), "--backend", backend]
    runs = {
        "cold cache": ["--probe-cache", str(cache)],
        "warm cache": ["--probe-cache", str(cache)],
        "cold cache, serial kernels": ["--probe-cache", f"{cache}_serial", "--probe-serial-kernels"],
        "cold cache, quick compile": ["--probe-cache", f"{cache}_quick", "--probe-quick-compile"],
    }
    times = {}
    for name, extra in runs.items():
        status, completed = run_process([*probe, *extra], budget, limit)
        if status == "ok":
            times[name] = json.loads(completed.stdout.strip().splitlines()[-1])
        else:
            times[name] = {"status": status, **({"stderr": completed.stderr[-2000:]} if completed else {})}
    return times


def default_out(meta: dict) -> pathlib.Path:
    kind = meta["device_kind"].lower()
    device = next((name for name in ("h200", "h100") if name in kind), kind.replace(" ", "-"))
    revision = meta["git_revision"][:7]
    return REPO / "benchmarks" / "results" / f"{meta['date'][:10]}_{device}_{revision}_train_compile.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.compile_report", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="gpu-moe", help="the named TrainConfig to train (default gpu-moe)")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (the first one is not timed)")
    parser.add_argument("--xla-steps", type=int, default=4, help="steps of the xla run")
    parser.add_argument("--xla-config", default="gpu", help="the named TrainConfig of the xla run (default gpu)")
    parser.add_argument("--xla-grad-accum", type=int, help="micro-batches a step of the xla run (default: config's)")
    parser.add_argument("--budget", type=float, default=270, help="seconds for all the processes together")
    parser.add_argument("--run-timeout", type=float, default=110, help="seconds before a training run is abandoned")
    parser.add_argument("--layer-timeout", type=float, default=60, help="seconds before a layer process is abandoned")
    parser.add_argument("--backend", default="pallas", help="backend of the cached runs and the layer (default pallas)")
    parser.add_argument("--skip-xla", action="store_true", help="no xla run")
    parser.add_argument("--config-layer", action="store_true", help="also time --config's own layer")
    parser.add_argument(
        "--remat", choices=("moe", "full"), help="add a run with this remat policy (its memory and speed beside none)"
    )
    parser.add_argument("--out", help="the JSON record's path (default: benchmarks/results/...)")
    # The layer processes' entry point: one layer (JSON) timed in this process on --probe-cache; prints its times.
    parser.add_argument("--layer-probe", help=argparse.SUPPRESS)
    parser.add_argument("--probe-cache", help=argparse.SUPPRESS)
    parser.add_argument("--probe-serial-kernels", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-quick-compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.layer_probe:
        from train.compilation import enable_compile_cache

        enable_compile_cache(args.probe_cache)
        layer = json.loads(args.layer_probe)
        times = layer_compile_times(
            layer, args.backend, parallel_kernels=not args.probe_serial_kernels, quick=args.probe_quick_compile
        )
        print(json.dumps(times))
        return

    from train.configs import get_config

    config = get_config(args.config)
    model = config.model
    budget = Budget(args.budget)
    layers = {}
    measured = [("reference", REFERENCE_LAYER)]
    if args.config_layer:
        tokens = config.tokens_per_step // config.grad_accum_steps
        fields = ("d_model", "d_ff", "num_experts", "top_k", "score")
        measured.append((args.config, dict(tokens=tokens, **{name: getattr(model, name) for name in fields})))
    runs = []
    with tempfile.TemporaryDirectory(prefix="compile_report_") as tmp:
        workdir = pathlib.Path(tmp)
        for name, layer in measured:
            times = layer_runs(layer, args.backend, workdir, budget, args.layer_timeout)
            layers[name] = {**layer, "backend": args.backend, "times": times}
            print(json.dumps({name: layers[name]}), flush=True)

        cache = ["--compile-cache", str(workdir / "cache")]
        common = ["--config", args.config, "--steps", str(args.steps), "--backend", args.backend, *cache]
        quick = ["--quick-compile", "--compile-cache", str(workdir / "cache_quick")]
        cached_runs = [("cold cache", []), ("warm cache", []), ("warm cache, no stored step", ["--no-aot"])]
        cached_runs.append(("cold cache, quick compile", quick))
        if args.remat:
            cached_runs.append((f"remat {args.remat}", ["--remat", args.remat]))
        for name, extra in cached_runs:
            runs.append(train_run(f"{args.backend} {name}", [*common, *extra], workdir, budget, args.run_timeout))
            print(json.dumps(runs[-1]), flush=True)
        if not args.skip_xla:
            xla = ["--config", args.xla_config, "--steps", str(args.xla_steps), "--backend", "xla"]
            xla.append("--no-compile-cache")
            if args.xla_grad_accum is not None:
                xla += ["--grad-accum", str(args.xla_grad_accum)]
            runs.append(train_run(f"xla, --config {args.xla_config}", xla, workdir, budget, args.run_timeout))
            print(json.dumps(runs[-1]), flush=True)

    # Only now does this process touch the device: the processes above had it to themselves.
    from benchmarks import report
    from benchmarks.common import run_metadata

    meta = run_metadata("python -m train.compile_report " + " ".join(argv or sys.argv[1:]), peers={})
    meta["flop_model"] = "training: train/metrics.py (3 x forward; forward = 2 x active matmul parameters + 2 L S D)"
    results = {"config": args.config, "runs": runs, "layers": layers}
    out = pathlib.Path(args.out) if args.out else default_out(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print("\n".join(report.compile_report([(meta, results, str(out))])))
    print(f"record: {os.path.relpath(out, REPO)}")


if __name__ == "__main__":
    main()
