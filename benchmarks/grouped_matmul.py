"""Grouped matmul benches: forward ("gmm"), forward + both gradients ("gmm-bwd"), and skewed routings ("skew").

Side by side at each named shape (``benchmarks.shapes.GMM_SHAPES``):

- "dense": one XLA matmul [M, K] x [K, N] of the same FLOPs, bf16 in and out; XLA on GPU accumulates bf16 dots in
  f32 (cuBLAS compute type 32F). The practical ceiling: a grouped matmul does the same work with less regularity.
- "ragged_dot": ``jax.lax.ragged_dot``. On GPU XLA rewrites it into a dense dot over a group-masked [G, M, K] operand
  (G times the FLOPs and a G-times temporary), so it is slow and may run out of memory: reported, not hidden.
- "tokamax", "tokamax[<config>]": tokamax's Mosaic GPU ragged dot, its default and the sweep of ``tokamax_peer``.
- "moe_jax:<backend>": our ``moe_jax.grouped_matmul``; a backend without a kernel yet is reported "n/a".
- "hbm-floor" (with "dense"): not an implementation but the memory roofline, the least bytes the op moves
  (``hbm_floor_bytes``) at the device's read rate measured in the same run, the fastest any HBM stream runs (a copy,
  which also writes, runs slower). Where its "vs dense" is below a target, no kernel can meet that target on this
  device (but for bytes the L2 keeps: ``measure_hbm_floor``).

Every ragged implementation's output (and gradients) is checked against ``tests.oracle.GroupOracle``: exact
f32 products of a few groups computed from their slices, independent of every implementation timed (ragged_dot may run
out of memory).

With ``--quantization fp8_block`` the forward runs as "gmm-fp8" (``bench_shape_fp8``; "gmm-mxfp8" with ``mxfp8``): our
op on bf16 activations (quantized per call, as a forward does) and weights quantized beforehand in the FP8 kernel's
[G, N, K] layout (and "-x-stored-fp8": on activations quantized beforehand too, the GEMM alone), against "dense",
one XLA matmul of e4m3 operands (rhs K-major, per-tensor: no block scales) accumulating in f32, of the same FLOPs,
and "hbm-floor" for the FP8 bytes; beside them the dgrad's GEMM (d_out [M, N] times the same quantized weights,
contraction N), with the pallas backend the wgrad's (x and d_out quantized in row blocks per group, as the backward
does, by the FP8 wgrad kernel) and all three GEMMs by our bf16 kernels (``_fp8_candidates``). The check is the XLA
implementation of the same quantization on three groups, each run alone
(``QuantizedGroupOracle``).
"""

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from benchmarks import common, tokamax_peer
from benchmarks.shapes import GroupedMatmulShape
from moe_jax.ops.grouped_matmul import launch, reference_fp8
from moe_jax.ops.grouped_matmul.api import quantize_weights
from moe_jax.ops.quant.api import swap_last_axes
from tests.oracle import GroupOracle


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A ragged implementation ``fn(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``."""

    impl: str
    fn: Callable
    config: dict | None = None


def ragged_candidates(
    options: common.Options, tokamax_configs: tuple[dict, ...], *, skip_ragged_dot: bool = False
) -> list[Candidate]:
    """The ragged implementations to time, baselines first.

    ``skip_ragged_dot``: the skew bench leaves ragged_dot out, since its dense-masked path does the same G-times work
    whatever the routing (and costs the most time to compile and run).
    """
    candidates = []
    if "ragged_dot" in options.baselines and not skip_ragged_dot:
        candidates.append(Candidate("ragged_dot", jax.lax.ragged_dot))
    if "tokamax" in options.baselines:
        candidates.append(Candidate("tokamax", tokamax_peer.ragged_dot()))
        for config in tokamax_configs:
            label = f"tokamax[{tokamax_peer.config_label(config)}]"
            candidates.append(Candidate(label, tokamax_peer.ragged_dot(config), config))
    for backend in options.backends:
        fn = functools.partial(moe_jax.grouped_matmul, backend=backend)
        candidates.append(Candidate(f"moe_jax:{backend}", fn))
    return candidates


@functools.partial(jax.jit, static_argnames=("g", "m", "k", "n", "backward"))
def _input_set(key, *, g: int, m: int, k: int, n: int, backward: bool) -> dict:
    keys = jax.random.split(key, 4)
    scale = k**-0.5
    inputs = {
        "lhs": jax.random.normal(keys[0], (m, k), jnp.bfloat16),
        "rhs": (jax.random.normal(keys[1], (g, k, n), jnp.float32) * scale).astype(jnp.bfloat16),
        "dense_rhs": (jax.random.normal(keys[2], (k, n), jnp.float32) * scale).astype(jnp.bfloat16),
    }
    if backward:
        inputs["ct"] = jax.random.normal(keys[3], (m, n), jnp.bfloat16)
    return inputs


def make_inputs(shape: GroupedMatmulShape, *, backward: bool, seed: int) -> list[dict]:
    """Input sets (rotated by the timer): lhs [M, K], rhs [G, K, N], dense_rhs [K, N], and ct [M, N] for backward.

    Values ~ N(0, 1) for lhs and ct, N(0, 1/K) for the weights, so that outputs are O(1) in bf16.
    """
    dims = {"g": shape.g, "m": shape.m, "k": shape.k, "n": shape.n, "backward": backward}
    return common.input_sets(functools.partial(_input_set, **dims), seed)


FP8_BENCHES = {"fp8_block": "gmm-fp8", "mxfp8": "gmm-mxfp8"}  # bench of each recipe's rows (each its own table)
READ_BYTES_CAP = 2**30  # bytes the read-rate measurement reads at most: far past the 50-MB L2
READ_ROW = 2048  # columns of the buffer it reduces


def hbm_floor_bytes(shape: GroupedMatmulShape, *, backward: bool) -> int:
    """The bf16 bytes a grouped matmul moves at least: the weights [G, K, N], x [M, K] and the output [M, N] once each.
    With the backward three times that: the dgrad reads d out and the weights and writes d x, the wgrad reads x and
    d out and writes the weights' gradient."""
    elements = shape.g * shape.k * shape.n + shape.m * shape.k + shape.m * shape.n
    return 2 * elements * (3 if backward else 1)


def read_pass(num_bytes: int) -> tuple[Callable, jax.Array, int]:
    """The pass the read rate is timed with: (a jitted row sum, its zeroed bf16 buffer [rows, READ_ROW] of
    ``num_bytes`` capped at READ_BYTES_CAP, the bytes one call moves: the buffer plus one f32 per row)."""
    rows = max(min(num_bytes, READ_BYTES_CAP) // (2 * READ_ROW), 1)
    buffer = jnp.zeros((rows, READ_ROW), jnp.bfloat16)
    return jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32)), buffer, buffer.nbytes + rows * 4


