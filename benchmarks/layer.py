"""The whole MoE layer (``moe_jax.moe_ffn``), forward ("layer") and forward + backward ("layer-bwd").

Side by side at each named layer shape (``benchmarks.shapes.LAYER_SHAPES``), routed by the shape's router options
(with a random selection bias ``common.selection_bias`` where the router has one):

- "dense": the layer's matmuls with the routing taken away, the practical ceiling: router [T, D] x [D, E] in f32, then
  [M, D] x [D, 2F] -> activation -> [M, F] x [F, D] as dense bf16 matmuls (M = T * k rows, already replicated).
- "moe_jax:<backend>": ``moe_jax.moe_ffn`` (backend "xla" is the reference composition over ``jax.lax.ragged_dot``).
- "experts:pallas": the two expert kernels of moe_jax:pallas alone, ``moe_jax.glu_mlp`` on rows already sorted by the
  same routing (computed outside the timing, like its group sizes and row weights): no router, routing, permute or
  combine; "experts:pallas-gathered": the same two kernels with the gate_up kernel gathering its rows from x by the
  sort indices (``routed_glu_mlp(backend="pallas_gather")``, what moe_ffn runs where F <= 1024); forward only,
  "router:xla": the router matmul ``router_logits(x, router_kernel)`` alone. The layer's "glue" (routing,
  permute, combine and the aux losses, including whatever the gathered gate_up loads cost over plain ones) is
  ``moe_jax:pallas - experts:pallas - router:xla``; the gather's own cost is ``experts:pallas-gathered -
  experts:pallas``.
- "moe_jax:<backend>-<quantization>" (with ``--quantization``): ``moe_ffn(quantization=...)``, the expert GEMMs on
  block-scaled FP8 operands; its check against the bf16 reference shows the quantization's error, not a fault. The
  call quantizes the expert weights itself (their bf16 read once, their FP8 copies written), as a step of one
  micro-batch does.
- "moe_jax:<backend>-fp8_block-stored" (with ``--quantization fp8_block``, backends other than "xla"): the same layer
  on weights whose FP8 copies were made before the call (``moe_jax.quantize_master``, outside the timing), as a
  training step's micro-batches share them or a server stores them; the gradient reaches the bf16 weights as
  passed. The difference from the row above is what quantizing the weights costs a call.
- "tokamax-gemms": the same composition as ``moe_ffn`` (route, permute, gate_up, activation, down, combine, aux
  losses) with tokamax's Mosaic GPU ragged dot (default config) in place of the two grouped matmuls. A benchmark-only
  baseline: moe_jax never imports tokamax.

The gate/up weights are drawn once in the packed layout the kernels read (``moe_jax.PackedGateUp``, as ``nn.MoE``
stores them), so no implementation repacks weights inside its timing; the tokamax composition multiplies the same
packed array and splits its output (``split_gate_up``, as moe_jax's xla path does).

fwd+bwd differentiates y with respect to x, the router kernel and both expert weights (the aux losses are computed but
not differentiated). Outputs and gradients are compared with the first moe_ffn-like implementation that ran
(normally moe_jax:xla): leaves (y, load_balancing_loss, z_loss) forward, (y, d_x, d_router, d_w_gate_up, d_w_down)
with gradients.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

import moe_jax
from benchmarks import common, glu, tokamax_peer
from benchmarks.shapes import LayerShape
from moe_jax.ops.glu_mlp.api import routed_glu_mlp
from moe_jax.ops.grouped_matmul.packing import gate_up_block
from moe_jax.ops.routing.api import router_logits


def moe_ffn_with_gmm(gmm: Callable, x, router_kernel, w_gate_up, w_down, *, activation: str, route_kwargs: dict):
    """``moe_ffn``'s composition (backend "xla" ops) with ``gmm(lhs, rhs, group_sizes) -> bf16`` as the expert GEMM.

    w_gate_up: ``PackedGateUp`` [E, D, 2F]; the GEMM multiplies its array as stored and the output is split.
    """
    logits = router_logits(x, router_kernel)
    routing = moe_jax.route(logits, backend="xla", **route_kwargs)
    top_k = route_kwargs["top_k"]
    rows = moe_jax.permute(x, routing.sort_indices, top_k, backend="xla")
    out_rows = glu.composed_mlp(
        gmm,
        rows,
        w_gate_up.array,
        w_down,
        routing.group_sizes,
        routing.sorted_weights,
        activation=activation,
        block=w_gate_up.block,
    )
    y = moe_jax.combine(out_rows, routing.sort_indices, top_k, backend="xla")
    aux = (moe_jax.load_balancing_loss(routing), moe_jax.z_loss(routing))
    return y, aux


def dense_ffn(x, router_kernel, rows, w_gate_up, w_down, *, activation: str):
    """The ceiling: the layer's FLOPs as dense matmuls, rows [M, D] standing for the routed copies of x."""
    hidden = glu.xla_glu(jnp.dot(rows, w_gate_up), activation)
    return jnp.dot(hidden, w_down), router_logits(x, router_kernel)


