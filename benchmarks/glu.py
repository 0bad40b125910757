"""GLU benches: the gate_up GEMM with its activation epilogue; the GLU MLP's backward and forward+backward.

Shapes are the models' gate_up projections (``GMM_SHAPES["<model>/gate_up"]``: G, M, K = D, N = 2F); the MLP adds
the down projection [G, F, D] and a row scale (the routing weights). Benches, with FLOPs (M routed rows), and their
implementations; "<b>" is each moe_jax backend of ``--backends`` (on CPU, "xla" keeps ``--tiny`` quick):

"glu" — h = act(x W_gate) * (x W_up), forward; 2*M*D*2F:
- "dense": one XLA matmul [M, D] x [D, 2F] (the ceiling);
- "gemm:<b>": the plain gate_up grouped matmul [M, 2F], no activation (target: fused <= 1.05x its time);
- "gemm+xla-glu:<b>": that GEMM, then the GLU in XLA (f32 math, bf16 out) (target: fused >= 1.3x faster);
- "tokamax+xla-glu": tokamax's ragged dot (default config), then the same XLA GLU;
- "fused:<b>": ``grouped_matmul(x, pack_gate_up(w), activation=...)``: with "pallas", the GLU in the GEMM epilogue.

"glu-bwd" — the backward of y = row_scale * (h W_down) alone, from the residuals of one forward (the jitted pullback
of a jax.vjp), 2x the forward's 6*M*D*F; "glu-mlp" — forward + backward, 18*M*D*F:
- "fused:<b>": ``glu_mlp`` (pallas: the GLU backward in the down projection's dgrad epilogue, pre-activation kept);
- "fused-recompute:pallas": the same kernels recomputing the pre-activation in the backward instead of keeping it
  (its extra GEMM is not counted in the FLOPs);
- "unfused:<b>": plain grouped matmuls with XLA elementwise glue (GEMM, XLA GLU, GEMM, XLA row scale) differentiated
  by JAX — with "pallas", the plain grouped-matmul kernels (target: fused backward >= 1.5x faster);
- "tokamax-gemms": the same composition with tokamax's ragged dot (target: the fused forward + backward beats it);
- "dense" (glu-mlp only): the MLP's matmuls dense, with the XLA GLU (the ceiling).

Every output and gradient is checked against exact f32 results of three groups (``GroupOracle`` for the GEMM,
``MLPGroupOracle`` for the MLP). ``targets_table`` turns the records into the targets' ratios.

``python -m benchmarks.glu`` prints the activation-memory table instead (no timing, any host): the bytes each
implementation keeps for the backward at the Qwen3-30B-A3B layer, from the residuals of ``jax.vjp`` (``jax.make_jaxpr``
only, nothing runs).
"""

import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

import moe_jax
from benchmarks import common, tokamax_peer
from benchmarks import shapes as shape_registry
from benchmarks.shapes import GroupedMatmulShape
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul.glu import glu
from moe_jax.ops.grouped_matmul.packing import gate_up_block, split_gate_up
from tests.oracle import GroupOracle, MLPGroupOracle

BENCHES = ("glu", "glu-bwd", "glu-mlp")
TARGETS_NOTE = (
    "targets: fused / gemm <= 1.05; (gemm+xla-glu) / fused >= 1.3; unfused / fused backward >= 1.5; "
    "tokamax-gemms / fused forward + backward > 1 (ratios of median times). "
    "FLOPs: glu = 2*M*D*2F; glu-bwd = 12*M*D*F; glu-mlp = 18*M*D*F"
)


def glu_shapes(tag: str) -> list[GroupedMatmulShape]:
    """The gate_up projections among the named grouped-matmul shapes of ``tag``."""
    return [shape for shape in shape_registry.gmm_shapes(tag) if shape.name.endswith("/gate_up")]


def shape_label(shape: GroupedMatmulShape, activation: str) -> str:
    """The table's shape column: the model and the activation, e.g. "qwen3-30b swiglu"."""
    return f"{shape.name.removesuffix('/gate_up')} {activation}"