def measure_hbm_floor(record: common.Record, num_bytes: int, options: common.Options) -> None:
    """Times a row reduction over a bf16 buffer (it reads every byte once and writes one f32 per row of 2048) and
    records ``num_bytes`` at the rate it reached; the note says the bytes and the rate.

    Reading is the fastest way through the HBM: on an H100 the reduction ran at 3.19 TB/s, a copy (which reads and
    writes every byte) at 2.94 and a copy with two inputs at 3.07 (device time, 2-GiB buffers). So no
    kernel moving ``num_bytes`` beats the record's time, except by bytes the L2 holds from before or still holds dirty
    when the kernel ends (at most its 50 MB each way; the benches rotate inputs to defeat the first)."""
    read, buffer, moved = read_pass(num_bytes)
    common.measure(record, read, [(buffer,)], options)
    if record.timing is None:
        return
    rate = moved / record.timing.median_s
    scale = num_bytes / moved
    t = record.timing
    record.timing = dataclasses.replace(
        t, median_s=t.median_s * scale, p10_s=t.p10_s * scale, p90_s=t.p90_s * scale, min_s=t.min_s * scale
    )
    record.note = f"{num_bytes / 1e9:.3g} GB at {rate / 1e12:.3g} TB/s, the read rate over {moved / 2**20:.3g} MiB"


