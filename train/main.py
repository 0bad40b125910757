"""Command line of the toy MoE language model: ``python -m train --config tiny`` (see train/README.md)."""

import argparse
import dataclasses
import os

import jax

from moe_jax._core.backend import BACKENDS
from moe_jax._core.hardware import configure_cpu_interpreter
from moe_jax.ops.grouped_matmul.reference_fp8 import QUANTIZATIONS
from moe_jax.parallel.expert_parallel import DISPATCHES
from train.configs import ATTENTIONS, CONFIGS, REMATS, get_config


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that override the named config's model and step (``with_overrides``): --scan-layers,
    --unroll-layers, --remat, --attention, --grad-accum and --quantization, each defaulting to the config's."""
    parser.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        help="one scanned block with stacked [L, ...] parameters, compiled once (default: the config's; on for gpu*)",
    )
    parser.add_argument(
        "--unroll-layers",
        action=argparse.BooleanOptionalAction,
        help="unroll the scanned block's loop: no zero-filled [L, ...] buffers, seconds more compile (default: the "
        "config's; on for gpu-moe)",
    )
    parser.add_argument("--remat", choices=REMATS, help="what the backward recomputes (default: the config's)")
    parser.add_argument("--attention", choices=ATTENTIONS, help="attention implementation (default: the config's)")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default: the config's)")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="the MoE layers' expert GEMMs in block-scaled FP8 (default: the config's; no config quantizes)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    parser.add_argument("--config", choices=tuple(CONFIGS), default="tiny", help="named TrainConfig (train/configs.py)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="moe_jax backend of the MoE layers")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the config's); the schedule spans them")
    parser.add_argument("--ckpt-dir", help="orbax checkpoint directory (default: no checkpoints)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    parser.add_argument("--stop-after", type=int, help="end this run after that many steps (checkpointed there)")
    parser.add_argument("--metrics", help="JSONL metrics file (default: runs/<config>/metrics.jsonl)")
    parser.add_argument(
        "--distributed",
        action="store_true",
        default=os.environ.get("MOE_JAX_DISTRIBUTED") == "1",
        help="call jax.distributed.initialize() first (multi-process runs; also MOE_JAX_DISTRIBUTED=1)",
    )
    parser.add_argument(
        "--expert-parallel", type=int, metavar="N", help="devices of the mesh's expert axis (default: the config's)"
    )
    parser.add_argument("--dispatch", choices=DISPATCHES, help="expert-parallel dispatch (default: auto)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    add_model_flags(parser)
    parser.add_argument(
        "--compile-cache",
        help="JAX persistent compilation cache directory (default: compile_cache/ beside the metrics file)",
    )
    parser.add_argument("--no-compile-cache", action="store_true", help="no persistent compilation cache")
    parser.add_argument(
        "--aot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="store the compiled step in the compile cache's executables/ and load it on a later launch of the same "
        "step (same config, code, versions, devices), skipping its tracing and lowering (default: on with the cache)",
    )
    parser.add_argument(
        "--quick-compile",
        action="store_true",
        help="compile the steps faster at some cost in speed: XLA's own GEMMs on cuBLAS without Triton's autotuned "
        "fusions, loops not unrolled (train/README.md)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.backend == "pallas":
        # Off a GPU the kernels run under the Mosaic GPU interpreter, which needs XLA:CPU set up before it starts.
        configure_cpu_interpreter()
    if args.distributed:
        jax.distributed.initialize()
    from train.train import train

    metrics_path = args.metrics or f"runs/{args.config}/metrics.jsonl"
    executable_dir = None
    if not args.no_compile_cache:
        from train.compilation import enable_compile_cache

        cache = args.compile_cache or os.path.join(os.path.dirname(metrics_path), "compile_cache")
        enable_compile_cache(cache)
        executable_dir = os.path.join(cache, "executables") if args.aot else None
    config = with_overrides(get_config(args.config), args)
    train(
        config,
        backend=args.backend,
        ckpt_dir=args.ckpt_dir,
        resume=args.resume,
        stop_after=args.stop_after,
        metrics_path=metrics_path,
        progress_bar=not args.no_progress,
        executable_dir=executable_dir,
        quick_compile=args.quick_compile,
    )


def with_overrides(config, args: argparse.Namespace):
    """``config`` with the command line's --steps, --grad-accum, --scan-layers, --unroll-layers, --remat,
    --attention, --quantization, --expert-parallel and --dispatch applied; --no-scan-layers alone also turns
    ``ModelConfig.unroll_layers`` off (it applies to the scan only)."""
    unroll_layers = args.unroll_layers
    if unroll_layers is None and args.scan_layers is False:
        unroll_layers = False
    model_overrides = {
        name: value
        for name, value in (
            ("scan_layers", args.scan_layers),
            ("unroll_layers", unroll_layers),
            ("remat", args.remat),
            ("attention", args.attention),
            ("quantization", args.quantization),
        )
        if value is not None
    }
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, **model_overrides))
    if args.grad_accum is not None:
        config = dataclasses.replace(config, grad_accum_steps=args.grad_accum)
    if args.steps is not None:
        # Short runs keep a tenth of their steps for warm-up at most, so that the cosine part never vanishes.
        warmup = min(config.warmup_steps, args.steps // 10)
        config = dataclasses.replace(config, steps=args.steps, warmup_steps=warmup)
    if args.expert_parallel is not None:
        config = dataclasses.replace(config, expert_parallelism=args.expert_parallel)
    if args.dispatch is not None:
        config = dataclasses.replace(config, dispatch=args.dispatch)
    return config
