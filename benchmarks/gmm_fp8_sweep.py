"""The FP8 grouped-matmul kernel's variants, checked and timed on the GPU beside XLA's dense FP8 matmul and our bf16
kernel (``python -m benchmarks.gmm_fp8_sweep [--out FILE] [--time-limit SECONDS]``, about 4 minutes on an H200).

Per shape (SHAPES, uniform routing) the forward runs on quantized operands (x in 1 x 128 blocks, w [G, N, K] in
128 x 128 blocks, the fp8_block recipe) with f32 outputs, through ``launch.run_fp8_forward_kernel`` with each
variant's Config (VARIANTS): "auto" is ``config.fp8_config``'s, what ``grouped_matmul(quantization="fp8_block")``
runs; the others fix the consumer count or take a stage fewer (the first shape runs them all, the others all but
that). gpt-oss-120b/down checks the contraction's partial last block (K = N = 2880) on the device. Every variant's
output is checked against the XLA implementation on three groups, each run alone
(``grouped_matmul.QuantizedGroupOracle``), at CHECK_TOLS (the GPU tests' f32 tolerance: the tensor cores accumulate
~14 bits within a 128-wide K block; a lost scale or block errs by O(1)); a variant past it is "wrong".

Times are device times (CUPTI, ``common.kernel_calls``) of the grouped-matmul kernel alone, median over CALLS calls:
the scales' transpose and padding XLA does around it are left out. Baselines of the same FLOPs: "dense-fp8", XLA's
per-tensor FP8 matmul [M, K] . [N, K]^T (f32 out; cuBLASLt's, unless --triton-gemm lets XLA also autotune Triton
GEMMs, which takes minutes), and "bf16", our bf16 kernel on the same weights in bf16. Columns:
ms, TF/s, ratio to dense-fp8, fraction of the H200's dense FP8 peak (PEAK_TFLOPS), and the first call's seconds
(compile included). The records go to ``--out`` as JSONL (a metadata line, then one ``common.Record`` per row).
"""

import argparse
import dataclasses
import functools
import os
import shlex
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from benchmarks import common
from benchmarks.grouped_matmul import QuantizedGroupOracle
from benchmarks.shapes import GMM_SHAPES
from moe_jax.ops.grouped_matmul import api, config, launch

SHAPES = ("dsv3-ep8/gate_up", "dsv3-ep8/down", "gpt-oss-120b/down", "mixtral/gate_up", "qwen3-30b/gate_up")
# XLA autotunes its FP8 dot over Triton configs for 50-180 s a shape on an H200 (the first calls of the gmm bench's
# dense rows); without Triton's GEMMs it picks among cuBLASLt's algorithms in seconds. Set before the backend starts.
NO_TRITON_GEMM_FLAG = "--xla_gpu_enable_triton_gemm=false"


def _fp8_config(dims: dict, **choices) -> config.Config:
    """fp8_config at the shape's dims and output itemsize ({m, k, n, g, out_itemsize})."""
    return config.fp8_config(**dims, **choices)


def _fewer_stages(dims: dict) -> config.Config:
    chosen = _fp8_config(dims)
    return dataclasses.replace(chosen, num_stages=chosen.num_stages - 1)


# name -> (Config at the shape's dims {m, k, n, g}, whether it runs at every shape or at the first only), in the order
# they run (a --time-limit skips the last). "auto" is fp8_config's choice (three consumers of 64 rows where
# N >= config.FP8_THREE_CONSUMERS_MIN_N, else two on 192 columns); "2 consumers" (on 128 columns) and "3 consumers"
# fix the count at every shape (fp8_config re-fits the stages to the tile), "2 consumers 192 columns" takes 128 x 192
# tiles (two weight blocks' scales a tile); "stages-1" takes one stage fewer than "auto".
VARIANTS = {
    "auto": (_fp8_config, True),
    "2 consumers": (functools.partial(_fp8_config, consumers=2, block_n=config.FP8_BLOCK), True),
    "3 consumers": (functools.partial(_fp8_config, consumers=3), True),
    "2 consumers 192 columns": (functools.partial(_fp8_config, consumers=2, block_n=config.FP8_WIDE_BLOCK_N), True),
    "stages-1": (_fewer_stages, False),
}
# Seconds past --time-limit at which a watchdog prints the table of the rows done and ends the process: the limit
# skips rows, but cannot cut a row short.
HARD_LIMIT_MARGIN_S = 25.0
# Relative error past which a variant is "wrong", by output dtype: bf16 outputs add their rounding (2^-9 of an
# element at most) to the tensor cores' accumulation.
CHECK_TOLS = {"float32": 2e-3, "bfloat16": 4e-3}
PEAK_TFLOPS = 1979  # H200 (and H100 SXM) dense FP8 tensor-core peak
CALLS = 10
WARMUP = 2
BENCH = "gmm-fp8-sweep"


