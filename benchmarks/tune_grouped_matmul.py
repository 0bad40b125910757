"""Checks, times and tunes the sm90 grouped-matmul kernels (fwd, dgrad, wgrad) at the named shapes, on the GPU.

  python -m benchmarks.tune_grouped_matmul check [--shapes ...] [--routings uniform,half]
      gradients through moe_jax.grouped_matmul(backend="pallas") against exact f32 products of three groups, both
      rhs layouts, plus rows past sum(group_sizes) (which must come out exactly zero)
  python -m benchmarks.tune_grouped_matmul time [--shapes ...] [--kinds fwd,dgrad,wgrad,glu_dgrad] [--configs ...]
      each kernel alone next to one dense XLA matmul of the same FLOPs (the practical ceiling)
  python -m benchmarks.tune_grouped_matmul tune [--shapes ...] [--kinds ...]
      sweeps candidate configs and prints the fastest per (kind, shape) as an entry of the tuned table
      (moe_jax/ops/grouped_matmul/tuned/sm90.json)

A config on the command line is "table" (what the op would use: tuned entry or heuristic), the table's config with
fields replaced, "table/<field>=<value>[/<field>=<value>...]" (e.g. "table/grid_minor=m/grid_width=16"), or
"<block_m>x<block_n>x<block_k>s<stages>e<epilogue_n><m|n|g><grid_width>[o][t]", e.g. "128x256x64s4e64n8",
"128x256x64s4e64n8o" (the epilogue overlapped with the next tile's first steps) or "128x256x64s4e64n8t"
(keep_ctas_in_step: tail tiles run every warpgroup's MMAs).
The candidates of one (kind, shape) are compiled in parallel threads (--jobs: the kernels' compilation is CPU-bound
and most of a sweep's time), then timed with the dense ceiling in interleaved rounds
(--rounds; see run_time); every output is compared with the first candidate's, so a config that computes something
else shows up in "vs first".
Numbers reported in benchmarks/RESULTS.md come from ``python -m benchmarks``; this script is for tuning.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from benchmarks import common
from benchmarks import shapes as shape_registry
from moe_jax.ops.grouped_matmul import launch
from moe_jax.ops.grouped_matmul.config import Config, epilogue_smem, get_config
from tests.oracle import GroupOracle

# The kernels this script drives.
TIMED_KINDS = ("fwd", "dgrad", "wgrad", "glu_dgrad")
# glu_dgrad is the GLU MLP's backward through its down projection (rhs = w_down [G, F, D]), so it is timed at the
# "<model>/down" shapes only, whose (G, M, K, N) is also its table key; its epilogue runs this activation's backward.
GLU_DGRAD_ACTIVATION = "swiglu"
SPEC = re.compile(r"(\d+)x(\d+)x(\d+)s(\d+)e(\d+)([mng])(\d+)(o)?(t)?")


def parse_config(spec: str):
    """A command-line config -> a function (kind, shape) -> Config (see the module docstring)."""
    if spec == "table" or spec.startswith("table/"):
        fields = dict(_field(assignment, spec) for assignment in spec.split("/")[1:])
        return lambda kind, shape: dataclasses.replace(table_config(kind, shape), **fields)
    match = SPEC.fullmatch(spec)
    if not match:
        raise SystemExit(f"bad config {spec!r}: expected 'table', 'table/<field>=<value>' or e.g. 128x256x64s4e64n8")
    bm, bn, bk, stages, epi, minor, width, overlap, in_step = match.groups()
    config = Config(
        block_m=int(bm),
        block_n=int(bn),
        block_k=int(bk),
        num_stages=int(stages),
        epilogue_n=int(epi),
        grid_minor=minor,
        grid_width=int(width),
        overlap_epilogue=overlap == "o",
        keep_ctas_in_step=in_step == "t",
    )
    return lambda kind, shape: config


def _field(assignment: str, spec: str) -> tuple[str, object]:
    """``name=value`` -> (name, value) of a Config field, the value converted to the field's type."""
    name, _, value = assignment.partition("=")
    defaults = {f.name: getattr(Config(), f.name) for f in dataclasses.fields(Config)}
    if name not in defaults or not value:
        raise SystemExit(f"bad config {spec!r}: {assignment!r} is not <Config field>=<value> ({', '.join(defaults)})")
    kind = type(defaults[name])
    if kind is bool:
        return name, value in ("1", "true", "True")
    return name, kind(value)


def tuned_entry(kind: str, shape, config: Config) -> str:
    """One entry of tuned/sm90.json: the (kind, G, M, K, N) key and the Config fields that differ from the defaults."""
    default = Config()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
    changed = {name: value for name, value in changed.items() if value != getattr(default, name)}
    return json.dumps({"kind": kind, "g": shape.g, "m": shape.m, "k": shape.k, "n": shape.n, "config": changed})