@functools.partial(jax.jit, static_argnames=("top_k", "route_kwargs_items"))
def expert_operands(x, router_kernel, bias, *, top_k: int, route_kwargs_items: tuple) -> dict:
    """The expert kernels' operands under moe_ffn's routing: sorted rows [M, D], group sizes, row weights [M]."""
    route_kwargs = dict(route_kwargs_items, bias=bias)
    routing = moe_jax.route(router_logits(x, router_kernel), backend="xla", **route_kwargs)
    rows = moe_jax.permute(x, routing.sort_indices, top_k, backend="xla")
    row_weights = routing.weights.reshape(-1)[routing.sort_indices]
    return {
        "expert_rows": rows,
        "sort_indices": routing.sort_indices,
        "group_sizes": routing.group_sizes,
        "row_weights": row_weights,
    }


def expert_gemms(rows, w_gate_up, w_down, group_sizes, row_weights, *, activation: str):
    """moe_ffn's expert kernels alone (the "experts:pallas" baseline)."""
    y = moe_jax.glu_mlp(
        rows, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_weights, backend="pallas"
    )
    return y, ()


def gathered_expert_gemms(x, sort_indices, w_gate_up, w_down, group_sizes, row_weights, *, activation: str, top_k: int):
    """The expert kernels with the gate_up kernel gathering its rows from x (the "experts:pallas-gathered" baseline;
    what moe_ffn runs where F <= 1024)."""
    y = routed_glu_mlp(
        x,
        sort_indices,
        top_k,
        w_gate_up,
        w_down,
        group_sizes,
        activation=activation,
        row_scale=row_weights,
        backend="pallas_gather",
    )
    return y, ()


def stored_copies(input_set: dict) -> dict:
    """The FP8 kernels' copies of the set's expert weights (``moe_jax.quantize_master``), made once."""
    return {
        "gate_up_copies": moe_jax.quantize_master(input_set["w_gate_up"]),
        "down_copies": moe_jax.quantize_master(input_set["w_down"]),
    }


def on_stored_copies(layer: Callable) -> Callable:
    """``layer(x, router_kernel, w_gate_up, w_down)`` as ``(x, router_kernel, w_gate_up, w_down, gate_up_copies,
    down_copies)``: the kernels read the copies made before the call (``stored_copies``) and the gradient reaches
    ``w_gate_up`` and ``w_down`` as passed (the copies' masters)."""

    def run(x, router_kernel, w_gate_up, w_down, gate_up_copies, down_copies):
        gate_up_master = dataclasses.replace(gate_up_copies.array, master=w_gate_up.array)
        gate_up = dataclasses.replace(w_gate_up, array=gate_up_master)
        return layer(x, router_kernel, gate_up, dataclasses.replace(down_copies, master=w_down))

    return run


@functools.partial(jax.jit, static_argnames="shape")
def _input_set(key, *, shape: LayerShape) -> dict:
    keys = iter(jax.random.split(key, 9))

    def normal(dims, fan_in):
        return (jax.random.normal(next(keys), dims, jnp.float32) * fan_in**-0.5).astype(jnp.bfloat16)

    t, d, f, e, m = shape.t, shape.d, shape.f, shape.e, shape.m
    return {
        "x": normal((t, d), 1),
        "router_kernel": normal((d, e), d),
        "w_gate_up": moe_jax.PackedGateUp(normal((e, d, 2 * f), d), gate_up_block(f)),
        "w_down": normal((e, f, d), f),
        "ct": normal((t, d), 1),
        "rows": normal((m, d), 1),
        "dense_w_gate_up": normal((d, 2 * f), d),
        "dense_w_down": normal((f, d), f),
        "dense_ct": normal((m, d), 1),
    }


def make_inputs(shape: LayerShape, *, seed: int) -> list[dict]:
    """Input sets: x [T, D] ~ N(0, 1); weights ~ N(0, 1/fan_in), so the router's logits are O(1) and routing spreads.

    The dense ceiling's own operands (rows [M, D], 2-D weights, cotangent [M, D]) travel in the same set.
    """
    return common.input_sets(functools.partial(_input_set, shape=shape), seed)


