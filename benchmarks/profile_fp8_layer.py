"""Device time of the FP8 layer, kernel by kernel (``python -m benchmarks.profile_fp8_layer``).

``moe_ffn(quantization=..., backend="pallas")`` forward and forward + backward at a layer shape, beside the bf16
layer (``quantization=None``), each profiled with ``jax.profiler`` (CUPTI) over ``--calls`` calls after a warm-up.
Every kernel is put in one class by its name:

  gemm       the grouped-matmul kernels (``moe_gmm*``: FP8 and bf16, forward, dgrad, wgrad) and XLA's GEMMs
  quantize   the quantizer kernels (``moe_quantize_*``: activations, the weights' two FP8 layouts, the wgrad's
             token blocks) and XLA's fusions that make FP8 values or scales (a convert to f8e4m3fn or an amax
             reduction in the fusion's name)
  layout     XLA's transposes and copies (the FP8 weights' second layout, the activation scales' transposes)
  other      everything else (routing, permute / combine, the GLU's backward in XLA, the aux losses)

and the table gives each class's median µs per call and share of the call's kernel time, plus the heaviest kernels
by name with their launches per call, so that what the quantization costs (every quantize pass and scale write, and
the FP8 copies' transposes) is read from one run. ``--weights`` says how the FP8 layer gets its weights:
"per-call" (the default: it quantizes them in the call), "stored" (copies made before the call,
``moe_jax.quantize_master``, as the layer bench's "-stored" row and a training step's micro-batches have them: the
quantize class is then the activations' and gradients' passes alone), or both, comma-separated. Usage (GPU
machine): ``python -m benchmarks.profile_fp8_layer --shapes qwen3-30b-a3b --calls 5 [--weights per-call,stored]
[--out FILE]``.
"""

import argparse
import collections
import json
import re
import sys

import jax
import numpy as np

from benchmarks import common, layer
from benchmarks.shapes import LAYER_SHAPES

CLASSES = ("gemm", "quantize", "layout", "other")
TOP_KERNELS = 12


def kernel_class(name: str) -> str:
    """The class of a kernel by its name (module docstring)."""
    if name.startswith("moe_gmm") or re.search(r"gemm|nvjet|xmma|cutlass|cublas", name):
        return "gemm"
    if name.startswith("moe_quantize") or re.search(r"f8e4m3|amax|reduce.*convert|convert.*reduce", name):
        return "quantize"
    if re.search(r"transpose|copy", name):
        return "layout"
    return "other"


def summarize(calls: list[list[tuple[str, int, int]]]) -> dict:
    """Median µs per class and per kernel name over the calls, and the median total."""
    per_class, per_kernel, per_kernel_launches = [], [], []
    for call in calls:
        classes, kernels = collections.defaultdict(float), collections.defaultdict(float)
        launches = collections.Counter(name for name, _, _ in call)
        for name, _, duration in call:
            classes[kernel_class(name)] += duration / 1e3
            kernels[name] += duration / 1e3
        per_class.append(classes)
        per_kernel.append(kernels)
        per_kernel_launches.append(launches)

    def median(rows, key):
        return float(np.median([row.get(key, 0.0) for row in rows]))

    names = sorted({name for row in per_kernel for name in row})
    kernels = {name: median(per_kernel, name) for name in names}
    top = dict(sorted(kernels.items(), key=lambda item: -item[1])[:TOP_KERNELS])
    return {
        "total_us": float(np.median([sum(row.values()) for row in per_class])),
        "classes_us": {c: median(per_class, c) for c in CLASSES},
        "top_kernels_us": top,
        "top_kernel_launches": {name: median(per_kernel_launches, name) for name in top},
    }


# Where the FP8 layer's weight copies come from: it quantizes the weights in the call, or reads copies made before.
WEIGHT_SOURCES = ("per-call", "stored")


def profile(shape, quantization, *, backward: bool, calls: int, seed: int, weight_source: str | None = None) -> dict:
    """The layer's kernel time by class (``summarize``); ``weight_source`` "stored" (FP8 only) runs it on copies made
    before the call."""
    inputs = layer.make_inputs(shape, seed=seed)[0]
    names = ("x", "router_kernel", "w_gate_up", "w_down")
    route_kwargs = common.routing_kwargs(shape, seed)
    forward = common.layer_output(common.moe_ffn_layer(shape, "pallas", route_kwargs, quantization))
    args = tuple(inputs[n] for n in names)
    if weight_source == "stored":
        copies = layer.stored_copies(inputs)
        forward = layer.on_stored_copies(forward)
        args += (copies["gate_up_copies"], copies["down_copies"])
    fn = jax.jit(common.forward_backward(forward, len(names)) if backward else forward)
    args += (inputs["ct"],) if backward else ()
    return summarize(common.kernel_calls(fn, [args], calls))


def runs(quantization: str, weight_sources: tuple[str, ...]) -> list[tuple[str | None, str | None]]:
    """(quantization, weight source) of each profile at a shape and pass: the bf16 layer first (no FP8 weights),
    then the FP8 ones."""
    return [(None, None)] + [(quantization, source) for source in weight_sources]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b", help="comma-separated layer shapes")
    parser.add_argument("--quantization", default="fp8_block", choices=("fp8_block",), help="what the kernels run")
    parser.add_argument(
        "--weights",
        default="per-call",
        help=f"comma-separated, of {WEIGHT_SOURCES}: the FP8 layer quantizing its weights in the call, or on stored "
        "copies",
    )
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write {meta, results} JSON here")
    args = parser.parse_args(argv)
    weight_sources = tuple(args.weights.split(","))
    if not set(weight_sources) <= set(WEIGHT_SOURCES):
        parser.error(f"--weights must name some of {WEIGHT_SOURCES}, got {args.weights!r}")
    results = []
    for name in args.shapes.split(","):
        shape = LAYER_SHAPES[name]
        for backward in (False, True):
            for quantization, source in runs(args.quantization, weight_sources):
                options = dict(backward=backward, calls=args.calls, seed=args.seed, weight_source=source)
                summary = profile(shape, quantization, **options)
                results.append(
                    dict(shape=name, backward=backward, quantization=quantization, weights=source, **summary)
                )
                _print(results[-1])
    if args.out:
        command = " ".join(["python -m benchmarks.profile_fp8_layer", *(sys.argv[1:] if argv is None else argv)])
        meta = common.run_metadata(command, {})
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def _print(result: dict) -> None:
    mode = "fwd+bwd" if result["backward"] else "fwd"
    total = result["total_us"]
    what = f"quantization={result['quantization']}" + (", stored weights" if result["weights"] == "stored" else "")
    print(f"\n{result['shape']} {mode} {what}: {total:.0f} µs of kernels per call")
    for name, us in result["classes_us"].items():
        print(f"  {name:9s} {us:9.0f} µs  {us / total:6.1%}")
    for name, us in result["top_kernels_us"].items():
        print(f"    {us:9.0f} µs  {result['top_kernel_launches'][name]:3.0f} x  {name[:100]}")


if __name__ == "__main__":
    main()
