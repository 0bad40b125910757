"""Device time of the MoE layer's forward, kernel by kernel and stage by stage (``python -m benchmarks.profile_layer``).

The layer bench (``layer.py``) times whole calls from the host: each sample also holds the call's dispatch, and the
glue it derives (layer - experts - router) is a difference of three such medians, which moved by up to
0.2 ms between runs at the Qwen3 layer. Here ``jax.profiler`` (CUPTI) records every kernel of ``--calls`` calls of
the jitted ``moe_ffn`` forward (backend "pallas") after a warm-up, and each kernel is put in a stage by its name
(the Mosaic GPU kernels are named for what they do, ``moe_gating``, ``moe_gmm_gather_glu``, ...):

  router     the router matmul (XLA's GEMM)             gate_up    moe_gmm[_gather]_glu
  gating     moe_gating                                 down       moe_gmm_row_scale
  xla-glue   XLA's other kernels: the counting sort's   permute    moe_scatter_rows (F > 1024: not gathered)
             end, the rows' weights, the aux losses     combine    moe_gather_rows
  other      a Mosaic GPU kernel the forward should not run (listed, never counted as glue)

With ``--glue`` it also profiles the routing bench's glue functions (``routing.stage_functions``: "glue" with the
permute, "glue-fused" without) on both backends, so that the target "glue >= 2x XLA's" can be read in device time as
well as in the bench's wall clock, which holds each call's dispatch and host sync.

The same is done for the expert kernels alone on rows already sorted (``glu_mlp``, the layer bench's
experts:pallas), so that what the gather costs the gate_up kernel is the difference of two kernel times (zero where
the layer permutes first and gathers nothing). The layer's glue is then gating + xla-glue + permute + combine + that
difference where it is a cost (a gathered kernel faster than the sorted-rows one adds nothing: ``layer_glue_us``), and
its share is over the layer's span (first kernel start to last kernel end of a call, which also
counts any gap between kernels). Medians over the calls.

The target is glue <= 10% of the span. Each shape's table also says how much glue that allows while the other
kernels keep their time, and how much of it the combine (and the permute, where the layer permutes first) needs at
the least: their bf16 rows' bytes at the read rate, the fastest pass through this card's HBM, measured once per run
(``grouped_matmul.read_pass``, in device time like everything here).

Usage (GPU machine): ``python -m benchmarks.profile_layer [--shapes qwen3-30b-a3b,deepseek-v3] --calls 20 [--glue]``
(by default every benchmark layer: qwen3-30b-a3b, gpt-oss-120b, deepseek-v3).
"""

import argparse
import collections
import functools
import json
import re
import sys

import jax
import numpy as np

import moe_jax
from benchmarks import common, grouped_matmul, layer, routing
from benchmarks.shapes import LAYER_SHAPES, layer_shapes

GLUE_STAGES = ("gating", "xla-glue", "permute", "combine")
GLUE_TARGET_SHARE = 0.10  # the target: the glue's share of the layer's forward span, at most
GLUE_FUNCTIONS = ("glue", "glue-fused")  # routing.stage_functions profiled by --glue
GLUE_BACKENDS = ("xla", "pallas")
STAGES = ("router", "gating", "xla-glue", "permute", "gate_up", "down", "combine", "other")
# The Mosaic GPU kernels of the forward, by the name they run under (their kernel_name + "_mosaic_gpu_kernel").
MOSAIC_STAGES = {
    "moe_gating": "gating",
    "moe_gmm_glu": "gate_up",
    "moe_gmm_gather_glu": "gate_up",
    "moe_gmm_row_scale": "down",
    "moe_gmm": "down",
    "moe_scatter_rows": "permute",
    "moe_gather_rows": "combine",
}
MOSAIC_SUFFIX = "_mosaic_gpu_kernel"


def stage_of(kernel: str) -> str:
    """The stage of a kernel of the layer's forward, by its name (module docstring); "other" for a Mosaic GPU kernel
    the forward does not run."""
    if kernel.endswith(MOSAIC_SUFFIX):
        return MOSAIC_STAGES.get(kernel.removesuffix(MOSAIC_SUFFIX), "other")
    if re.search(r"gemm|nvjet|xmma|cutlass", kernel):
        return "router"
    return "xla-glue"