def label(config: Config) -> str:
    c = config
    overlap = "o" if c.overlap_epilogue else ""
    in_step = "t" if c.keep_ctas_in_step else ""
    tile = f"{c.block_m}x{c.block_n}x{c.block_k}s{c.num_stages}e{c.epilogue_n}"
    return f"{tile}{c.grid_minor}{c.grid_width}{overlap}{in_step}"


def kernel_fn(kind: str, config: Config | None):
    """kernel_args(kind, ...) -> kernel output, for rhs [G, K, N]: fwd (lhs, rhs), dgrad (dout, rhs), wgrad
    (lhs, dout), glu_dgrad (dout, rhs, row_scale, packed gate_up [M, 2K])."""
    if kind == "glu_dgrad":
        return lambda d_y, w_down, group_sizes, row_scale, gate_up: launch.run_glu_dgrad(
            d_y, w_down, group_sizes, gate_up, row_scale, GLU_DGRAD_ACTIVATION, config=config
        )
    if kind == "fwd":
        return functools.partial(
            launch.run_rows_kernel, "fwd", w_transposed=False, out_dtype=jnp.bfloat16, config=config
        )
    if kind == "dgrad":
        return functools.partial(
            launch.run_rows_kernel, "dgrad", w_transposed=True, out_dtype=jnp.bfloat16, config=config
        )
    assert kind == "wgrad", kind  # main() admits TIMED_KINDS only
    return functools.partial(launch.run_wgrad_kernel, out_dtype=jnp.bfloat16, config=config)