def bench_shape(
    bench: str,
    shape: GroupedMatmulShape,
    routing: str,
    options: common.Options,
    *,
    backward: bool,
    tokamax_configs: tuple[dict, ...],
    with_dense: bool = True,
    emit: Callable[[common.Record], None],
) -> list[common.Record]:
    """Times every candidate at one shape and routing; ``emit`` receives each record as soon as it is done."""
    flops = common.gmm_flops(shape.m, shape.k, shape.n, backward=backward)
    dims = {"g": shape.g, "m": shape.m, "k": shape.k, "n": shape.n}
    with_dense = with_dense and "dense" in options.baselines
    candidates = ragged_candidates(options, tokamax_configs, skip_ragged_dot=bench == "skew")
    records = []

    def new_record(impl: str, row_routing: str, config: dict | None = None) -> common.Record:
        return common.Record(bench, shape.name, row_routing, impl, flops, dims, config=config)

    if common.past_deadline(options):
        rows = [("dense", "-", None), ("hbm-floor", "-", None)] * with_dense
        rows += [(c.impl, routing, c.config) for c in candidates]
        for impl, row_routing, config in rows:
            records.append(common.skip(new_record(impl, row_routing, config)))
            emit(records[-1])
        return records

    group_sizes = shape.group_sizes(routing, seed=options.seed)
    sets = make_inputs(shape, backward=backward, seed=options.seed)
    dims["max_group"] = int(group_sizes.max())

    if with_dense:
        dense = jnp.dot
        fn = jax.jit(common.forward_backward(dense) if backward else dense)
        arg_sets = [(s["lhs"], s["dense_rhs"], *([s["ct"]] if backward else [])) for s in sets]
        record = new_record("dense", "-")
        common.measure(record, fn, arg_sets, options)
        records.append(record)
        emit(record)
        record = new_record("hbm-floor", "-")
        measure_hbm_floor(record, hbm_floor_bytes(shape, backward=backward), options)
        records.append(record)
        emit(record)

    oracle = GroupOracle(sets[0]["lhs"], sets[0]["rhs"], group_sizes, sets[0]["ct"] if backward else None)
    for candidate in candidates:
        fn = jax.jit(common.forward_backward(candidate.fn, 2) if backward else candidate.fn)  # d lhs, d rhs
        arg_sets = [(s["lhs"], s["rhs"], group_sizes, *([s["ct"]] if backward else [])) for s in sets]
        record = new_record(candidate.impl, routing, candidate.config)
        output = common.measure(record, fn, arg_sets, options)
        if output is not None:
            record.set_check(oracle.errors(output), oracle.describe())
        del output
        records.append(record)
        emit(record)
    return records


