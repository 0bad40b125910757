"""Block-scaled FP8 quantization ("quant"): the sm90 quantizer kernels against the XLA reference, as fractions of the
HBM roofline of the bytes each must move.

At each named shape (``SHAPES``, bf16 inputs), per variant (``variants``):

- "1x128":   ``quantize_blockwise(x [M, K], (1, 128))``: DeepSeek-V3's activation blocks, f32 scales;
- "1x128+t": ``quantize_blockwise_with_transpose(x, 128)``: also x^T [K, M] quantized along M (the weight gradient's
             operand), from the same read of x;
- "mxfp8":   ``quantize_blockwise(x, (1, 32), pow2_scales=True)``: e8m0 scales;
- "wgrad":   ``token_blocks.quantize_token_blocks``: the FP8 wgrad's operand, x in blocks of 128 rows from each group's
             first row, transposed and group-padded (``GROUPS`` uneven groups);
- "wgrad+rows": ``token_blocks.quantize_token_blocks_and_rows``: also x's 1 x 128 copy from the same read (the GLU
             backward's d_gate_up, which an FP8 dgrad and an FP8 wgrad both contract);
- "128x128": ``quantize_blockwise(w [G, K, N], (1, 128, 128))``: weights, once per step;
- "128x128 fwd": ``quantize_square_blocks(w, copies=("transposed",))``: the FP8 forward's copy [G, N, K] alone (what a
             call without gradients quantizes);
- "128x128+t": ``quantize_square_blocks(w)``: both copies, [G, K, N] (the dgrad's) and [G, N, K], from one read of w
             (what a training step quantizes).

Rows: "moe_jax:<backend>" per backend; "hbm-floor": not an implementation but the least time the variant can take,
its bytes (x read once, every output written once: ``moved_bytes``) at the read rate measured in the same run
(``grouped_matmul.measure_hbm_floor``); and "xla-stream", the peer: XLA's elementwise pass over x writing as many
bytes as the variant's FP8 copies (``streaming_pass``), the rate a plain pass reaches at the variant's mix of reads
and writes (the floor counts written bytes at the read rate; at one byte written per byte read XLA's pass runs well
below it). A row's roofline fraction is its rate over the floor's (for the backends, whose bytes are the
floor's: the floor's time over its own). Check: every backend's values and scales equal the "xla" backend's bit for
bit (status "wrong" otherwise). GB/s: a row's bytes over its time. Target: the kernel at >= 85% of its roofline.
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
from moe_jax.ops.quant.reference import FP8_DTYPES

REFERENCE = "xla"
PEER = "xla-stream"
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

    def wgrad_blocks_and_rows(x, backend):
        return token_blocks.quantize_token_blocks_and_rows(x, jnp.asarray(sizes, jnp.int32), recipe, backend=backend)

    return {
        "1x128": lambda x, backend: quantize_blockwise(x, (1, 128), backend=backend),
        "1x128+t": lambda x, backend: quantize_blockwise_with_transpose(x, 128, backend=backend),
        "mxfp8": lambda x, backend: quantize_blockwise(x, (1, 32), pow2_scales=True, backend=backend),
        "wgrad": wgrad_blocks,
        "wgrad+rows": wgrad_blocks_and_rows,
    }


def moved_bytes(fn: Callable, x: jax.ShapeDtypeStruct) -> int:
    """The least bytes ``fn`` moves: x read once and every output (values, scales) written once."""
    return common.nbytes(x) + common.nbytes(jax.eval_shape(fn, x))


def fp8_copies(fn: Callable, x: jax.ShapeDtypeStruct) -> int:
    """How many FP8 value arrays ``fn`` writes (x's, x^T's): one or two."""
    fp8 = set(map(jnp.dtype, FP8_DTYPES))
    return sum(jnp.dtype(leaf.dtype) in fp8 for leaf in jax.tree.leaves(jax.eval_shape(fn, x)))


@functools.partial(jax.jit, static_argnames=("copies",))
def streaming_pass(x: jax.Array, *, copies: int) -> jax.Array:
    """XLA's elementwise pass over x [..., K] bf16 (K even) writing the bytes of ``copies`` FP8 copies of x, in bf16:
    [..., K / 2], pairs of columns summed, for one copy; [..., K], x * 1.5, for two. The quantizers' scales and the
    wgrad blocks' padding (a few % of their bytes) are left out: the pass measures a rate, not a time."""
    if copies == 2:
        return x * jnp.asarray(1.5, x.dtype)
    if copies != 1:
        raise ValueError(f"copies must be 1 or 2, got {copies}")
    return x.reshape(*x.shape[:-1], -1, 2).sum(axis=-1, dtype=x.dtype)


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

        row = [new_record("hbm-floor"), new_record(PEER), *(new_record(f"moe_jax:{backend}") for backend in backends)]
        if common.past_deadline(options):
            for record in row:
                records.append(common.skip(record))
                emit(record)
            continue
        floor, peer, *timed = row
        grouped_matmul.measure_hbm_floor(floor, num_bytes, options)
        peer_fn = functools.partial(streaming_pass, copies=fp8_copies(functools.partial(fn, backend=REFERENCE), spec))
        peer.dims = {**dims, "bytes": moved_bytes(peer_fn, spec)}
        common.measure(peer, peer_fn, arg_sets, options)
        for record in (floor, peer):
            records.append(record)
            emit(record)
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


