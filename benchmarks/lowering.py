"""Where lowering time goes, on any host: ``python -m benchmarks.lowering`` (no GPU needed).

Lowers for CUDA (``.lower(lowering_platforms=("cuda",))`` under an abstract H200, as the CUDA lowering tests do) one
``moe_ffn`` layer's jitted forward + backward at the ``gpu`` config's coarse layer (T 8192, D 1024, F 2048, E 8,
k 2; ``train.compile_report.REFERENCE_LAYER``) and, with ``--train-step CONFIG``, that config's whole training step
(abstract parameters and optimizer state, backend "pallas"). For each it prints the trace and lower seconds and, kernel
by kernel, the seconds Pallas spends lowering each Mosaic GPU kernel instance (its jaxpr to a Mosaic GPU module:
the Pallas lowering, for warpgroup-semantics kernels Mosaic GPU's layout inference and dialect lowering, the
module's serialization), over ``--repeats`` lowerings of new functions (as a new process, or a second jit, would
do).

With ``--compile`` (on a GPU) it then lowers each function for the local GPU and compiles its distinct kernels one
at a time, each alone, then the whole program with every kernel already compiled: the seconds of each kernel's
compilation (the longest one bounds compiling them in parallel) and of XLA's own compilation of the rest.

The per-kernel lowering times come from wrapping Pallas's private ``lower_unpipelined_jaxpr_to_module``: a JAX
upgrade that renames it stops this tool with an AttributeError, not with wrong numbers.
"""

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.pallas.mosaic_gpu import pallas_call_registration
from jax.sharding import AbstractDevice, AbstractMesh

from benchmarks.common import run_metadata
from moe_jax.compilation import compile_kernel_program, named_kernel_programs

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


@contextlib.contextmanager
def kernel_lowering_times():
    """Yields a list that collects (kernel name, seconds) for every Mosaic GPU kernel lowered inside the context."""
    module = pallas_call_registration.lowering
    lower = module.lower_unpipelined_jaxpr_to_module
    times = []

    def timed(mesh, jax_mesh, jaxpr, *args, **kwargs):
        start = time.perf_counter()
        result = lower(mesh, jax_mesh, jaxpr, *args, **kwargs)
        times.append((jaxpr.debug_info.func_name, time.perf_counter() - start))
        return result

    module.lower_unpipelined_jaxpr_to_module = timed
    try:
        yield times
    finally:
        module.lower_unpipelined_jaxpr_to_module = lower


def lower_for_cuda(make) -> dict:
    """Trace and lower ``make()``'s (jitted, args) for CUDA on an abstract H200; the seconds of each phase and of
    each kernel's lowering."""
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=H200)), kernel_lowering_times() as kernels:
        jitted, args = make()
        start = time.perf_counter()
        traced = jitted.trace(*args)
        traced_at = time.perf_counter()
        traced.lower(lowering_platforms=("cuda",))
        lowered_at = time.perf_counter()
    return {"trace_s": traced_at - start, "lower_s": lowered_at - traced_at, "kernels": kernels}


def compile_on_gpu(make) -> dict:
    """Lowers ``make()``'s (jitted, args) for the local GPU, compiles each distinct Mosaic GPU kernel alone, one after
    another, then the program with all of them compiled; the seconds of each."""
    device = jax.local_devices()[0]
    if device.platform != "gpu":
        raise RuntimeError(f"--compile needs a GPU; the local device is a {device.platform}")
    jitted, args = make()
    lowered = jitted.trace(*args).lower()
    kernels = []
    for name, program in named_kernel_programs(lowered):
        start = time.perf_counter()
        compile_kernel_program(program, device)
        kernels.append((name, time.perf_counter() - start))
    start = time.perf_counter()
    lowered.compile()
    return {"kernels": kernels, "program_s": time.perf_counter() - start}


def compile_summary(name: str, result: dict) -> list[str]:
    """A table per compiled function: each kernel's compile seconds, longest first, then their sum and the rest."""
    lines = [f"## {name}: compilation on the GPU", "", "| kernel | compile, s |", "|---|---:|"]
    for kernel, seconds in sorted(result["kernels"], key=lambda item: -item[1]):
        lines.append(f"| {kernel} | {seconds:.2f} |")
    total = sum(seconds for _, seconds in result["kernels"])
    lines += [
        f"| all {len(result['kernels'])} kernels, one after another | {total:.2f} |",
        f"| the program, its kernels compiled (XLA's own compilation) | {result['program_s']:.2f} |",
        "",
    ]
    return lines


def train_step(config_name: str):
    """(the training step of ``config_name`` with backend "pallas", abstract (state, batch, batch))."""
    from train.configs import get_config
    from train.train import make_train_step, model_creator

    config = get_config(config_name)
    graphdef, state = nnx.split(model_creator(config, "pallas").eval_shape())
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
    return make_train_step(config, graphdef), (state, batch, batch)


def summary(name: str, runs: list[dict]) -> list[str]:
    """A table per measured function: each kernel's instances and median lowering seconds, then the phases."""
    median = statistics.median
    per_kernel = collections.defaultdict(list)
    for run in runs:
        totals = collections.Counter()
        counts = collections.Counter()
        for kernel, seconds in run["kernels"]:
            totals[kernel] += seconds
            counts[kernel] += 1
        for kernel in totals:
            per_kernel[kernel].append((counts[kernel], totals[kernel]))
    lines = [f"## {name}", "", "| kernel | instances | lowering, s |", "|---|---:|---:|"]
    for kernel, values in sorted(per_kernel.items(), key=lambda item: -median([s for _, s in item[1]])):
        lines.append(f"| {kernel} | {values[0][0]} | {median([s for _, s in values]):.2f} |")
    kernel_s = median([sum(s for _, s in run["kernels"]) for run in runs])
    lines += [
        f"| all {len(runs[0]['kernels'])} kernels | | {kernel_s:.2f} |",
        "",
        f"trace {median([r['trace_s'] for r in runs]):.2f} s, lower {median([r['lower_s'] for r in runs]):.2f} s "
        f"(medians of {len(runs)})",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    from train.compile_report import REFERENCE_LAYER, layer_step

    parser = argparse.ArgumentParser(prog="python -m benchmarks.lowering", description=__doc__.split("\n")[0])
    parser.add_argument("--train-step", metavar="CONFIG", help="also lower this config's training step (e.g. gpu-moe)")
    parser.add_argument("--repeats", type=int, default=2, help="lowerings of each function (default 2)")
    parser.add_argument("--compile", action="store_true", help="also time the kernels' and XLA's compilation (GPU)")
    parser.add_argument("--out", help="also write the measurements as JSON here")
    args = parser.parse_args(argv)
    command = " ".join(["python -m benchmarks.lowering", *(sys.argv[1:] if argv is None else argv)])

    measured = {"reference layer": lambda: layer_step(REFERENCE_LAYER, "pallas")}
    if args.train_step:
        measured[f"{args.train_step} training step"] = lambda: train_step(args.train_step)
    results = {name: [lower_for_cuda(make) for _ in range(args.repeats)] for name, make in measured.items()}
    for name, runs in results.items():
        print("\n".join(summary(name, runs)))
    compiled = {name: compile_on_gpu(make) for name, make in measured.items()} if args.compile else {}
    for name, result in compiled.items():
        print("\n".join(compile_summary(name, result)))
    if args.out:
        with open(args.out, "w") as f:
            record = {"meta": run_metadata(command, {}), "results": results, "compiled": compiled}
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
