"""The permute's row scatter two ways, in device time: registers (``sm90.scatter_rows``) against TMA copies
(``sm90.copy_rows``) at several tokens per CTA, next to the combine's gather of the same bytes and an XLA repeat that
writes the same [T * k, D] rows contiguously (a ceiling for a write-heavy copy).

  python3 -m benchmarks.row_copy_ab [--shapes qwen3-30b-a3b,deepseek-v3] [--calls 20] [--rounds 3]

Per layer shape: random routing of T tokens, then each variant's kernels timed with ``jax.profiler`` (the sum of a
call's kernel durations, median over ``calls`` calls, median of ``rounds`` alternating rounds); every scatter's output
is checked bit-identical to the register kernel's. Results: benchmarks/RESULTS.md.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from benchmarks.profile_layer import kernel_calls
from moe_jax.ops.permute import sm90
from moe_jax.ops.permute.config import CopyConfig, copy_config, heuristic_config
from moe_jax.ops.permute.sm90_vjp import token_positions
from moe_jax.ops.shapes import LAYER_SHAPES


def variants(x, positions, top_k: int) -> dict:
    """name -> (jitted function of (x, rows, positions), GB it moves per call)."""
    num_tokens, d_model = x.shape
    moved_gb = num_tokens * (top_k + 1) * d_model * x.dtype.itemsize / 1e9
    registers = heuristic_config(d_model, x.dtype)
    shipped = copy_config(d_model, x.dtype)
    fns = {f"registers ({registers.tokens_per_block} tokens / CTA)": _scatter(registers)}
    for tokens in sorted({1, 2, shipped.tokens_per_block, min(2 * shipped.tokens_per_block, 16)}):
        config = CopyConfig(box_cols=shipped.box_cols, tokens_per_block=tokens)
        mark = ", shipped" if config == shipped else ""
        fns[f"tma ({tokens} tokens / CTA{mark})"] = _copy(config)
    # The same bytes the other way: [T * k, D] rows in, [T, D] out.
    fns["gather_rows (the combine's kernel)"] = jax.jit(
        lambda x, rows, positions: sm90.gather_rows(rows, positions, config=registers)
    )
    fns["xla repeat (contiguous rows)"] = jax.jit(lambda x, rows, positions: jnp.repeat(x, top_k, axis=0))
    return {name: (fn, moved_gb) for name, fn in fns.items()}


# Each variant is its own function object: jax.jit of one function shares its trace cache.
def _scatter(config):
    return jax.jit(lambda x, rows, positions: sm90.scatter_rows(x, positions, config=config))


def _copy(config):
    return jax.jit(lambda x, rows, positions: sm90.copy_rows(x, positions, config=config))


def device_us(fn, args, calls: int) -> float:
    """Median over ``calls`` calls of the summed durations of a call's kernels (µs)."""
    return float(np.median([sum(duration for *_, duration in call) / 1e3 for call in kernel_calls(fn, args, calls)]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}\n")
    print("| shape | variant | µs | TB/s | same rows |\n|---|---|---:|---:|---|")
    for name in args.shapes.split(","):
        shape = LAYER_SHAPES[name]
        keys = jax.random.split(jax.random.key(0), 3)
        logits = jax.random.normal(keys[0], (shape.t, shape.e), jnp.float32)
        routing = moe_jax.route(logits, shape.top_k, backend="xla")
        positions = token_positions(routing.sort_indices, shape.top_k)
        x = jax.random.normal(keys[1], (shape.t, shape.d), jnp.bfloat16)
        rows = jax.random.normal(keys[2], (shape.t * shape.top_k, shape.d), jnp.bfloat16)
        cases = variants(x, positions, shape.top_k)
        expected = None
        times = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case, (fn, _) in cases.items():
                times[case].append(device_us(fn, (x, rows, positions), args.calls))
        for case, (fn, moved_gb) in cases.items():
            out = np.asarray(fn(x, rows, positions))
            same = ""
            if "registers" in case or "tma" in case:
                expected = out if expected is None else expected
                same = "yes" if np.array_equal(out, expected) else "**no**"
            us = float(np.median(times[case]))
            print(f"| {name} | {case} | {us:.1f} | {moved_gb / us * 1e3:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