def glu_flops(shape: GroupedMatmulShape, bench: str) -> int:
    m, d, d_ff = shape.m, shape.k, shape.n // 2
    return {"glu": 2 * m * d * 2 * d_ff, "glu-bwd": 12 * m * d * d_ff, "glu-mlp": 18 * m * d * d_ff}[bench]


# ------------------------------------------------------------------------------------------------- implementations


def xla_glu(gate_up: jax.Array, activation: str, block: int | None = None) -> jax.Array:
    """The GLU of a [M, 2F] GEMM output in XLA: f32 math, result in the GEMM's dtype. Columns are ``[gate | up]``, or
    packed in blocks of ``block`` (``split_gate_up``) when the GEMM multiplied packed weights."""
    gate, up = split_gate_up(gate_up.astype(jnp.float32), block or gate_up.shape[1] // 2)
    return glu(gate, up, activation).astype(gate_up.dtype)


def composed_mlp(gmm: Callable, x, w_gate_up, w_down, group_sizes, row_scale, *, activation: str, block=None):
    """The MLP from a plain grouped GEMM ``gmm(lhs, rhs, group_sizes) -> lhs.dtype`` and XLA elementwise glue;
    ``block``: w_gate_up is a packed array (``PackedGateUp.array``) of this interleave width."""
    hidden = xla_glu(gmm(x, w_gate_up, group_sizes), activation, block)
    out = gmm(hidden, w_down, group_sizes)
    return (out.astype(jnp.float32) * row_scale[:, None]).astype(x.dtype)


def dense_mlp(x, w_gate_up, w_down, row_scale, *, activation: str):
    """The ceiling: the MLP's FLOPs as dense matmuls (one [D, 2F] and one [F, D] weight for every row)."""
    out = jnp.dot(xla_glu(jnp.dot(x, w_gate_up), activation), w_down)
    return (out.astype(jnp.float32) * row_scale[:, None]).astype(x.dtype)


def _gmm(lhs, rhs, group_sizes, *, backend: str):
    return moe_jax.grouped_matmul(lhs, rhs, group_sizes, backend=backend)


def _glu_mlp(x, w_gate_up, w_down, group_sizes, row_scale, **options):
    return moe_jax.glu_mlp(x, w_gate_up, w_down, group_sizes, row_scale=row_scale, **options)


def _glu_mlp_recomputed(x, w_gate_up, w_down, group_sizes, row_scale, *, activation: str):
    """The kernels' GLU MLP recomputing the pre-activation in its backward instead of keeping it."""
    args = (x, w_gate_up, w_down, group_sizes.astype(jnp.int32), activation, row_scale, True, "pallas")
    return glu_mlp_api._glu_mlp(*args, recompute_gate_up=True)


def glu_candidates(options: common.Options, activation: str) -> list[tuple[str, Callable, tuple[str, ...], str]]:
    """(impl, fn, input names, what it computes: "gemm" [M, 2F] or "glu" [M, F]) for the "glu" bench."""
    plain, packed = ("x", "w_gate_up", "group_sizes"), ("x", "packed", "group_sizes")
    candidates = []
    if "dense" in options.baselines:
        candidates.append(("dense", jnp.dot, ("x", "dense_w_gate_up"), "dense"))
    if "tokamax" in options.baselines:
        ragged_dot = tokamax_peer.ragged_dot()
        candidates.append(("tokamax+xla-glu", lambda *a: xla_glu(ragged_dot(*a), activation), plain, "glu"))
    for backend in options.backends:
        gmm = functools.partial(_gmm, backend=backend)
        fused = functools.partial(moe_jax.grouped_matmul, activation=activation, backend=backend)
        candidates += [
            (f"gemm:{backend}", gmm, plain, "gemm"),
            (f"gemm+xla-glu:{backend}", lambda *a, gmm=gmm: xla_glu(gmm(*a), activation), plain, "glu"),
            (f"fused:{backend}", fused, packed, "glu"),
        ]
    return candidates


def mlp_candidates(options: common.Options, activation: str) -> list[tuple[str, Callable, tuple[str, ...]]]:
    """(impl, fn(x, w_gate_up, w_down, group_sizes, row_scale) -> y, its input names), baselines first.

    Each differentiates the gate/up weights in the form it reads: the plain array, or the packed one (a gradient
    for an unused copy would cost a weight-sized write of zeros).
    """
    act = dict(activation=activation)
    plain, packed = ("x", "w_gate_up", "w_down", "row_scale"), ("x", "packed", "w_down", "row_scale")
    candidates = []
    if "dense" in options.baselines:
        dense = ("x", "dense_w_gate_up", "dense_w_down", "row_scale")
        candidates.append(("dense", lambda x, w, wd, gs, s: dense_mlp(x, w, wd, s, **act), dense))
    if "tokamax" in options.baselines:
        candidates.append(("tokamax-gemms", functools.partial(composed_mlp, tokamax_peer.ragged_dot(), **act), plain))
    for backend in options.backends:
        gmm = functools.partial(_gmm, backend=backend)
        candidates.append((f"unfused:{backend}", functools.partial(composed_mlp, gmm, **act), plain))
        candidates.append((f"fused:{backend}", functools.partial(_glu_mlp, backend=backend, **act), packed))
        if backend == "pallas":
            recompute = functools.partial(_glu_mlp_recomputed, **act)
            candidates.append(("fused-recompute:pallas", recompute, packed))
    return candidates


# ---------------------------------------------------------------------------------------------------------- inputs


@functools.partial(jax.jit, static_argnames=("g", "m", "d", "d_ff"))
def _input_set(key, *, g: int, m: int, d: int, d_ff: int) -> dict:
    keys = iter(jax.random.split(key, 8))

    def normal(dims, fan_in=1):
        return (jax.random.normal(next(keys), dims, jnp.float32) * fan_in**-0.5).astype(jnp.bfloat16)

    w_gate_up = normal((g, d, 2 * d_ff), d)
    return {
        "x": normal((m, d)),
        "w_gate_up": w_gate_up,
        "packed": moe_jax.pack_gate_up(w_gate_up),
        "w_down": normal((g, d_ff, d), d_ff),
        "row_scale": jax.random.uniform(next(keys), (m,), jnp.float32, 0.1, 1.0),
        "ct": normal((m, d)),
        "dense_w_gate_up": normal((d, 2 * d_ff), d),
        "dense_w_down": normal((d_ff, d), d_ff),
    }


def make_inputs(shape: GroupedMatmulShape, *, seed: int) -> list[dict]:
    """Input sets, rotated by the timer: x, ct ~ N(0, 1); weights ~ N(0, 1/fan_in); row_scale ~ U(0.1, 1)."""
    return common.input_sets(functools.partial(_input_set, g=shape.g, m=shape.m, d=shape.k, d_ff=shape.n // 2), seed)


# ----------------------------------------------------------------------------------------------------------- checks


def _unpacked(output):
    """(y, d_x, d_w_gate_up, ...) with a packed weight gradient unpacked."""
    return tuple(moe_jax.unpack_gate_up(leaf) if isinstance(leaf, moe_jax.PackedGateUp) else leaf for leaf in output)


# ------------------------------------------------------------------------------------------------------------ benches


def bench_glu(shape, activation, routing, options, emit) -> list[common.Record]:
    """The "glu" bench at one shape: the gate_up GEMM with and without its activation, fused and in XLA."""
    dims = {"g": shape.g, "m": shape.m, "d": shape.k, "f": shape.n // 2, "activation": activation}
    group_sizes = shape.group_sizes(routing, seed=options.seed)
    inputs = functools.cache(lambda: make_inputs(shape, seed=options.seed))
    glu_of = {"gemm": None, "glu": activation}  # the oracle's activation for what a candidate computes

    @functools.cache
    def oracle(glu_activation: str | None) -> GroupOracle:
        first = inputs()[0]
        return GroupOracle(first["x"], first["w_gate_up"], group_sizes, activation=glu_activation)

    records = []
    for impl, fn, arg_names, computes in glu_candidates(options, activation):
        record = common.Record("glu", shape_label(shape, activation), routing, impl, glu_flops(shape, "glu"), dims)
        records.append(record)
        if common.past_deadline(options):
            emit(common.skip(record))
            continue
        arg_sets = [tuple(group_sizes if name == "group_sizes" else s[name] for name in arg_names) for s in inputs()]
        output = common.measure(record, jax.jit(fn), arg_sets, options)
        if output is not None and computes in glu_of:  # the dense ceiling multiplies other weights
            checked = oracle(glu_of[computes])
            record.set_check(checked.errors(output), checked.describe())
        emit(record)
    return records


def bench_mlp(shape, activation, routing, options, emit) -> list[common.Record]:
    """The "glu-bwd" and "glu-mlp" benches at one shape."""
    dims = {"g": shape.g, "m": shape.m, "d": shape.k, "f": shape.n // 2, "activation": activation}
    group_sizes = shape.group_sizes(routing, seed=options.seed)
    inputs = functools.cache(lambda: make_inputs(shape, seed=options.seed))

    @functools.cache
    def oracle() -> MLPGroupOracle:
        s = inputs()[0]
        return MLPGroupOracle(s["x"], s["w_gate_up"], s["w_down"], group_sizes, s["row_scale"], activation, s["ct"])

    records = []
    for bench in ("glu-bwd", "glu-mlp"):
        for impl, fn, arg_names in mlp_candidates(options, activation):
            if impl == "dense" and bench == "glu-bwd":
                continue
            record = common.Record(bench, shape_label(shape, activation), routing, impl, glu_flops(shape, bench), dims)
            records.append(record)
            if common.past_deadline(options):
                emit(common.skip(record))
                continue
            model = functools.partial(_with_group_sizes, fn, group_sizes)
            arg_sets = [(*(s[name] for name in arg_names), s["ct"]) for s in inputs()]
            if bench == "glu-mlp":
                output = common.measure(record, jax.jit(common.forward_backward(model)), arg_sets, options)
            else:
                output = _measure_backward(record, model, arg_sets, options)
            if output is not None and impl != "dense":  # the dense ceiling computes another function
                record.set_check(oracle().errors(_unpacked(output)), oracle().describe())
            emit(record)
    return records


def _with_group_sizes(fn, group_sizes, x, w_gate_up, w_down, row_scale):
    return fn(x, w_gate_up, w_down, group_sizes, row_scale)


def _measure_backward(record: common.Record, model: Callable, arg_sets, options: common.Options):
    """Times the pullback alone: one jitted forward per input set keeps its residuals, the jitted pullback is timed."""
    try:
        forward = jax.jit(lambda *params: jax.vjp(model, *params))
        pullbacks = [(forward(*args[:-1]), args[-1]) for args in arg_sets]
    except Exception as error:  # a candidate failing must not stop the table
        record.status, record.note = common.classify_failure(error)
        return None
    backward = jax.jit(lambda pullback, ct: pullback(ct))
    output = common.measure(record, backward, [(vjp, ct) for (_, vjp), ct in pullbacks], options)
    if output is None:
        return None
    return (pullbacks[0][0][0], *output)


def run(shapes, options: common.Options, *, activations, routing: str, emit) -> list[common.Record]:
    """Runs "glu", "glu-bwd" and "glu-mlp" over ``shapes`` x ``activations``."""
    records = []
    for shape in shapes:
        for activation in activations:
            print(f"[glu] {shape.name} {activation}", file=sys.stderr, flush=True)
            records += bench_glu(shape, activation, routing, options, emit)
            records += bench_mlp(shape, activation, routing, options, emit)
    return records


def targets_table(records: list[common.Record], backend: str = "pallas") -> str:
    """The targets' ratios per (shape, activation) from the glu benches' median times of ``backend``'s implementations
    ("-" where one side did not run)."""
    times = {(r.bench, r.shape, r.dims.get("activation"), r.impl): r.timing.median_s for r in records if r.timing}
    rows = [
        f"| shape | activation | fused / gemm (<= 1.05) | gemm+xla-glu / fused (>= 1.3) | unfused / fused bwd (>= 1.5) "
        f"| tokamax-gemms / fused fwd+bwd (> 1) | ({backend}) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    keys = sorted({(r.shape, r.dims.get("activation")) for r in records if r.bench in BENCHES})
    for shape, activation in keys:

        def ratio(bench, numerator, denominator, shape=shape, activation=activation):
            a = times.get((bench, shape, activation, numerator))
            b = times.get((bench, shape, activation, denominator))
            return f"{a / b:.2f}" if a and b else "-"

        fused = f"fused:{backend}"
        cells = (
            ratio("glu", fused, f"gemm:{backend}"),
            ratio("glu", f"gemm+xla-glu:{backend}", fused),
            ratio("glu-bwd", f"unfused:{backend}", fused),
            ratio("glu-mlp", "tokamax-gemms", fused),
        )
        rows.append(f"| {shape} | {activation} | {' | '.join(cells)} | |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------- activation memory


def saved_residuals(fn: Callable, args: tuple, names: tuple[str, ...]) -> list[tuple[str, jax.core.ShapedArray]]:
    """What ``jax.vjp(fn, *args)`` keeps for the backward: (source, aval) per distinct array.

    The source is the name of the argument the array is (``names[i]`` for every leaf of ``args[i]``) or "computed".
    Only traced (``jax.make_jaxpr``): nothing runs, so any host can report the largest shapes.
    """
    flat_args, tree = jax.tree.flatten(args)
    leaf_names = [name for name, arg in zip(names, args, strict=True) for _ in jax.tree.leaves(arg)]

    def vjp(*leaves):
        return jax.vjp(fn, *jax.tree.unflatten(tree, leaves))

    closed, (_, pullback) = jax.make_jaxpr(vjp, return_shape=True)(*flat_args)
    jaxpr = closed.jaxpr
    residuals = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(pullback)) :]
    sources = dict(zip(jaxpr.invars, leaf_names, strict=True))
    kept, seen = [], set()
    for var in residuals:
        if isinstance(var, jax.extend.core.Literal) or var in seen:
            continue
        seen.add(var)
        kept.append((sources.get(var, "computed"), var.aval))
    return kept


def memory_implementations(activation: str) -> list[tuple[str, Callable]]:
    """(name, fn(x, w_gate_up, w_down, group_sizes, row_scale)) compared in the activation-memory table."""
    act = dict(activation=activation)
    return [
        (
            "reference (glu_mlp, backend='xla')",
            lambda x, w, wd, gs, s: moe_jax.glu_mlp(x, w, wd, gs, row_scale=s, backend="xla", **act),
        ),
        (
            "unfused (plain kernels + XLA glue)",
            functools.partial(composed_mlp, functools.partial(_gmm, backend="pallas"), **act),
        ),
        ("fused (glu_mlp)", functools.partial(_glu_mlp, backend="pallas", **act)),
        ("fused, recompute_gate_up", functools.partial(_glu_mlp_recomputed, **act)),
    ]


def kept_for_backward(layer) -> dict[str, tuple[list[tuple[str, jax.core.ShapedArray]], list[str]]]:
    """Per implementation of one MoE layer's expert MLP at ``layer`` (a LayerShape): (activations kept for the
    backward as (source, aval), names of the weights kept).

    The MLP runs on the layer's M = T * k routed rows in bf16; the weights are counted apart (parameters, kept whatever
    the implementation); the activations are everything else the backward keeps.
    """
    m, d, d_ff, e = layer.m, layer.d, layer.f, layer.e
    args = {
        "x": jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
        "w_gate_up": jax.ShapeDtypeStruct((e, d, 2 * d_ff), jnp.bfloat16),
        "w_down": jax.ShapeDtypeStruct((e, d_ff, d), jnp.bfloat16),
        "group_sizes": jax.ShapeDtypeStruct((e,), jnp.int32),
        "row_scale": jax.ShapeDtypeStruct((m,), jnp.float32),
    }
    packed = moe_jax.PackedGateUp(args["w_gate_up"], gate_up_block(d_ff))
    table = {}
    for name, fn in memory_implementations(layer.activation):
        values = dict(args, w_gate_up=packed if name.startswith("fused") else args["w_gate_up"])
        kept = saved_residuals(fn, tuple(values.values()), tuple(args))
        activations = [(source, aval) for source, aval in kept if not source.startswith("w_")]
        table[name] = activations, sorted({source for source, _ in kept if source.startswith("w_")})
    return table


def memory_table(layer) -> str:
    """``kept_for_backward`` as a markdown table."""
    rows = [
        f"{layer.name}: T={layer.t}, D={layer.d}, F={layer.f}, E={layer.e}, k={layer.top_k} (M={layer.m} rows), "
        f"bf16, activation={layer.activation}\n",
        "| implementation | activations kept for the backward | MiB | weights kept |",
        "|---|---|---:|---|",
    ]
    for name, (activations, weights) in kept_for_backward(layer).items():
        listed = ", ".join(f"{source} {aval.str_short(short_dtypes=True)}" for source, aval in activations)
        total = common.nbytes([aval for _, aval in activations])
        rows.append(f"| {name} | {listed} | {total / 2**20:.1f} | {', '.join(weights)} |")
    return "\n".join(rows)


def layer_kept_for_backward(layer, quantization: str | None) -> list[tuple[str, jax.core.ShapedArray]]:
    """What ``moe_ffn(backend="pallas", quantization=...)`` keeps for the backward at ``layer`` beyond the weights:
    (source, aval) of every per-token array (the routing's, the expert MLP's). Kept weight copies (the FP8
    layouts: [E, ., .] values and scales, whatever their source) are parameters' bytes and left out."""
    args = {
        "x": jax.ShapeDtypeStruct((layer.t, layer.d), jnp.bfloat16),
        "router_kernel": jax.ShapeDtypeStruct((layer.d, layer.e), jnp.float32),
        "w_gate_up": moe_jax.PackedGateUp(
            jax.ShapeDtypeStruct((layer.e, layer.d, 2 * layer.f), jnp.bfloat16), gate_up_block(layer.f)
        ),
        "w_down": jax.ShapeDtypeStruct((layer.e, layer.f, layer.d), jnp.bfloat16),
    }

    route_kwargs = common.routing_kwargs(layer, seed=0)
    layer_fn = common.layer_output(common.moe_ffn_layer(layer, "pallas", route_kwargs, quantization))
    kept = saved_residuals(layer_fn, tuple(args.values()), tuple(args))
    return [
        (source, aval)
        for source, aval in kept
        if not source.startswith("w_") and not (aval.ndim == 3 and aval.shape[0] == layer.e)
    ]


def layer_memory_table(layer) -> str:
    """``layer_kept_for_backward`` in bf16 and FP8 as a markdown table, in bytes per token."""
    rows = [
        f"{layer.name}: T={layer.t}, D={layer.d}, F={layer.f}, E={layer.e}, k={layer.top_k}: "
        "moe_ffn(backend='pallas'), activations kept for the backward (weights and their FP8 copies apart)\n",
        "| quantization | kept | MiB | bytes per token | vs bf16 |",
        "|---|---|---:|---:|---:|",
    ]
    totals = {}
    for quantization in (None, "fp8_block"):
        kept = layer_kept_for_backward(layer, quantization)
        totals[quantization] = total = common.nbytes([aval for _, aval in kept])
        listed = ", ".join(f"{source} {aval.str_short(short_dtypes=True)}" for source, aval in kept)
        ratio = total / totals[None]
        rows.append(
            f"| {quantization or 'bf16'} | {listed} | {total / 2**20:.1f} | {total / layer.t:.0f} | {ratio:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.glu", description="the activation-memory table")
    parser.add_argument("--layers", default="qwen3-30b-a3b", help="comma-separated LAYER_SHAPES names")
    args = parser.parse_args(argv)
    for name in args.layers.split(","):
        layer = shape_registry.LAYER_SHAPES[name]
        print(memory_table(layer) + "\n")
        print(layer_memory_table(layer) + "\n")


if __name__ == "__main__":
    main()