def _rate(record: common.Record | None) -> float | None:
    """The record's bytes (``moved_bytes``) per second; None for a record without a time or (older ones) bytes."""
    if record is None or record.timing is None or "bytes" not in record.dims:
        return None
    return record.dims["bytes"] / record.timing.median_s


def _gb_per_s(record: common.Record | None) -> str:
    rate = _rate(record)
    return "" if rate is None else f"{rate / 1e9:.0f}"


def _fraction(record: common.Record | None, of: common.Record | None) -> str:
    """``record``'s rate over ``of``'s; over the floor: its roofline fraction (floor ms / its ms where it lacks
    bytes, which it then shares with the floor)."""
    if record is None or of is None or record.timing is None or of.timing is None:
        return ""
    rate, of_rate = _rate(record), _rate(of)
    if rate is None or of_rate is None:
        return f"{of.timing.median_s / record.timing.median_s:.0%}"
    return f"{rate / of_rate:.0%}"


def markdown_table(records: list[common.Record]) -> str:
    """One row per (shape, variant): the floor's and each row's ms, each row's GB/s and fraction of the roofline
    (its rate over the floor's), each backend's rate over the peer's, and each backend's check against xla."""
    by_key = {(r.shape, r.stage, r.impl): r for r in records}
    impls = [impl for impl in dict.fromkeys(r.impl for r in records) if impl != "hbm-floor"]
    backends = [impl for impl in impls if impl.startswith("moe_jax:")] if PEER in impls else []
    header = ["shape", "variant", "hbm-floor ms", *(f"{i} ms" for i in impls), *(f"{i} GB/s" for i in impls)]
    header += [*(f"{i} roofline" for i in impls), *(f"{i} / {PEER}" for i in backends), "check"]
    align = ["---", "---", *["---:"] * (1 + 3 * len(impls) + len(backends)), "---"]
    rows = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for shape, variant in dict.fromkeys((r.shape, r.stage) for r in records):
        floor = by_key.get((shape, variant, "hbm-floor"))
        row = [by_key.get((shape, variant, impl)) for impl in impls]
        cells = [shape, variant, _ms(floor), *map(_ms, row), *map(_gb_per_s, row)]
        cells += [_fraction(record, floor) for record in row]
        peer = by_key.get((shape, variant, PEER))
        cells += [_fraction(by_key.get((shape, variant, impl)), peer) for impl in backends]
        checks = [r.note if r.status == "wrong" else "bit-exact" for r in row if r and r.checked_against]
        cells.append("; ".join(checks))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


TABLE_NOTE = (
    "quant: ms = median per call (spread = (p90 - p10) / median); hbm-floor = x read once and every output (FP8 values "
    "and scales of x, and of x^T for 1x128+t and 128x128+t; of w^T alone for 128x128 fwd) written once, at the read "
    f"rate measured in this run; {PEER} = XLA's elementwise pass over x writing the bytes of the variant's FP8 copies "
    "(bf16 out; scales and padding aside), the rate a plain pass reaches at that mix of reads and writes; "
    "GB/s = a row's bytes / ms; roofline = its GB/s / the floor's (target for the kernels: >= "
    f"{TARGET_ROOFLINE:.0%}); / {PEER} = a kernel's GB/s over the pass's; check = values and scales equal to xla's "
    "bit for bit"
)
