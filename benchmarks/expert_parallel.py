"""The MoE layer over all local devices: expert parallelism ("ep", "ep-bwd") against one device and data parallelism.

At each layer shape, with P = ``jax.device_count()`` and the same global batch of T tokens:

- "moe_jax:<backend>": ``moe_jax.moe_ffn`` on one device (the first), the whole batch: the speed-up's baseline;
- "dp<P>:<backend>": data parallelism, ``moe_ffn_expert_parallel`` on a ("data", "expert") mesh of (P, 1): every
  device holds all E experts and routes and computes its own T / P tokens; no collective in the layer's forward
  (its backward all-reduces the weights' gradients);
- "ep<P>:<backend>": expert parallelism on a mesh of (1, P): every device holds E / P experts, all-gathers the
  batch, routes all of it, computes its experts' rows and reduce-scatters the partial outputs;
- "ep<P>:collectives": the all-gather and the reduce-scatter of [T / P, D] bf16 alone (forward) and with their
  transposes (forward + backward), what the "ep" row spends on communication at least.

FLOPs are the whole layer's (``common.moe_ffn_flops``), so TF/s is the sum over the devices. Outputs (and gradients
with respect to x, the router kernel and both expert weights) are checked against the one-device row's.
"""

import functools
import sys
from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_jax
from benchmarks import common
from benchmarks.layer import make_inputs
from benchmarks.shapes import LayerShape
from moe_jax.parallel import moe_ffn_expert_parallel

ARG_NAMES = ("x", "router_kernel", "w_gate_up", "w_down")
AXES = ("data", "expert")


def layer_fn(shape: LayerShape, backend: str, route_kwargs: dict, *, parallel: bool) -> Callable:
    """``(x, router_kernel, w_gate_up, w_down) -> y`` through ``moe_ffn`` or its expert-parallel form."""
    ffn = moe_ffn_expert_parallel if parallel else moe_jax.moe_ffn

    def layer(x, router_kernel, w_gate_up, w_down):
        return ffn(x, router_kernel, w_gate_up, w_down, activation=shape.activation, backend=backend, **route_kwargs)[0]

    return layer


def _collectives(x):
    """x [T / P, D] -> the all-gather over "expert" then the reduce-scatter of the result: EP's two collectives."""
    return lax.psum_scatter(lax.all_gather(x, "expert", tiled=True), "expert", tiled=True)


def placements(mesh: jax.sharding.Mesh) -> dict:
    """Where each operand lives on ``mesh``: tokens over every axis, experts over "expert", the router replicated."""
    tokens = NamedSharding(mesh, P(AXES))
    experts = NamedSharding(mesh, P("expert"))
    return {
        "x": tokens,
        "ct": tokens,
        "router_kernel": NamedSharding(mesh, P()),
        "w_gate_up": experts,
        "w_down": experts,
    }


def on_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """``fn`` jitted, traced and run under ``mesh`` (the expert-parallel layer reads the mesh from the context)."""
    jitted = jax.jit(fn)

    def call(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    return call


def bench_shape(
    shape: LayerShape, options: common.Options, *, backward: bool, emit: Callable[[common.Record], None]
) -> list[common.Record]:
    bench = "ep-bwd" if backward else "ep"
    devices = jax.devices()
    num_devices = len(devices)
    # Only what the layer reads; placed on one device or a mesh per row (inputs built on first use, as in layer.py).
    inputs = functools.cache(
        lambda: [{name: s[name] for name in (*ARG_NAMES, "ct")} for s in make_inputs(shape, seed=options.seed)]
    )
    dims = {"t": shape.t, "d": shape.d, "f": shape.f, "e": shape.e, "k": shape.top_k, "devices": num_devices}
    dims |= shape.route_options()
    flops = common.moe_ffn_flops(shape.t, shape.d, shape.f, shape.e, shape.top_k, backward=backward)
    route_kwargs = common.routing_kwargs(shape, options.seed)
    records = []

    def time_it(impl: str, fn: Callable, shardings: dict, names=ARG_NAMES, reference=None, flops=flops):
        record = common.Record(bench, shape.name, "router", impl, flops, dims)
        if common.past_deadline(options):
            records.append(common.skip(record))
            emit(record)
            return None
        names += ("ct",) if backward else ()
        arg_sets = [tuple(jax.device_put(s[name], shardings[name]) for name in names) for s in inputs()]
        output = common.measure(record, fn, arg_sets, options)
        if output is not None:
            output = jax.device_get(output)  # host copies: the rows' outputs live on different devices
            if reference is not None:
                record.set_check(common.relative_errors(output, reference[1]), reference[0])
        records.append(record)
        emit(record)
        return output

    def differentiated(layer):
        return common.forward_backward(layer) if backward else layer

    one_device = jax.sharding.SingleDeviceSharding(devices[0])
    single = dict.fromkeys((*ARG_NAMES, "ct"), one_device)
    meshes = {
        f"dp{num_devices}": jax.make_mesh((num_devices, 1), AXES, axis_types=(AxisType.Explicit,) * 2),
        f"ep{num_devices}": jax.make_mesh((1, num_devices), AXES, axis_types=(AxisType.Explicit,) * 2),
    }
    for backend in options.backends:
        layer = layer_fn(shape, backend, route_kwargs, parallel=False)
        output = time_it(f"moe_jax:{backend}", jax.jit(differentiated(layer)), single)
        reference = (f"moe_jax:{backend}", output) if output is not None else None
        parallel = layer_fn(shape, backend, route_kwargs, parallel=True)
        for name, mesh in meshes.items():
            time_it(f"{name}:{backend}", on_mesh(differentiated(parallel), mesh), placements(mesh), reference=reference)
    ep_mesh = meshes[f"ep{num_devices}"]
    collectives = jax.shard_map(_collectives, mesh=ep_mesh, in_specs=P(AXES), out_specs=P(AXES))
    if backward:
        collectives = common.forward_backward(collectives)
    time_it(f"ep{num_devices}:collectives", jax.jit(collectives), placements(ep_mesh), names=("x",), flops=0)
    return records


def run(shapes: list[LayerShape], options: common.Options, *, emit: Callable[[common.Record], None]):
    """Runs "ep" and "ep-bwd" over ``shapes`` on all local devices."""
    records = []
    for backward in (False, True):
        for shape in shapes:
            print(f"[ep{'-bwd' if backward else ''}] {shape.name} on {jax.device_count()} devices", file=sys.stderr)
            records += bench_shape(shape, options, backward=backward, emit=emit)
    return records


def scaling_table(records: list[common.Record]) -> str:
    """One row per record: its time and speed-up over the one-device layer of the same bench, shape and backend."""
    rows = [
        "| shape | devices | impl | ms | spread | speed-up vs one device | rel err |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    single = {
        (r.bench, r.shape, r.impl.split(":")[1]): r.timing.median_s
        for r in records
        if r.impl.startswith("moe_jax:") and r.timing
    }
    for r in records:
        head = f"| {r.shape} | {r.dims['devices']} | {r.impl} |"
        if r.timing is None:
            rows.append(f"{head} {r.status}: {r.note} | | | |")
            continue
        baseline = single.get((r.bench, r.shape, r.impl.split(":")[1]))
        speedup = f"{baseline / r.timing.median_s:.2f}" if baseline else ""
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else ""
        rows.append(f"{head} {r.timing.median_s * 1e3:.3f} | {r.timing.spread * 100:.0f}% | {speedup} | {err} |")
    return "\n".join(rows)