def stage_times(call: list[tuple[str, int, int]]) -> dict[str, float]:
    """Microseconds per stage in one call, plus "span" (first kernel start to last kernel end)."""
    times = collections.defaultdict(float)
    for name, _, duration in call:
        times[stage_of(name)] += duration / 1e3
    times["span"] = call_span_us(call)
    return dict(times)


def _medians(per_call: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the calls (0 in a call that lacks the key)."""
    keys = sorted({key for times in per_call for key in times})
    return {key: float(np.median([times.get(key, 0.0) for times in per_call])) for key in keys}


def medians(calls: list[list[tuple[str, int, int]]]) -> dict[str, float]:
    return _medians([stage_times(call) for call in calls])


def read_rate_bytes_per_s(calls: int) -> float:
    """The HBM read rate: bytes of ``grouped_matmul.read_pass`` over its median device time (``calls`` calls)."""
    read, buffer, moved = grouped_matmul.read_pass(grouped_matmul.READ_BYTES_CAP)
    timing, _ = common.device_time_fn(read, [(buffer,)], iters=calls, warmup=3, max_seconds=1.0, min_samples=calls)
    return moved / timing.median_s


def row_bytes(shape, *, permutes: bool) -> int:
    """The bf16 bytes the combine moves at the least: it reads the [T * k, D] expert rows and writes y [T, D]. A
    layer that permutes first moves as many again the other way (reads x [T, D], writes the sorted rows)."""
    one_way = 2 * shape.t * shape.d * (shape.top_k + 1)
    return one_way * (2 if permutes else 1)


def glue_budget_us(span: float, glue: float, share: float = GLUE_TARGET_SHARE) -> float:
    """The most glue for glue / span <= ``share`` while the other kernels keep their (span - glue) µs."""
    return (span - glue) * share / (1.0 - share)


def profile_shape(shape, calls: int, seed: int, read_rate: float) -> dict:
    """Stage medians of the layer and of the expert kernels on sorted rows, the glue they imply, and the glue the
    target share allows next to the combine's floor at ``read_rate`` (bytes / s). Times in µs."""
    route_kwargs = common.routing_kwargs(shape, seed)
    inputs = layer.make_inputs(shape, seed=seed)[0]

    @jax.jit
    def forward(x, router_kernel, w_gate_up, w_down):
        y, _ = moe_jax.moe_ffn(
            x, router_kernel, w_gate_up, w_down, activation=shape.activation, backend="pallas", **route_kwargs
        )
        return y

    static_kwargs = tuple(sorted((k, v) for k, v in route_kwargs.items() if k != "bias"))
    operands = layer.expert_operands(
        inputs["x"],
        inputs["router_kernel"],
        route_kwargs.get("bias"),
        top_k=shape.top_k,
        route_kwargs_items=static_kwargs,
    )
    experts = jax.jit(functools.partial(layer.expert_gemms, activation=shape.activation))
    layer_args = tuple(inputs[n] for n in ("x", "router_kernel", "w_gate_up", "w_down"))
    layer_calls = common.kernel_calls(forward, [layer_args], calls)
    expert_args = [operands["expert_rows"], inputs["w_gate_up"], inputs["w_down"]]
    expert_args += [operands["group_sizes"], operands["row_weights"]]
    expert_calls = common.kernel_calls(experts, [tuple(expert_args)], calls)
    stages, sorted_rows = medians(layer_calls), medians(expert_calls)
    gather_cost = gather_cost_us(stages, sorted_rows)
    glue_kernels = sum(stages.get(stage, 0.0) for stage in GLUE_STAGES)
    glue = layer_glue_us(glue_kernels, gather_cost)
    kernels = collections.Counter(name for name, _, _ in layer_calls[-1])
    kernel_us = kernel_medians(layer_calls)
    moved = row_bytes(shape, permutes="permute" in stages)
    return {
        "shape": shape.name,
        "stages_us": stages,
        "sorted_rows_gate_up_us": sorted_rows.get("gate_up", 0.0),
        "gather_cost_us": gather_cost,
        "glue_kernels_us": glue_kernels,
        "glue_us": glue,
        "glue_share": glue / stages["span"],
        "glue_budget_us": glue_budget_us(stages["span"], glue),
        "row_bytes": moved,
        "read_rate_tbs": read_rate / 1e12,
        "row_floor_us": moved / read_rate * 1e6,
        "kernels": {
            name: {"count": count, "stage": stage_of(name), "us": kernel_us[name]} for name, count in kernels.items()
        },
    }


def kernel_times(call: list[tuple[str, int, int]]) -> dict[str, float]:
    """Microseconds per kernel name in one call (all its launches summed)."""
    times = collections.defaultdict(float)
    for name, _, duration in call:
        times[name] += duration / 1e3
    return dict(times)


def kernel_medians(calls: list[list[tuple[str, int, int]]]) -> dict[str, float]:
    """Microseconds per kernel name in a call, median over the calls."""
    return _medians([kernel_times(call) for call in calls])


def call_span_us(call: list[tuple[str, int, int]]) -> float:
    """First kernel start to last kernel end of one call, µs."""
    return (max(start + duration for _, start, duration in call) - call[0][1]) / 1e3


def profile_glue(shape, calls: int, seed: int) -> dict:
    """Per glue function and backend: the median span of a call's kernels and the median sum of their times (µs)."""
    route_kwargs = common.routing_kwargs(shape, seed)
    inputs = routing.Inputs(shape, seed, route_kwargs)
    result = {}
    for stage in GLUE_FUNCTIONS:
        args = inputs.arg_sets(stage)[0]
        for backend in GLUE_BACKENDS:
            per_call = common.kernel_calls(routing.stage_functions(shape, backend, route_kwargs)[stage], [args], calls)
            result[f"{stage}:{backend}"] = {
                "span_us": float(np.median([call_span_us(call) for call in per_call])),
                "kernels_us": float(np.median([sum(d for _, _, d in call) / 1e3 for call in per_call])),
                "launches": len(per_call[0]),
            }
    return result


def glue_markdown(shape_name: str, glue: dict) -> str:
    lines = [
        f"#### {shape_name}: the routing bench's glue functions, device time per call, µs (median)",
        "",
        "| function | xla span | xla kernels (launches) | pallas span | pallas kernels (launches) | xla / pallas |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for stage in GLUE_FUNCTIONS:
        xla, pallas = glue[f"{stage}:xla"], glue[f"{stage}:pallas"]
        lines.append(
            f"| {stage} | {xla['span_us']:.1f} | {xla['kernels_us']:.1f} ({xla['launches']}) | "
            f"{pallas['span_us']:.1f} | {pallas['kernels_us']:.1f} ({pallas['launches']}) | "
            f"{xla['span_us'] / pallas['span_us']:.2f}x |"
        )
    return "\n".join(lines)


def gather_cost_us(stages: dict, sorted_rows: dict) -> float:
    """What gathering the rows cost the layer's gate_up kernel: its time less the kernel's on sorted rows.

    A layer that permutes first (F > ``glu_mlp.api.GATHER_MAX_D_FF``) runs the sorted-rows kernel itself: nothing to
    cost, and the difference of two runs of one kernel would be noise counted as glue.
    """
    if "permute" in stages:
        return 0.0
    return stages.get("gate_up", 0.0) - sorted_rows.get("gate_up", 0.0)


def layer_glue_us(glue_kernels: float, gather_cost: float) -> float:
    """The layer's glue: its glue kernels plus what the gather costs the gate_up kernel. A gather that makes the
    kernel faster (deepseek-v3 on an H100: x [T, D] stays in L2 where the sorted rows [T * k, D] do not) counts as
    zero, not as negative glue: that gain is the GEMM's."""
    return glue_kernels + max(gather_cost, 0.0)


def markdown(result: dict) -> str:
    stages = result["stages_us"]
    span = stages["span"]
    lines = [
        f"#### {result['shape']}: moe_ffn forward (pallas), device time per call, µs (median)",
        "",
        "| stage | µs | share of the span |",
        "|---|---:|---:|",
    ]
    lines += [f"| {stage} | {stages[stage]:.1f} | {stages[stage] / span:.1%} |" for stage in STAGES if stage in stages]
    lines += [
        f"| span (first kernel start to last kernel end) | {span:.1f} | 100% |",
        f"| gate_up on sorted rows (glu_mlp) | {result['sorted_rows_gate_up_us']:.1f} | |",
        f"| gather cost (gate_up - gate_up on sorted rows; < 0: a gain) | {result['gather_cost_us']:.1f} | "
        f"{result['gather_cost_us'] / span:.1%} |",
        f"| glue kernels = {' + '.join(GLUE_STAGES)} | {result['glue_kernels_us']:.1f} | "
        f"{result['glue_kernels_us'] / span:.1%} |",
        f"| **glue** = glue kernels + gather cost (a gain counts 0) | **{result['glue_us']:.1f}** | "
        f"**{result['glue_share']:.1%}** |",
        f"| glue allowed at <= {GLUE_TARGET_SHARE:.0%} (the other kernels' {span - result['glue_us']:.1f} µs x "
        f"{GLUE_TARGET_SHARE:g} / {1 - GLUE_TARGET_SHARE:g}) | {result['glue_budget_us']:.1f} | |",
        f"| the rows' floor: combine{' + permute' if 'permute' in stages else ''}, "
        f"{result['row_bytes'] / 1e6:.0f} MB at the read rate ({result['read_rate_tbs']:.2f} TB/s) | "
        f"{result['row_floor_us']:.1f} | {result['row_floor_us'] / span:.1%} |",
        f"| left of the allowance for the rest of the glue, were the rows at their floor | "
        f"{result['glue_budget_us'] - result['row_floor_us']:.1f} | |",
        "",
        "| glue kernel | launches | µs |",
        "|---|---:|---:|",
    ]
    glue_kernels = [(name, k) for name, k in result["kernels"].items() if k["stage"] in GLUE_STAGES]
    lines += [
        f"| {name} ({k['stage']}) | {k['count']} | {k['us']:.1f} |"
        for name, k in sorted(glue_kernels, key=lambda item: -item[1]["us"])
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_layers = ",".join(shape.name for shape in layer_shapes("bench"))
    parser.add_argument("--shapes", default=bench_layers, help="comma-separated layer shapes (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=20, help="profiled calls per function (after 3 warm-up calls)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--glue", action="store_true", help="also profile the routing bench's glue, xla and pallas")
    parser.add_argument("--out", help="write {meta, results} JSON here")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes.split(",") if name not in LAYER_SHAPES]
    if unknown:
        raise SystemExit(f"unknown layer shape(s) {unknown}; known: {', '.join(LAYER_SHAPES)}")
    command = " ".join(["python", "-m", "benchmarks.profile_layer", *(sys.argv[1:] if argv is None else argv)])
    meta = common.run_metadata(command, {})
    print(f"{meta['date']} | {meta['device_kind']} | jax {meta['jax']} | git {meta['git_revision']}\n")
    print(f"command: `{command}`\n")
    read_rate = read_rate_bytes_per_s(args.calls)
    print(
        f"HBM read rate (device time, {grouped_matmul.READ_BYTES_CAP / 2**30:g} GiB row sum): "
        f"{read_rate / 1e12:.3f} TB/s\n"
    )
    results = []
    for name in args.shapes.split(","):
        results.append(profile_shape(LAYER_SHAPES[name], args.calls, args.seed, read_rate))
        print(markdown(results[-1]) + "\n", flush=True)
        if args.glue:
            results[-1]["glue_functions"] = profile_glue(LAYER_SHAPES[name], args.calls, args.seed)
            print(glue_markdown(name, results[-1]["glue_functions"]) + "\n", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
