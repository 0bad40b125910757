"""Compile time and throughput of the toy LM on one GPU: ``python -m train.compile_report`` (a few minutes).

Measures, and prints as the tables ``python -m benchmarks --report`` shows for the record:
  - the first step of ``--config`` (default gpu-moe) with ``--backend pallas``: trace, lower and compile seconds
    (``train.compilation.compile_ahead``) and the time to the first step's end, from a cold persistent cache and
    again from a second process that shares the cache directory (warm);
  - tokens/s, MFU (model FLOPs / bf16 dense peak, ``train.metrics``) and peak memory over the same runs' timed steps,
    over a run with ``--remat`` where asked (the recomputation's cost and saving), and over a run with
    ``--backend xla`` (whose dense-masked ``ragged_dot`` needs more micro-batches to fit: ``--xla-grad-accum``, the
    same tokens a step);
  - one ``moe_ffn`` layer's jitted forward + backward traced, lowered and compiled twice in this process (the second
    a new function, as every unscanned layer is) at the ``gpu`` config's coarse layer (T 8192, D 1024, F 2048, E 8,
    k 2) and at ``--config``'s layer (one micro-batch's tokens).

Each training run is ``python -m train`` in a subprocess (so that each starts cold and holds the GPU alone); its
metrics JSONL is read back. The record ``{meta, results}`` goes to ``--out`` (default: benchmarks/results/, named
date_device_revision_train_compile.json).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCE_LAYER = dict(tokens=8192, d_model=1024, d_ff=2048, num_experts=8, top_k=2, score="softmax")


def train_run(name: str, args: list[str], workdir: pathlib.Path, timeout_s: float) -> dict:
    """Runs ``python -m train`` with ``args``; returns its compile and last train records, or why it failed."""
    metrics = workdir / f"{name}.jsonl"
    command = [sys.executable, "-m", "train", "--no-progress", "--metrics", str(metrics), *args]
    start = time.perf_counter()
    try:
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"run": name, "args": args, "status": f"timed out after {timeout_s:.0f} s"}
    wall_s = time.perf_counter() - start
    if completed.returncode:
        return {"run": name, "args": args, "status": "failed", "stderr": completed.stderr[-2000:]}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    compile_record = next(r for r in records if r["kind"] == "compile")
    # The interval with the most timed steps (the last one may hold only the steps after a log).
    last = max((r for r in records if r["kind"] == "train"), key=lambda r: len(r["step_losses"]))
    return {
        "run": name,
        "args": args,
        "status": "ok",
        "wall_s": wall_s,
        **{k: compile_record[k] for k in ("trace_s", "lower_s", "compile_s", "first_step_s")},
        "time_to_first_step_s": compile_record["seconds"],
        "tokens_per_s": last["tokens_per_s"],
        "mfu": last["mfu"],
        "peak_memory_gb": (last["peak_memory_bytes"] or 0) / 1e9,
        "loss": last["loss"],
    }


def layer_compile_times(layer: dict, backend: str) -> dict:
    """Trace / lower / compile seconds of one moe_ffn forward + backward, jitted twice (two new functions)."""
    import jax
    import jax.numpy as jnp

    import moe_jax
    from train.compilation import compile_ahead

    t, d, f, e = layer["tokens"], layer["d_model"], layer["d_ff"], layer["num_experts"]
    shapes = [((t, d), jnp.bfloat16), ((d, e), jnp.float32), ((e, d, 2 * f), jnp.bfloat16), ((e, f, d), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]

    def loss(x, router_kernel, w_gate_up, w_down):
        packed = moe_jax.pack_gate_up(w_gate_up)
        y, aux = moe_jax.moe_ffn(
            x, router_kernel, packed, w_down, top_k=layer["top_k"], score=layer["score"], backend=backend
        )
        return y.astype(jnp.float32).sum() + aux.load_balancing_loss

    results = {}
    for attempt in ("first", "second"):
        # A new function each time: jit's caches key on the function, as separate layers' calls would.
        step = jax.jit(lambda *a: jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*a))
        _, times = compile_ahead(step, *args)
        results[attempt] = {**dataclasses.asdict(times), "total_s": times.total_s}
    return results


def default_out(meta: dict) -> pathlib.Path:
    kind = meta["device_kind"].lower()
    device = next((name for name in ("h200", "h100") if name in kind), kind.replace(" ", "-"))
    revision = meta["git_revision"][:7]
    return REPO / "benchmarks" / "results" / f"{meta['date'][:10]}_{device}_{revision}_train_compile.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.compile_report", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="gpu-moe", help="the named TrainConfig to train (default gpu-moe)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (the first one is not timed)")
    parser.add_argument("--xla-steps", type=int, default=4, help="steps of the xla run")
    parser.add_argument("--xla-grad-accum", type=int, default=16, help="micro-batches a step of the xla run")
    parser.add_argument("--run-timeout", type=float, default=150, help="seconds before a training run is abandoned")
    parser.add_argument("--backend", default="pallas", help="backend of the cached runs and the layer (default pallas)")
    parser.add_argument("--skip-xla", action="store_true", help="no xla run")
    parser.add_argument(
        "--remat", choices=("moe", "full"), help="add a run with this remat policy (its memory and speed beside none)"
    )
    parser.add_argument("--out", help="the JSON record's path (default: benchmarks/results/...)")
    args = parser.parse_args(argv)

    runs = []
    with tempfile.TemporaryDirectory(prefix="compile_report_") as tmp:
        workdir = pathlib.Path(tmp)
        cache = ["--compile-cache", str(workdir / "cache")]
        common = ["--config", args.config, "--steps", str(args.steps)]
        for name in (f"{args.backend} cold cache", f"{args.backend} warm cache"):
            runs.append(train_run(name, [*common, "--backend", args.backend, *cache], workdir, args.run_timeout))
            print(json.dumps(runs[-1]), flush=True)
        if args.remat:
            remat = [*common, "--backend", args.backend, *cache, "--remat", args.remat]
            runs.append(train_run(f"{args.backend} remat {args.remat}", remat, workdir, args.run_timeout))
            print(json.dumps(runs[-1]), flush=True)
        if not args.skip_xla:
            xla = ["--config", args.config, "--steps", str(args.xla_steps), "--backend", "xla"]
            xla += ["--grad-accum", str(args.xla_grad_accum), "--no-compile-cache"]
            runs.append(train_run("xla", xla, workdir, args.run_timeout))
            print(json.dumps(runs[-1]), flush=True)

    # Only now does this process touch the GPU: the training runs above had it to themselves.
    from benchmarks import report
    from benchmarks.common import run_metadata
    from train.configs import get_config

    config = get_config(args.config)
    model = config.model
    config_layer = dict(
        tokens=config.tokens_per_step // config.grad_accum_steps,
        d_model=model.d_model,
        d_ff=model.d_ff,
        num_experts=model.num_experts,
        top_k=model.top_k,
        score=model.score,
    )
    layers = {}
    for name, layer in (("reference", REFERENCE_LAYER), (args.config, config_layer)):
        layers[name] = {**layer, "backend": args.backend, "times": layer_compile_times(layer, args.backend)}
        print(json.dumps({name: layers[name]}), flush=True)

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