def bench_shape(
    shape: LayerShape, options: common.Options, *, backward: bool, emit: Callable[[common.Record], None]
) -> list[common.Record]:
    bench = "layer-bwd" if backward else "layer"
    # Built on first use, so that a run past its --time-limit does not spend minutes on inputs it will not time.
    inputs = functools.cache(lambda: make_inputs(shape, seed=options.seed))
    dims = {"t": shape.t, "d": shape.d, "f": shape.f, "e": shape.e, "k": shape.top_k, **shape.route_options()}
    dims["selection_bias"] = shape.selection_bias
    flops = common.moe_ffn_flops(shape.t, shape.d, shape.f, shape.e, shape.top_k, backward=backward)
    records = []

    def time_it(
        impl: str,
        layer: Callable,
        arg_names: tuple[str, ...],
        ct_name: str,
        reference=None,
        sets=inputs,
        flops=flops,
        num_differentiated=None,
    ):
        record = common.Record(bench, shape.name, "router", impl, flops, dims)
        if common.past_deadline(options):
            records.append(common.skip(record))
            emit(record)
            return None
        if backward:
            fn = jax.jit(common.forward_backward(lambda *params: layer(*params)[0], num_differentiated))
        else:
            fn = jax.jit(layer)
        arg_names += (ct_name,) if backward else ()
        arg_sets = [tuple(s[name] for name in arg_names) for s in sets()]
        output = common.measure(record, fn, arg_sets, options)
        if output is not None and reference is not None:
            record.set_check(common.relative_errors(output, reference[1]), reference[0])
        records.append(record)
        emit(record)
        return output

    if "dense" in options.baselines:
        dense = functools.partial(dense_ffn, activation=shape.activation)
        names = ("x", "router_kernel", "rows", "dense_w_gate_up", "dense_w_down")
        time_it("dense", dense, names, "dense_ct")

    names = ("x", "router_kernel", "w_gate_up", "w_down")
    route_kwargs = common.routing_kwargs(shape, options.seed)
    if "experts" in options.baselines:
        static_kwargs = tuple(sorted((k, v) for k, v in route_kwargs.items() if k != "bias"))

        def with_expert_operands():
            operands = functools.partial(expert_operands, top_k=shape.top_k, route_kwargs_items=static_kwargs)
            return [s | operands(s["x"], s["router_kernel"], route_kwargs.get("bias")) for s in inputs()]

        experts = functools.partial(expert_gemms, activation=shape.activation)
        expert_names = ("expert_rows", "w_gate_up", "w_down", "group_sizes", "row_weights")
        expert_sets = functools.cache(with_expert_operands)
        time_it("experts:pallas", experts, expert_names, "dense_ct", sets=expert_sets)
        gathered = functools.partial(gathered_expert_gemms, activation=shape.activation, top_k=shape.top_k)
        gathered_names = ("x", "sort_indices", "w_gate_up", "w_down", "group_sizes", "row_weights")
        time_it("experts:pallas-gathered", gathered, gathered_names, "dense_ct", sets=expert_sets)
        if not backward:
            router_flops = 2 * shape.t * shape.d * shape.e
            time_it(
                "router:xla", lambda x, w: (router_logits(x, w), ()), ("x", "router_kernel"), "", flops=router_flops
            )
    layers = [
        (f"moe_jax:{backend}", common.moe_ffn_layer(shape, backend, route_kwargs)) for backend in options.backends
    ]
    if options.quantization:
        layers += [
            (
                f"moe_jax:{backend}-{options.quantization}",
                common.moe_ffn_layer(shape, backend, route_kwargs, options.quantization),
            )
            for backend in options.backends
        ]
    if "tokamax" in options.baselines:
        gemms = functools.partial(
            moe_ffn_with_gmm,
            tokamax_peer.ragged_dot(),
            activation=shape.activation,
            route_kwargs=route_kwargs,
        )
        layers.append(("tokamax-gemms", gemms))
    # No output stays on the device while the next implementation runs: at deepseek-v3 the weight gradients are
    # 22.5 GB, more than an H200 has to spare beside another forward + backward. The reference is held in host memory
    # (the check moves one leaf at a time back to the device).
    reference = None
    for impl, layer in layers:
        output = time_it(impl, layer, names, "ct", reference)
        if reference is None and output is not None:
            reference = (impl, jax.device_get(output))
        del output
    if options.quantization == "fp8_block":
        stored_sets = functools.cache(lambda: [s | stored_copies(s) for s in inputs()])
        stored_names = (*names, "gate_up_copies", "down_copies")
        for backend in (b for b in options.backends if b != "xla"):
            stored = on_stored_copies(common.moe_ffn_layer(shape, backend, route_kwargs, options.quantization))
            impl = f"moe_jax:{backend}-{options.quantization}-stored"
            time_it(impl, stored, stored_names, "ct", reference, sets=stored_sets, num_differentiated=len(names))
    return records


def run(shapes: list[LayerShape], options: common.Options, *, emit: Callable[[common.Record], None]):
    """Runs "layer" and "layer-bwd" over ``shapes``."""
    records = []
    for backward in (False, True):
        for shape in shapes:
            print(f"[layer{'-bwd' if backward else ''}] {shape.name}", file=sys.stderr, flush=True)
            records += bench_shape(shape, options, backward=backward, emit=emit)
    return records