@functools.partial(jax.jit, static_argnames=("g", "m", "k", "n", "glu"))
def _inputs(key, *, g, m, k, n, glu):
    keys = jax.random.split(key, 5)
    inputs = {
        "lhs": jax.random.normal(keys[0], (m, k), jnp.bfloat16),
        "rhs": (jax.random.normal(keys[1], (g, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16),
        "ct": jax.random.normal(keys[2], (m, n), jnp.bfloat16),
    }
    if glu:  # glu_dgrad's epilogue operands
        inputs["gate_up"] = jax.random.normal(keys[3], (m, 2 * k), jnp.bfloat16)
        inputs["row_scale"] = jax.random.uniform(keys[4], (m,), jnp.float32)
    return inputs


def input_sets(shape, seed: int, glu: bool = False) -> list[dict]:
    return common.input_sets(functools.partial(_inputs, g=shape.g, m=shape.m, k=shape.k, n=shape.n, glu=glu), seed)


def kernel_args(kind: str, s: dict, group_sizes) -> tuple:
    if kind == "glu_dgrad":
        return s["ct"], s["rhs"], group_sizes, s["row_scale"], s["gate_up"]
    if kind == "fwd":
        return s["lhs"], s["rhs"], group_sizes
    if kind == "dgrad":
        return s["ct"], s["rhs"], group_sizes
    return s["lhs"], s["ct"], group_sizes


def dense_args(kind: str, s: dict, shape) -> tuple:
    """One dense [a, b] x [b, c] matmul with the kind's FLOPs (2 M K N) from the same buffers."""
    if kind == "fwd":
        return s["lhs"], s["rhs"][0]
    if kind in ("dgrad", "glu_dgrad"):
        return s["ct"], s["rhs"][0].T
    return s["lhs"].T, s["ct"]


def timed(fn, arg_sets, iters: int, max_seconds: float = 1.0):
    try:
        timing, out = common.time_fn(fn, arg_sets, iters=iters, warmup=2, max_seconds=max_seconds)
        return timing, out
    except Exception as error:  # one bad config (shared memory, lowering) must not end the sweep
        status, note = common.classify_failure(error)
        print(f"    {status}: {note}", flush=True)
        return None, None


def compile_all(kind: str, configs: list[Config], args: tuple, jobs: int) -> dict:
    """{config: compiled kernel call, or the exception its compilation raised}, compiled in ``jobs`` threads."""

    def build(config):
        return jax.jit(kernel_fn(kind, config)).lower(*args).compile()

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {config: pool.submit(build, config) for config in configs}
    compiled = {}
    for config, future in futures.items():
        try:
            compiled[config] = future.result()
        except Exception as error:  # reported with the config's row
            compiled[config] = error
    return compiled


def group_sizes_for(shape, routing: str, seed: int) -> jax.Array:
    """The named routings, plus "even": M / G rows per group (no ragged tile anywhere; a diagnostic)."""
    if routing == "even":
        sizes = jnp.full((shape.g,), shape.m // shape.g, jnp.int32)
        return sizes.at[-1].add(shape.m - int(jnp.sum(sizes)))
    return shape.group_sizes(routing, seed=seed)


def run_time(shapes, kinds, configs, routing: str, seed: int, iters: int, sweep: bool, jobs: int, rounds: int):
    """Times the candidates of each (kind, shape) and the dense ceiling in ``rounds`` interleaved rounds and reports
    the median of the round medians: the GPU's speed drifts by ~10% over seconds, and interleaving spreads that drift
    over every candidate instead of favouring whichever ran in a fast moment."""
    print("| kind | shape | routing | config | ms | spread | TF/s | vs dense | vs first |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for shape in shapes:
        sets = input_sets(shape, seed, glu="glu_dgrad" in kinds)
        group_sizes = group_sizes_for(shape, routing, seed)
        flops = 2 * shape.m * shape.k * shape.n
        for kind in kinds:
            if kind == "glu_dgrad" and not shape.name.endswith("/down"):
                continue  # see GLU_DGRAD_ACTIVATION
            if sweep:
                candidates = candidate_configs(kind, shape)
            else:  # (variants of the table's config can coincide)
                candidates = list(dict.fromkeys(config_for(kind, shape) for config_for in configs))
            arg_sets = [kernel_args(kind, s, group_sizes) for s in sets]
            compiled = compile_all(kind, candidates, arg_sets[0], jobs)
            for config, error in compiled.items():
                if isinstance(error, Exception):
                    status, note = common.classify_failure(error)
                    print(f"| {kind} | {shape.name} | {routing} | {label(config)} | {status}: {note} | | | | |")
            timed_fns = {"dense": (jax.jit(jnp.dot), [dense_args(kind, s, shape) for s in sets])}
            timed_fns |= {c: (fn, arg_sets) for c, fn in compiled.items() if not isinstance(fn, Exception)}
            medians = {name: [] for name in timed_fns}
            errors, first_out = {}, None
            for round_index in range(rounds):
                for name, (fn, fn_args) in timed_fns.items():
                    if len(medians[name]) < round_index:  # failed in an earlier round
                        continue
                    timing, out = timed(fn, fn_args, iters, max_seconds=1.0 / rounds)
                    if timing is None:
                        continue
                    medians[name].append(timing.median_s)
                    if round_index == 0 and name != "dense":
                        first_out = out if first_out is None else first_out
                        errors[name] = common.relative_errors(out, first_out)[0]
                    del out
            results = _print_rows(kind, shape, routing, flops, medians, errors)
            if sweep and results:
                best = min(results, key=lambda r: r[0])[1]
                print(f"tuned entry: {tuned_entry(kind, shape, best)},", flush=True)


def _print_rows(kind, shape, routing, flops, medians, errors) -> list[tuple[float, Config]]:
    """One table row per timed name (dense first); returns (median s, config) of the candidates that ran."""
    dense = medians.pop("dense")
    dense_tf = flops / np.median(dense) / 1e12 if dense else None
    results = []
    for name, samples in [("dense", dense), *medians.items()]:
        is_dense = name == "dense"
        row = f"| {kind} | {shape.name} | {'-' if is_dense else routing} | {name if is_dense else label(name)}"
        if not samples:
            print(f"{row} | failed | | | | |", flush=True)
            continue
        median = float(np.median(samples))
        spread = (max(samples) - min(samples)) / median
        tf = flops / median / 1e12
        vs_dense = f"{tf / dense_tf:.2f}" if dense_tf else ""
        error = f"{errors[name]:.1e}" if name in errors else ""
        print(f"{row} | {median * 1e3:.3f} | {spread:.0%} | {tf:.1f} | {vs_dense} | {error} |", flush=True)
        if not is_dense:
            results.append((median, name))
    return results


def table_config(kind: str, shape) -> Config:
    return get_config(kind, m=shape.m, k=shape.k, n=shape.n, g=shape.g, row_scale=kind == "glu_dgrad")


def candidate_configs(kind: str, shape) -> list[Config]:
    """A small sweep around the table's choice: tile width (with the deepest pipeline that fits), grid order and the
    overlapped epilogue. (Fewer stages, wider epilogue chunks, block_k 128 and column-split tail tiles measured no
    faster: docs/kernels/grouped_matmul.md.)
    """
    base = table_config(kind, shape)
    out_cols = shape.k if kind in ("dgrad", "glu_dgrad") else shape.n
    # Column- and row-fastest orders (for wgrad, of a group's [K, N] output tiles). The row kernels also walk bands by
    # group, with their CTAs in step: without that the CTAs drift apart and group bands re-read as many weight tiles
    # as the other orders.
    orders = [("n", max(1, -(-out_cols // 256))), ("m", 8), ("m", 16)]
    orders.append(("n", 8) if kind == "wgrad" else ("g", 16))
    # glu_dgrad's consumers load [gate | up] tiles of 2 * block_n <= 256 columns themselves, or the pipeline's ring
    # carries them (config.gate_up_ring_slots: with the overlapped epilogue more stages than chunks).
    # 256-column candidates that get no ring slots would need a 512-column buffer, which never fits.
    widths = (64, 128, 256) if kind == "glu_dgrad" else (128, 256)
    candidates = {base}
    for block_n, (minor, width), overlap in itertools.product(widths, orders, (False, True)):
        for stages in (6, 5, 4, 3):
            config = dataclasses.replace(
                base,
                block_n=block_n,
                num_stages=stages,
                grid_minor=minor,
                grid_width=width,
                overlap_epilogue=overlap,
                keep_ctas_in_step=base.keep_ctas_in_step or minor == "g",
            )
            if config.fits(**epilogue_smem(kind, config, row_scale=kind == "glu_dgrad")):
                candidates.add(config)
                break
    return sorted(candidates, key=label)


def run_check(shapes, routings, seed: int) -> bool:
    """Gradients through the public op, both layouts, against the f32 oracle; rows past the sum must be zero."""
    ok = True
    for shape, routing, transpose in itertools.product(shapes, routings, (False, True)):
        s = input_sets(shape, seed)[0]
        group_sizes = shape.group_sizes(routing, seed=seed)
        # Route only 7/8 of the rows, so the kernels must write zeros past the sum (and the oracle sees the rest).
        group_sizes = (group_sizes * 7) // 8
        rhs = jnp.swapaxes(s["rhs"], 1, 2) if transpose else s["rhs"]

        @jax.jit
        def run(lhs, rhs, ct, group_sizes, transpose=transpose):
            op = functools.partial(moe_jax.grouped_matmul, transpose_rhs=transpose, backend="pallas")
            out, vjp = jax.vjp(lambda a, b: op(a, b, group_sizes), lhs, rhs)
            d_lhs, d_rhs = vjp(ct)
            return out, d_lhs, jnp.swapaxes(d_rhs, 1, 2) if transpose else d_rhs

        out, d_lhs, d_rhs = run(s["lhs"], rhs, s["ct"], group_sizes)
        oracle = GroupOracle(s["lhs"], s["rhs"], group_sizes, s["ct"])
        errors = oracle.errors((out, d_lhs, d_rhs))
        past = oracle.routed_rows
        tail = float(jnp.max(jnp.abs(out[past:]).astype(jnp.float32))) + float(
            jnp.max(jnp.abs(d_lhs[past:]).astype(jnp.float32))
        )
        good = max(errors) < 1e-2 and tail == 0.0
        ok &= good
        print(
            f"check {shape.name} {routing} transpose_rhs={transpose}: rel err out/dlhs/drhs "
            f"{' '.join(f'{e:.1e}' for e in errors)}, |rows past sum| {tail} -> {'ok' if good else 'FAIL'}",
            flush=True,
        )
    return ok


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tune_grouped_matmul", description=__doc__.split("\n")[0]
    )
    parser.add_argument("mode", choices=("check", "time", "tune"))
    parser.add_argument("--shapes", help="comma-separated GMM shape names or tags (default: every 'bench' shape)")
    parser.add_argument("--kinds", default="fwd,dgrad,wgrad", help=f"comma-separated from {TIMED_KINDS}")
    parser.add_argument("--configs", default="table", help="comma-separated configs for 'time'")
    parser.add_argument("--routing", default="uniform", choices=(*shape_registry.ROUTINGS, "even"))
    parser.add_argument("--groups", type=int, help="override G of every shape (a diagnostic: G=1 is a dense matmul)")
    parser.add_argument("--routings", default="uniform,half", help="for 'check'")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=8, help="threads compiling candidates at once")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per (kind, shape)")
    args = parser.parse_args(argv)
    shapes = common.named_shapes(
        args.shapes, shape_registry.GMM_SHAPES, shape_registry.gmm_shapes, shape_registry.gmm_shapes("bench")
    )
    if args.groups:
        shapes = [dataclasses.replace(shape, g=args.groups, name=f"{shape.name}@G{args.groups}") for shape in shapes]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, mode {args.mode}", flush=True)
    if args.mode == "check":
        sys.exit(0 if run_check(shapes, args.routings.split(","), args.seed) else 1)
    kinds = [kind for kind in args.kinds.split(",") if kind]
    unknown = [kind for kind in kinds if kind not in TIMED_KINDS]
    if unknown:
        raise SystemExit(f"unknown or untimed kind(s) {unknown}; this script times {TIMED_KINDS}")
    configs = [parse_config(spec) for spec in args.configs.split(",")]
    run_time(shapes, kinds, configs, args.routing, args.seed, args.iters, args.mode == "tune", args.jobs, args.rounds)


if __name__ == "__main__":
    main()