@functools.partial(jax.jit, static_argnames=("g", "m", "k", "n", "quantization"))
def _fp8_input_set(key, *, g: int, m: int, k: int, n: int, quantization: str) -> dict:
    """The forward's operands (rhs [G, N, K], FP8 and bf16), the dgrad's (d_out [M, N]; the same weights as [G, K, N],
    quantized along N, the dgrad GEMM's contraction, as the op's backward does: ``reference_fp8.dgrad_weights``), and
    the dense FP8 matmul's."""
    keys = jax.random.split(key, 5)
    rhs = (jax.random.normal(keys[1], (g, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    rhs_fp8 = quantize_weights(rhs, quantization, transpose_rhs=True)
    return {
        "lhs": jax.random.normal(keys[0], (m, k), jnp.bfloat16),
        "rhs": rhs_fp8,
        "rhs_bf16": rhs,
        "d_out": jax.random.normal(keys[4], (m, n), jnp.bfloat16),
        "rhs_dgrad": swap_last_axes(
            reference_fp8.dgrad_weights(rhs, rhs_fp8, reference_fp8.RECIPES[quantization], True)
        ),
        "dense_lhs": jax.random.normal(keys[2], (m, k), jnp.float32).astype(jnp.float8_e4m3fn),
        "dense_rhs": jax.random.normal(keys[3], (n, k), jnp.float32).astype(jnp.float8_e4m3fn),
    }


@functools.partial(jax.jit, static_argnames="quantization")
def _quantized_lhs(lhs, quantization: str) -> moe_jax.BlockScaled:
    """x [M, K] quantized as the op quantizes it, in a program of its own: made where x is drawn, XLA may quantize
    the values before their bf16 rounding (excess precision), and the op would get other blocks than x's."""
    recipe = reference_fp8.RECIPES[quantization]
    return reference_fp8.quantize(lhs, recipe.lhs_block, recipe)


def _fp8_dense(lhs, rhs):
    """[M, K] . [N, K]^T of e4m3 operands, f32 accumulation and output: the per-tensor FP8 matmul XLA has."""
    return jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def fp8_hbm_floor_bytes(shape: GroupedMatmulShape) -> int:
    """The bytes a quantized forward moves at least: the FP8 weights [G, N, K], x [M, K] in bf16 (read once to be
    quantized) and the bf16 output [M, N]."""
    return shape.g * shape.k * shape.n + 2 * (shape.m * shape.k + shape.m * shape.n)


class QuantizedGroupOracle:
    """The XLA implementation of ``grouped_matmul(quantization=...)`` on three groups (first non-empty, largest, last
    non-empty), each run alone on its rows and weights (a row's activation blocks and a group's weight blocks depend on
    nothing else), in f32; rows past the sum are not compared. ``lhs``: an array, or a BlockScaled (quantized
    already)."""

    def __init__(self, lhs, rhs, group_sizes, quantization: str):
        sizes = np.asarray(group_sizes)
        nonempty, ends = np.flatnonzero(sizes), np.cumsum(sizes)
        self.groups = sorted({int(nonempty[0]), int(np.argmax(sizes)), int(nonempty[-1])})
        self.rows = {g: slice(int(ends[g] - sizes[g]), int(ends[g])) for g in self.groups}
        self.expected = {}
        for g, rows in self.rows.items():
            weights = jax.tree.map(lambda a, g=g: a[g : g + 1], rhs)
            self.expected[g] = moe_jax.grouped_matmul(
                jax.tree.map(lambda a, rows=rows: a[rows], lhs),
                weights,
                jnp.array([rows.stop - rows.start], jnp.int32),
                transpose_rhs=True,
                quantization=quantization,
                preferred_element_type=jnp.float32,
                backend="xla",
            )
        self.quantization = quantization

    def errors(self, output) -> list[float]:
        """[``||actual - expected|| / ||expected||`` over the three groups together]."""
        diff = total = 0.0
        for g, rows in self.rows.items():
            actual, expected = (np.asarray(a, np.float64) for a in (output[rows], self.expected[g]))
            diff, total = diff + np.sum(np.square(actual - expected)), total + np.sum(np.square(expected))
        return [float(np.sqrt(diff / total))]

    def describe(self) -> str:
        return f"XLA {self.quantization} implementation, groups {self.groups}"


def bench_shape_fp8(
    shape: GroupedMatmulShape, routing: str, options: common.Options, *, emit: Callable[[common.Record], None]
) -> list[common.Record]:
    """The "gmm-fp8" ("gmm-mxfp8") rows of one shape and routing: dense FP8, hbm-floor and ``options.backends``."""
    quantization = options.quantization
    bench = FP8_BENCHES[quantization]
    flops = common.gmm_flops(shape.m, shape.k, shape.n, backward=False)
    dims = {"g": shape.g, "m": shape.m, "k": shape.k, "n": shape.n}
    records = []

    def done(record: common.Record) -> None:
        records.append(record)
        emit(record)

    with_dense = "dense" in options.baselines
    candidates = _fp8_candidates(quantization, options.backends, shape)
    impls = [("dense", "-"), ("hbm-floor", "-")] * with_dense + [(impl, routing) for impl, *_ in candidates]
    if common.past_deadline(options):
        for impl, row_routing in impls:
            done(common.skip(common.Record(bench, shape.name, row_routing, impl, flops, dims)))
        return records

    make_set = functools.partial(_fp8_input_set, **dims, quantization=quantization)
    sets = [dict(s, lhs_fp8=_quantized_lhs(s["lhs"], quantization)) for s in common.input_sets(make_set, options.seed)]
    group_sizes = shape.group_sizes(routing, seed=options.seed)
    dims["max_group"] = int(group_sizes.max())
    if with_dense:
        record = common.Record(bench, shape.name, "-", "dense", flops, dims)
        common.measure(record, jax.jit(_fp8_dense), [(s["dense_lhs"], s["dense_rhs"]) for s in sets], options)
        done(record)
        record = common.Record(bench, shape.name, "-", "hbm-floor", flops, dims)
        measure_hbm_floor(record, fp8_hbm_floor_bytes(shape), options)
        done(record)
    oracles = {
        "fwd": QuantizedGroupOracle(sets[0]["lhs"], sets[0]["rhs"], group_sizes, quantization),
        "dgrad": QuantizedGroupOracle(sets[0]["d_out"], sets[0]["rhs_dgrad"], group_sizes, quantization),
    }
    if any(gemm == "wgrad" for _, gemm, *_ in candidates):
        oracles["wgrad"] = QuantizedWgradOracle(sets[0]["lhs"], sets[0]["d_out"], group_sizes, quantization)
    for impl, gemm, operands, op in candidates:
        record = common.Record(bench, shape.name, routing, impl, flops, dims)
        output = common.measure(record, jax.jit(op), [(*(s[o] for o in operands), group_sizes) for s in sets], options)
        if output is not None and impl.endswith(FP8_IMPL_SUFFIX):
            record.set_check(oracles[gemm].errors(output), oracles[gemm].describe())
        del output
        done(record)
    return records


FP8_IMPL_SUFFIX = "-fp8"


def _fp8_candidates(quantization: str, backends, shape: GroupedMatmulShape) -> list[tuple]:
    """(impl, GEMM, input-set keys, op) per timed row: for each backend the forward x . w[g]^T and the dgrad GEMM
    d_out . w[g] (contraction N), quantized ("moe_jax:<backend>-fp8", "...-dgrad-fp8"), the forward on x quantized
    beforehand ("...-x-stored-fp8": the GEMM alone, as the layer runs it on tokens quantized once), and with the
    pallas backend the same two GEMMs by our bf16 kernel ("moe_jax:pallas-bf16", "moe_jax:pallas-dgrad-bf16"). The
    dgrad rows time only its GEMM (d_out quantized per call, as the backward does), not a whole backward.

    With the pallas backend and fp8_block also the wgrad GEMM d w[g] = d_out_g^T . x_g in the [G, N, K] layout of the
    forward's weights (the 2MKN FLOPs of the forward): "moe_jax:pallas-wgrad-fp8" (the FP8 wgrad kernel, both
    operands quantized in row blocks per group per call, as the backward does) and "moe_jax:pallas-wgrad-bf16" (our
    bf16 wgrad kernel)."""
    candidates = []
    for backend in backends:
        fp8 = functools.partial(moe_jax.grouped_matmul, transpose_rhs=True, quantization=quantization, backend=backend)
        candidates += [
            (f"moe_jax:{backend}{FP8_IMPL_SUFFIX}", "fwd", ("lhs", "rhs"), fp8),
            (f"moe_jax:{backend}-x-stored{FP8_IMPL_SUFFIX}", "fwd", ("lhs_fp8", "rhs"), fp8),
            (f"moe_jax:{backend}-dgrad{FP8_IMPL_SUFFIX}", "dgrad", ("d_out", "rhs_dgrad"), fp8),
        ]
        if backend == "pallas":
            bf16 = functools.partial(moe_jax.grouped_matmul, backend=backend)
            candidates += [
                ("moe_jax:pallas-bf16", "fwd", ("lhs", "rhs_bf16"), functools.partial(bf16, transpose_rhs=True)),
                ("moe_jax:pallas-dgrad-bf16", "dgrad", ("d_out", "rhs_bf16"), bf16),
            ]
        if backend == "pallas" and launch.fp8_wgrad_unsupported(quantization, shape.k, shape.n, jnp.bfloat16) is None:
            candidates += [
                (f"moe_jax:pallas-wgrad{FP8_IMPL_SUFFIX}", "wgrad", ("lhs", "d_out"), _fp8_wgrad),
                ("moe_jax:pallas-wgrad-bf16", "wgrad", ("lhs", "d_out"), _bf16_wgrad),
            ]
    return candidates


def _fp8_wgrad(lhs, d_out, group_sizes):
    """d w [G, N, K] = d_out_g^T . lhs_g by the FP8 wgrad kernel, both operands quantized here (bf16 out)."""
    return launch.run_fp8_wgrad_kernel(d_out, lhs, group_sizes, out_dtype=jnp.bfloat16)


def _bf16_wgrad(lhs, d_out, group_sizes):
    """d w [G, N, K] = d_out_g^T . lhs_g by the bf16 wgrad kernel."""
    return launch.run_wgrad_kernel(d_out, lhs, group_sizes, out_dtype=jnp.bfloat16, transposed=True)


class QuantizedWgradOracle:
    """The recipe's wgrad in XLA (``reference_fp8.quantized_wgrad``, d w [G, N, K]) of three groups (first non-empty,
    largest, last non-empty), each run alone on its rows (its row blocks start at its first row), in f32."""

    def __init__(self, lhs, d_out, group_sizes, quantization: str):
        sizes = np.asarray(group_sizes)
        nonempty, ends = np.flatnonzero(sizes), np.cumsum(sizes)
        self.groups = sorted({int(nonempty[0]), int(np.argmax(sizes)), int(nonempty[-1])})
        recipe = reference_fp8.RECIPES[quantization]
        self.expected = {}
        for g in self.groups:
            rows = slice(int(ends[g] - sizes[g]), int(ends[g]))
            one_group = jnp.array([rows.stop - rows.start], jnp.int32)
            self.expected[g] = reference_fp8.quantized_wgrad(
                lhs[rows], one_group, d_out[rows], recipe, True, jnp.float32
            )[0]
        self.quantization = quantization

    def errors(self, output) -> list[float]:
        """[``||actual - expected|| / ||expected||`` over the three groups together]."""
        diff = total = 0.0
        for g, expected in self.expected.items():
            actual, expected = np.asarray(output[g], np.float64), np.asarray(expected, np.float64)
            diff, total = diff + np.sum(np.square(actual - expected)), total + np.sum(np.square(expected))
        return [float(np.sqrt(diff / total))]

    def describe(self) -> str:
        return f"XLA {self.quantization} wgrad, groups {self.groups}"


def best_tokamax_config(records: list[common.Record], shape_name: str) -> dict | None:
    """The fastest tokamax config of a "gmm" (forward) sweep at ``shape_name`` among ``records`` (None if no sweep ran
    there)."""
    swept = [
        r
        for r in records
        if r.bench == "gmm" and r.shape == shape_name and r.config is not None and r.timing is not None
    ]
    return min(swept, key=lambda r: r.timing.median_s).config if swept else None


def run(
    bench: str,
    shapes: list[GroupedMatmulShape],
    options: common.Options,
    *,
    routings: tuple[str, ...] = ("uniform",),
    earlier: list[common.Record] = (),
    emit: Callable[[common.Record], None],
) -> list[common.Record]:
    """Runs "gmm", "gmm-bwd" or "skew" over ``shapes``.

    "gmm" sweeps tokamax's configs (with --tokamax-sweep). "gmm-bwd" and "skew" time tokamax with its default and,
    where an earlier "gmm" run in this process swept it at the same shape, its best forward config (tuned once on
    uniform routing, as a user would; tokamax's own backward kernels keep their defaults).
    """
    backward = bench == "gmm-bwd"
    records = []
    for shape in shapes:
        print(f"[{bench}] {shape.name}", file=sys.stderr, flush=True)
        for index, routing in enumerate(routings):
            if bench == "gmm" and options.quantization is not None:
                records += bench_shape_fp8(shape, routing, options, emit=emit)
                continue
            if bench in ("skew", "gmm-bwd"):
                best = best_tokamax_config(list(earlier), shape.name)
                configs = (best,) if best is not None else ()
            else:
                configs = tokamax_peer.SWEEP_CONFIGS if options.tokamax_sweep else ()
            records += bench_shape(
                bench,
                shape,
                routing,
                options,
                backward=backward,
                tokamax_configs=configs,
                with_dense=index == 0,
                emit=emit,
            )
    return records
