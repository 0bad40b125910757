"""Where a training step's GPU time goes, kernel by kernel: ``python -m train.profile_step --config gpu-moe``.

Builds the model and compiles the step as ``python -m train`` does, runs ``--warmup`` steps on the training data's
first batches (the routing, and with it the experts' row counts, follows the data), then times and profiles
``--profile-steps`` more with ``jax.profiler`` (CUPTI), and puts every GPU kernel in one part of the step by the JAX
name scope of the HLO op that launched it (``train/model.py`` scopes "attention" and "moe", ``train/train.py``
"optimizer"):

  attention            the attention sublayer's kernels (cuDNN's fused attention, its projections' GEMMs, RoPE,
                       the norm), forward and backward
  moe: <kernel>        our Mosaic GPU kernels, by kernel name (``moe_gmm*``, ``moe_gating``, the permutes)
  moe: XLA             XLA's work inside the MoE sublayer (router matmul, routing glue, aux losses, norm)
  optimizer            the AdamW update and the balancing-bias update
  other                the rest: embedding, LM head and loss, gradient accumulation

A kernel whose trace names no HLO op, and whose name is no fusion's, counts as "other" and is reported as
unattributed. It prints each part's ms per step and share of the step's kernel time, the share in our kernels, the
heaviest kernels, and the step's wall time and MFU (``train.metrics``); ``--out`` writes the ``{meta, results}``
record.
"""

import argparse
import collections
import dataclasses
import gzip
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import profiled_kernels, run_metadata, split_calls
from train.compilation import abstract, compile_ahead, compiler_options
from train.configs import get_config
from train.main import add_model_flags, with_overrides
from train.metrics import mfu, peak_flops, training_flops_per_token
from train.train import batch_sharding, create_model, load_data, make_mesh, make_train_step, to_device