def _inputs(shape, seed: int) -> dict:
    """Quantized x and w [G, N, K], the same weights in bf16 with bf16 x, and the dense FP8 operands."""
    keys = jax.random.split(jax.random.key(seed), 4)
    m, k, n, g = shape.m, shape.k, shape.n, shape.g
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (g, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    return {
        "x": jax.jit(moe_jax.quantize_blockwise, static_argnums=1)(lhs, (1, config.FP8_BLOCK)),
        "w": jax.jit(functools.partial(api.quantize_weights, transpose_rhs=True))(rhs),
        "lhs": lhs,
        "rhs": rhs,
        "dense_lhs": jax.random.normal(keys[2], (m, k), jnp.float32).astype(jnp.float8_e4m3fn),
        "dense_rhs": jax.random.normal(keys[3], (n, k), jnp.float32).astype(jnp.float8_e4m3fn),
    }


def _dense_fp8(lhs, rhs):
    return jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _timed(record: common.Record, fn, args, kernel: str | None):
    """Device time of the kernels of ``fn(*args)`` whose name holds ``kernel`` (all with None) into ``record``;
    returns the first output (or None where it failed)."""
    try:
        start = time.perf_counter()
        output = jax.block_until_ready(fn(*args))
        first_call_s = time.perf_counter() - start
        calls = common.kernel_calls(fn, [args], CALLS, warmup=WARMUP)
    except Exception as error:  # a variant failing (bad config, lowering) must not stop the table
        record.status, record.note = common.classify_failure(error)
        return None
    per_call = [sum(d for name, _, d in call if kernel is None or kernel in name) / 1e9 for call in calls]
    if not all(per_call):
        record.status, record.note = "error", f"no kernel named *{kernel}* in the trace"
        return None
    p10, median, p90 = np.percentile(per_call, [10, 50, 90])
    record.timing = common.Timing(
        float(median), float(p10), float(p90), float(min(per_call)), len(per_call), 1, first_call_s, "device"
    )
    return output


def sweep_shape(name: str, first: bool, deadline: float, seed: int, emit, *, out_dtype="float32", only=None) -> None:
    """Times the baselines and the variants (``only``: those of VARIANTS, else as VARIANTS says) at one shape, the
    FP8 kernels writing ``out_dtype``."""
    shape = GMM_SHAPES[name]
    dims = {"g": shape.g, "m": shape.m, "k": shape.k, "n": shape.n}
    flops = common.gmm_flops(shape.m, shape.k, shape.n, backward=False)
    variants = only or [v for v, (_, everywhere) in VARIANTS.items() if first or everywhere]
    impls = ["dense-fp8", "bf16"] + [f"fp8:{v}" for v in variants]
    if time.perf_counter() > deadline:
        for impl in impls:
            emit(common.skip(common.Record(BENCH, name, "uniform", impl, flops, dims)))
        return
    inputs = _inputs(shape, seed)
    group_sizes = shape.group_sizes("uniform", seed=seed)
    oracle = QuantizedGroupOracle(inputs["x"], inputs["w"], group_sizes, "fp8_block")
    runs = [
        ("dense-fp8", None, jax.jit(_dense_fp8), (inputs["dense_lhs"], inputs["dense_rhs"]), None),
        (
            "bf16",
            None,
            jax.jit(functools.partial(moe_jax.grouped_matmul, transpose_rhs=True, backend="pallas")),
            (inputs["lhs"], inputs["rhs"], group_sizes),
            "moe_gmm",
        ),
    ]
    for variant in variants:
        cfg = VARIANTS[variant][0]({**dims, "out_itemsize": jnp.dtype(out_dtype).itemsize})
        fp8 = functools.partial(
            launch.run_fp8_forward_kernel, row_scale=None, activation=None, out_dtype=jnp.dtype(out_dtype), keep=False
        )
        fn = jax.jit(lambda x, w, sizes, cfg=cfg, fp8=fp8: fp8(x, w, sizes, config=cfg))
        runs.append((f"fp8:{variant}", cfg, fn, (inputs["x"], inputs["w"], group_sizes), "moe_gmm_fp8"))
    for impl, cfg, fn, args, kernel in runs:
        record = common.Record(BENCH, name, "uniform", impl, flops, dims)
        record.config = dataclasses.asdict(cfg) if cfg is not None else None
        if time.perf_counter() > deadline:
            emit(common.skip(record))
            continue
        output = _timed(record, fn, args, kernel)
        if output is not None and cfg is not None:
            record.set_check(oracle.errors(output), oracle.describe())
            if record.rel_err > CHECK_TOLS[out_dtype]:
                record.status, record.note = "wrong", f"rel err {record.rel_err:.2e} > {CHECK_TOLS[out_dtype]}"
        del output
        emit(record)


def table(records: list[common.Record]) -> str:
    dense = {r.shape: r.tflops for r in records if r.impl == "dense-fp8" and r.tflops}
    rows = [
        "| shape | impl | block_m | block_n | consumers | stages | ms | TF/s | vs dense-fp8 | of peak | rel err "
        "| first call s | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        cfg = r.config or {}
        fields = ("block_m", "block_n", "num_compute_wgs", "num_stages")
        head = f"| {r.shape} | {r.impl} | " + " | ".join(str(cfg.get(key, "-")) for key in fields) + " |"
        if r.timing is None:
            rows.append(f"{head} | | | | | | {r.status}: {r.note} |")
            continue
        tflops = r.tflops
        ratio = f"{tflops / dense[r.shape]:.3f}" if r.shape in dense else "-"
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else "-"
        status = r.status if r.status == "ok" else f"{r.status}: {r.note}"
        rows.append(
            f"{head} {r.timing.median_s * 1e3:.3f} | {tflops:.0f} | {ratio} | "
            f"{tflops / PEAK_TFLOPS:.3f} | {err} | {r.timing.first_call_s:.1f} | {status} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSONL file for the records")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated GMM_SHAPES names")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=210.0,
        help=f"seconds after which rows are skipped; at {HARD_LIMIT_MARGIN_S:.0f} more the run prints what it has "
        "and exits (a row's compile cannot be interrupted otherwise)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dtype", choices=tuple(CHECK_TOLS), default="float32", help="the FP8 kernels' outputs")
    parser.add_argument(
        "--variants", help=f"VARIANTS to run at every shape, comma-separated (default: {list(VARIANTS)})"
    )
    parser.add_argument(
        "--triton-gemm", action="store_true", help=f"let XLA autotune Triton GEMMs (else {NO_TRITON_GEMM_FLAG})"
    )
    args = parser.parse_args(argv)
    only = args.variants.split(",") if args.variants else None
    unknown = sorted(set(only or ()) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if not args.triton_gemm and "triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_TRITON_GEMM_FLAG}".strip()
    if jax.devices()[0].platform != "gpu":
        print("gmm_fp8_sweep times GPU kernels: no GPU here", file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.time_limit
    writer = common.JsonlWriter(args.out)
    command = "python -m benchmarks.gmm_fp8_sweep " + shlex.join(argv if argv is not None else sys.argv[1:])
    writer.write({"meta": {**common.run_metadata(command, peers={}), "xla_flags": os.environ.get("XLA_FLAGS", "")}})
    records = []

    def emit(record: common.Record) -> None:
        records.append(record)
        writer.write(record.to_json())
        ms = f"{record.timing.median_s * 1e3:.3f} ms" if record.timing else record.note
        print(f"{record.shape} {record.impl}: {record.status} {ms}", flush=True)

    def hard_stop() -> None:
        print(
            table(records), f"\nstopped at the hard limit ({args.time_limit + HARD_LIMIT_MARGIN_S:.0f} s)", flush=True
        )
        os._exit(3)

    watchdog = threading.Timer(args.time_limit + HARD_LIMIT_MARGIN_S, hard_stop)
    watchdog.daemon = True
    watchdog.start()
    for index, name in enumerate(args.shapes.split(",")):
        sweep_shape(name, index == 0, deadline, args.seed, emit, out_dtype=args.out_dtype, only=only)
    watchdog.cancel()
    print(table(records))
    return 0 if all(r.status in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
