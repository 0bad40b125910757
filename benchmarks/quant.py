"""Block-scaled FP8 quantization ("quant"): the sm90 quantizer kernels against the XLA reference, as fractions of the
HBM roofline of the bytes each must move.

At each named shape (``SHAPES``, bf16 inputs), per variant (``variants``):

- "1x128":   ``quantize_blockwise(x [M, K], (1, 128))``: DeepSeek-V3's activation blocks, f32 scales;
- "1x128+t": ``quantize_blockwise_with_transpose(x, 128)``: also x^T [K, M] quantized along M (the weight gradient's
             operand), from the same read of x;
- "mxfp8":   ``quantize_blockwise(x, (1, 32), pow2_scales=True)``: e8m0 scales;
- "wgrad":   ``token_blocks.quantize_token_blocks``: the FP8 wgrad's operand, x in blocks of 128 rows from each group's
             first row, transposed and group-padded (``GROUPS`` uneven groups);
- "128x128": ``quantize_blockwise(w [G, K, N], (1, 128, 128))``: weights, once per step;
- "128x128 fwd": ``quantize_square_blocks(w, copies=("transposed",))``: the FP8 forward's copy [G, N, K] alone (what a
             call without gradients quantizes);
- "128x128+t": ``quantize_square_blocks(w)``: both copies, [G, K, N] (the dgrad's) and [G, N, K], from one read of w
             (what a training step quantizes).

Rows: "moe_jax:<backend>" per backend, and "hbm-floor": not an implementation but the least time the variant can take,
its bytes (x read once, every output written once: ``moved_bytes``) at the read rate measured in the same run
(``grouped_matmul.measure_hbm_floor``). A backend's roofline fraction is the floor's time over its own. Check: every
backend's values and scales equal the "xla" backend's bit for bit (status "wrong" otherwise). GB/s: those bytes over
a backend's time. Target: the kernel at >= 85% of its roofline.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, grouped_matmul
from moe_jax.ops.grouped_matmul import reference_fp8, token_blocks
from moe_jax.ops.quant.api import quantize_blockwise, quantize_blockwise_with_transpose, quantize_square_blocks

REFERENCE = "xla"
TARGET_ROOFLINE = 0.85
GROUPS = 128  # the wgrad variant's groups (Qwen3-30B-A3B's experts), sized by a seeded multinomial


@dataclasses.dataclass(frozen=True)
class QuantShape:
    """An array to quantize: activations [M, K] (M routed rows) or weights [G, K, N]; ``tag`` "ci" or "bench"."""

    name: str
    dims: tuple[int, ...]
    tag: str


SHAPES = {
    s.name: s
    for s in (
        QuantShape("ci/x", (192, 320), "ci"),
        QuantShape("ci/w", (2, 256, 320), "ci"),
        QuantShape("dsv3-ep8/x", (32768, 7168), "bench"),  # 32k routed rows of DeepSeek-V3's d_model
        QuantShape("qwen3-30b/x", (131072, 2048), "bench"),  # 16k tokens x top-8 of Qwen3-30B-A3B's d_model
        QuantShape("gpt-oss-120b/x", (32768, 2880), "bench"),  # K no multiple of 128: a partial block per row
        QuantShape("dsv3-ep8/w_gate_up", (32, 7168, 4096), "bench"),  # 32 local experts' [D, 2F]
        QuantShape("qwen3-30b/w_gate_up", (128, 2048, 1536), "bench"),  # Qwen3-30B-A3B's 128 experts' [D, 2F]
        QuantShape("qwen3-30b/w_down", (128, 768, 2048), "bench"),  # and [F, D]
    )
}


def shapes(tag: str) -> list[QuantShape]:
    return [s for s in SHAPES.values() if s.tag == tag]


def variants(shape: QuantShape) -> dict[str, Callable]:
    """Variant name -> ``fn(x, backend)`` for the shape's rank (activations [M, K], weights [G, K, N])."""
    if len(shape.dims) == 3:
        return {
            "128x128": lambda w, backend: quantize_blockwise(w, (1, 128, 128), backend=backend),
            "128x128 fwd": lambda w, backend: quantize_square_blocks(w, copies=("transposed",), backend=backend),
            "128x128+t": lambda w, backend: quantize_square_blocks(w, backend=backend),
        }
    groups = min(GROUPS, shape.dims[0] // 64)  # a few at the ci shapes, where the interpreter walks every block
    sizes = np.random.default_rng(0).multinomial(shape.dims[0], np.random.default_rng(1).dirichlet(np.ones(groups)))
    recipe = reference_fp8.RECIPES["fp8_block"]

    def wgrad_blocks(x, backend):
        return token_blocks.quantize_token_blocks(x, jnp.asarray(sizes, jnp.int32), recipe, backend=backend)

    return {
        "1x128": lambda x, backend: quantize_blockwise(x, (1, 128), backend=backend),
        "1x128+t": lambda x, backend: quantize_blockwise_with_transpose(x, 128, backend=backend),
        "mxfp8": lambda x, backend: quantize_blockwise(x, (1, 32), pow2_scales=True, backend=backend),
        "wgrad": wgrad_blocks,
    }


def moved_bytes(fn: Callable, x: jax.ShapeDtypeStruct) -> int:
    """The least bytes ``fn`` moves: x read once and every output (values, scales) written once."""
    return common.nbytes(x) + common.nbytes(jax.eval_shape(fn, x))


@functools.partial(jax.jit, static_argnames=("dims",))
def _input_set(key, *, dims: tuple[int, ...]) -> dict:
    return {"x": jax.random.normal(key, dims, jnp.bfloat16)}


def differing_bytes(actual, expected) -> int:
    """Bytes that differ between two equally structured pytrees of arrays (NaN's bits included)."""
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    return sum(int(np.count_nonzero(np.asarray(a).view(np.uint8) != np.asarray(e).view(np.uint8))) for a, e in pairs)


def bench_shape(
    shape: QuantShape, options: common.Options, *, emit: Callable[[common.Record], None]
) -> list[common.Record]:
    """Times every variant on every backend at one shape, with its floor; ``emit`` receives each record when done."""
    sets = common.input_sets(functools.partial(_input_set, dims=shape.dims), options.seed)
    arg_sets = [(s["x"],) for s in sets]
    spec = jax.ShapeDtypeStruct(shape.dims, jnp.bfloat16)
    backends = list(options.backends)
    records = []
    for variant, fn in variants(shape).items():
        num_bytes = moved_bytes(functools.partial(fn, backend=REFERENCE), spec)
        dims = {"shape": list(shape.dims), "bytes": num_bytes}

        def new_record(impl: str, variant=variant, dims=dims) -> common.Record:
            return common.Record("quant", shape.name, "-", impl, 0, dims, stage=variant)

        row = [new_record("hbm-floor"), *(new_record(f"moe_jax:{backend}") for backend in backends)]
        if common.past_deadline(options):
            for record in row:
                records.append(common.skip(record))
                emit(record)
            continue
        floor, *timed = row
        grouped_matmul.measure_hbm_floor(floor, num_bytes, options)
        records.append(floor)
        emit(floor)
        outputs = {}
        for backend, record in zip(backends, timed, strict=True):
            outputs[backend] = common.measure(
                record, jax.jit(functools.partial(fn, backend=backend)), arg_sets, options
            )
        expected = outputs.get(REFERENCE)
        for backend, record in zip(backends, timed, strict=True):
            if backend != REFERENCE and outputs[backend] is not None and expected is not None:
                differ = differing_bytes(outputs[backend], expected)
                record.set_check([float(differ)], f"moe_jax:{REFERENCE}: bytes that differ")
                if differ:
                    record.status, record.note = "wrong", f"{differ} bytes of the outputs differ from {REFERENCE}'s"
            records.append(record)
            emit(record)
        del outputs, expected
    return records


def run(shapes: list[QuantShape], options: common.Options, *, emit: Callable[[common.Record], None]):
    """Runs "quant" over ``shapes``."""
    records = []
    for shape in shapes:
        print(f"[quant] {shape.name}", file=sys.stderr, flush=True)
        records += bench_shape(shape, options, emit=emit)
    return records


# --- Table -----------------------------------------------------------------------------------------------------------
def _ms(record: common.Record | None) -> str:
    if record is None:
        return ""
    if record.timing is None:
        return f"{record.status}: {record.note}" if record.note else record.status
    return f"{record.timing.median_s * 1e3:.3f} ({record.timing.spread * 100:.0f}%)"


def _gb_per_s(record: common.Record | None) -> str:
    """The bytes the variant must move (``moved_bytes``) over the record's time; older records lack the bytes."""
    if record is None or record.timing is None or "bytes" not in record.dims:
        return ""
    return f"{record.dims['bytes'] / record.timing.median_s / 1e9:.0f}"


def markdown_table(records: list[common.Record]) -> str:
    """One row per (shape, variant): the floor and each backend's ms, each backend's GB/s and fraction of the
    roofline (floor ms / its ms), and its check against xla."""
    by_key = {(r.shape, r.stage, r.impl): r for r in records}
    impls = [impl for impl in dict.fromkeys(r.impl for r in records) if impl != "hbm-floor"]
    header = ["shape", "variant", "hbm-floor ms", *(f"{i} ms" for i in impls), *(f"{i} GB/s" for i in impls)]
    header += [*(f"{i} roofline" for i in impls), "check"]
    align = ["---", "---", *["---:"] * (1 + 3 * len(impls)), "---"]
    rows = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for shape, variant in dict.fromkeys((r.shape, r.stage) for r in records):
        floor = by_key.get((shape, variant, "hbm-floor"))
        row = [by_key.get((shape, variant, impl)) for impl in impls]
        cells = [shape, variant, _ms(floor), *map(_ms, row), *map(_gb_per_s, row)]
        for record in row:
            timed = floor and floor.timing and record and record.timing
            cells.append(f"{floor.timing.median_s / record.timing.median_s:.0%}" if timed else "")
        checks = [r.note if r.status == "wrong" else "bit-exact" for r in row if r and r.checked_against]
        cells.append("; ".join(checks))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


TABLE_NOTE = (
    "quant: ms = median per call (spread = (p90 - p10) / median); hbm-floor = x read once and every output (FP8 values "
    "and scales of x, and of x^T for 1x128+t and 128x128+t; of w^T alone for 128x128 fwd) written once, at the read "
    "rate measured in this run; GB/s = those bytes / ms; roofline = floor ms / ms (target for the kernels: >= "
    f"{TARGET_ROOFLINE:.0%}); check = values and scales equal to xla's bit for bit"
)