SCOPES = ("attention", "moe", "optimizer")
# By default XLA launches a step's kernels from command buffers (CUDA graphs), and the trace gives a kernel launched
# from one the buffer's op, not its own: the profiled step is compiled to launch every kernel by itself (the same
# kernels; the step's time moves within about 1 %), on top of the options ``train`` compiles it with.
PROFILE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
TOP_KERNELS = 15
# An HLO instruction's name and the JAX name stack it was traced under, from the compiled module's text.
_HLO_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"', re.MULTILINE)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` metadata (the JAX name stack) in an HLO module's text; each name also
    as its kernel is called ("loop_add_fusion.9" launches "loop_add_fusion_9")."""
    names = {}
    for name, op_name in _HLO_OP_NAME.findall(hlo_text):
        names[name] = names[re.sub(r"[.\-]", "_", name)] = op_name
    return names


def scope_of(op_name: str) -> str | None:
    """The first of ``SCOPES`` that is a component of the name stack ``op_name`` (a transposed op's stack wraps its
    components, "transpose(jvp(moe))"), else None."""
    for scope in SCOPES:
        if re.search(rf"(^|[/(]){scope}([/)]|$)", op_name):
            return scope
    return None


def part_of(kernel: str, hlo_op: str, names: dict[str, str]) -> str | None:
    """The part of the step (module docstring) that launched ``kernel`` from HLO op ``hlo_op``; None where neither
    names an op of the step."""
    if kernel.startswith("moe_"):
        return f"moe: {kernel}"
    # The kernel of a fusion carries the fusion's name where the trace has no HLO op for it.
    op_name = names.get(hlo_op) or names.get(kernel)
    if op_name is None:
        return None
    scope = scope_of(op_name)
    if scope == "moe":
        return "moe: XLA"
    return scope or "other"


def summarize(steps: list[list[tuple[str, int, int, str]]], names: dict[str, str]) -> dict:
    """Median µs per step of each part and of the heaviest kernels over the profiled steps."""
    per_part, per_kernel, unattributed = [], [], []
    for step in steps:
        unattributed.append(0.0)
        parts, kernels = collections.defaultdict(float), collections.defaultdict(float)
        for kernel, _, duration_ns, hlo_op in step:
            part = part_of(kernel, hlo_op, names)
            parts[part or "other"] += duration_ns / 1e3
            unattributed[-1] += 0 if part else duration_ns / 1e3
            kernels[kernel[:90]] += duration_ns / 1e3
        per_part.append(parts)
        per_kernel.append(kernels)

    def medians(rows: list[dict]) -> dict[str, float]:
        keys = sorted({key for row in rows for key in row})
        return {key: float(np.median([row.get(key, 0.0) for row in rows])) for key in keys}

    parts = dict(sorted(medians(per_part).items(), key=lambda item: -item[1]))
    kernels = dict(sorted(medians(per_kernel).items(), key=lambda item: -item[1])[:TOP_KERNELS])
    total = float(np.median([sum(row.values()) for row in per_part]))
    ours = sum(us for part, us in parts.items() if part.startswith("moe: moe_"))
    return {
        "kernel_us": total,
        "parts_us": parts,
        "our_kernels_share": ours / total,
        "unattributed_us": float(np.median(unattributed)),
        "top_kernels_us": kernels,
    }


def profile(config, *, backend: str, warmup: int, steps: int, hlo_out: str | None = None) -> dict:
    """Compiles ``config``'s step, runs ``warmup`` steps and profiles ``steps`` more; the summary with wall time.
    ``hlo_out``: where to write the compiled step's HLO text, gzipped (to look up what a kernel belongs to)."""
    mesh = make_mesh(config.expert_parallelism)
    with jax.set_mesh(mesh):
        model, optimizer = create_model(config, backend)
        graphdef, state = nnx.split((model, optimizer))
        sharding = batch_sharding(mesh)
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32, sharding=sharding)
        options = compiler_options(backend=backend, quick=False) | PROFILE_COMPILER_OPTIONS
        step, times = compile_ahead(make_train_step(config, graphdef), abstract(state), batch, batch, options=options)
        hlo_text = step.as_text()
        names = op_names(hlo_text)
        if hlo_out:
            with gzip.open(hlo_out, "wt") as f:
                f.write(hlo_text)
        train_data = load_data(config)[0]
        batches = iter(to_device(train_data.batch(i), sharding, config.batch_size) for i in range(warmup + 2 * steps))

        def run(count: int):
            nonlocal state
            for _ in range(count):
                state, metrics = step(state, *next(batches))
            jax.block_until_ready(metrics)

        run(warmup)
        started = time.perf_counter()
        run(steps)
        wall_s = (time.perf_counter() - started) / steps
        events = profiled_kernels(lambda: run(steps))
    summary = summarize(split_calls(events, steps), names)
    peak = peak_flops(jax.devices()[0], config.model.dtype)
    tokens_per_s = config.tokens_per_step / wall_s
    step_mfu = mfu(tokens_per_s, training_flops_per_token(config.model, config.seq_len), peak, jax.device_count())
    return {"step_ms": wall_s * 1e3, "mfu": step_mfu, "compile": dataclasses.asdict(times), **summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.profile_step", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="gpu-moe", help="the named TrainConfig (default gpu-moe)")
    parser.add_argument("--backend", default="pallas", choices=("xla", "pallas"))
    add_model_flags(parser)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--out", help="write the {meta, results} JSON record here")
    parser.add_argument("--hlo-out", help="write the compiled step's HLO text here, gzipped")
    # What train.main.with_overrides reads and this tool leaves at the config's.
    parser.set_defaults(steps=None, expert_parallel=None, dispatch=None)
    args = parser.parse_args(argv)

    config = with_overrides(get_config(args.config), args)
    result = {"config": args.config, "backend": args.backend, "quantization": args.quantization}
    result |= profile(config, backend=args.backend, warmup=args.warmup, steps=args.profile_steps, hlo_out=args.hlo_out)
    print_summary(result)
    if args.out:
        command = " ".join(["python -m train.profile_step", *(sys.argv[1:] if argv is None else argv)])
        with open(args.out, "w") as f:
            json.dump({"meta": run_metadata(command, {}), "results": result}, f, indent=1)


def print_summary(result: dict) -> None:
    total = result["kernel_us"]
    step_mfu = "-" if result["mfu"] is None else f"{result['mfu']:.1%}"
    print(
        f"{result['config']} {result['backend']} quantization={result['quantization']}: step {result['step_ms']:.1f} "
        f"ms wall, {total / 1e3:.1f} ms of kernels, MFU {step_mfu}, our kernels {result['our_kernels_share']:.1%}, "
        f"unattributed {result['unattributed_us'] / total:.1%}"
    )
    for part, us in result["parts_us"].items():
        print(f"  {part:32s} {us / 1e3:8.2f} ms  {us / total:6.1%}")
    print("  heaviest kernels:")
    for name, us in result["top_kernels_us"].items():
        print(f"    {us / 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
