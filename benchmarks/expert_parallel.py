"""The MoE layer over 1, 2 and 4 local devices at a fixed batch per device (weak scaling): expert parallelism by
all-gather and by all-to-all dispatch against data parallelism ("ep" forward, "ep-bwd" forward + backward).

At each layer shape, T_dev = T / (the largest device count used) tokens per device, and for n devices (1, 2, 4, as
many as there are) the global batch is n * T_dev:

- "moe_jax:<backend>": ``moe_jax.moe_ffn`` on one device: the weak-scaling baseline;
- "dp<n>:<backend>": data parallelism, a ("data", "expert") mesh of (n, 1): all E experts on every device, no
  collective in the layer's forward (its backward all-reduces the weights' gradients);
- "ep<n>-all_gather:<backend>", "ep<n>-all_to_all-<exchange>:<backend>": expert parallelism on (1, n), E / n experts
  a device, ``moe_ffn_expert_parallel(dispatch=...)``, the all-to-all named by its exchange (``EXCHANGES``, chosen
  by ``--ep-exchanges``): "slots" (what "auto" picks), "owners", "padded", and on GPUs at the most devices "ragged"
  (``ragged_all_to_all``) and "ragged-decomposed" (the same with XLA's ragged all-to-all decomposer switched on for
  that compilation, ``RAGGED_DECOMPOSER``).

Routing: "uniform" (the layer's router on N(0, 1) tokens) and "skewed" (the first E / 8 experts get +1 selection
bias, so the first device's experts take several times their share), the latter at the most devices only.
Each record's dims hold: ``bytes_per_token``, forward bytes sent per token per layer and device, both ways, as the
implementation sends them and as the ideal does (each routed row to each distinct remote owner of the token's
experts once, and back), computed from the routing of the timed inputs (the backward sends as much again);
``skew``, the most rows one device's experts take over the mean; ``overflowed_rows``, the rows past the "slots"
exchange's slots (its fallback runs when any); ``memory``, the compiled program's per-device temp, argument and
output bytes. Outputs (and gradients) of the expert-parallel rows are checked against the data-parallel row of the
same devices and inputs.

A ``--time-limit`` is shared among the shapes: each shape gets an equal part of what is left when it starts, and
within a shape one device and the most devices (uniform, then skewed routing) run first, so that a cut leaves out
the smaller meshes' rows before those.
"""

import dataclasses
import functools
import glob
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_jax
from benchmarks import common, report
from benchmarks.layer import make_inputs
from benchmarks.shapes import LAYER_SHAPES, LayerShape
from moe_jax.ops.routing.api import router_logits
from moe_jax.parallel import all_to_all, moe_ffn_expert_parallel

ARG_NAMES = ("x", "router_kernel", "w_gate_up", "w_down")
AXES = ("data", "expert")
MAX_DEVICES = 4
DEFAULT_SHAPES = ("qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b")
EXCHANGES = ("slots", "owners", "padded", "ragged", "ragged-decomposed")
GPU_ONLY_EXCHANGES = ("ragged", "ragged-decomposed")
# XLA's decomposition of the GPU ragged all-to-all into plain collectives, set per compilation (a debug option).
RAGGED_DECOMPOSER = {"xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": True}


def default_shapes() -> list[LayerShape]:
    """qwen3-30b-a3b and gpt-oss-120b, the layers the weak-scaling numbers are quoted at (docs/design.md), and
    mixtral-8x7b, whose k = 2 is below the device counts (the all-to-all's case)."""
    return [LAYER_SHAPES[name] for name in DEFAULT_SHAPES]


def layer_fn(shape: LayerShape, backend: str, route_kwargs: dict, *, parallel: dict | None) -> Callable:
    """``(x, router_kernel, w_gate_up, w_down) -> y`` through ``moe_ffn`` or, with ``parallel`` (its keywords), the
    expert-parallel layer."""

    def layer(x, router_kernel, w_gate_up, w_down):
        if parallel is None:
            return moe_jax.moe_ffn(
                x, router_kernel, w_gate_up, w_down, activation=shape.activation, backend=backend, **route_kwargs
            )[0]
        return moe_ffn_expert_parallel(
            x, router_kernel, w_gate_up, w_down, activation=shape.activation, backend=backend, **route_kwargs,
            **parallel
        )[0]  # fmt: skip

    return layer


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


def on_mesh(fn: Callable, mesh: jax.sharding.Mesh, compiler_options: dict | None = None) -> Callable:
    """``fn`` jitted (with ``compiler_options``), traced and run under ``mesh`` (the expert-parallel layer reads the
    mesh from the context)."""
    jitted = jax.jit(fn, compiler_options=compiler_options)

    def call(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    call.lower = lambda *args: _lower_under(jitted, mesh, args)
    return call


def _lower_under(jitted, mesh, args):
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


def routed_rows(experts: np.ndarray, num_devices: int, num_experts: int) -> np.ndarray:
    """[P, P] routed rows sender -> receiver for experts [T, k] of tokens split evenly over ``num_devices`` in order."""
    num_tokens, _ = experts.shape
    home = np.repeat(np.arange(num_tokens) // (num_tokens // num_devices), experts.shape[1])
    owner = experts.reshape(-1) // (num_experts // num_devices)
    return np.bincount(home * num_devices + owner, minlength=num_devices**2).reshape(num_devices, num_devices)


def slot_overflow(experts: np.ndarray, num_devices: int, num_experts: int, exchange: str = "slots") -> int:
    """Rows past the fast path of the "slots" or "owners" exchange (default ``slot_factor``), summed over the
    devices: routed rows past their pair's slot; for "owners" tokens past their pair's slot plus routed rows past a
    device's ceil(slot_factor * T_dev * k)."""
    counts = routed_rows(experts, num_devices, num_experts)
    num_tokens, top_k = experts.shape
    tokens_per_device = num_tokens // num_devices
    factor = all_to_all.DEFAULT_SLOT_FACTOR
    if exchange == "slots":
        slot = all_to_all.slot_size(tokens_per_device * top_k, num_devices, factor)
        return int(np.maximum(counts - slot, 0).sum())
    slot = all_to_all.owner_slot_size(tokens_per_device, num_experts, num_devices, top_k, factor)
    pairs = owner_pairs(experts, num_devices, num_experts)
    fast_rows = math.ceil(factor * tokens_per_device * top_k)
    return int(np.maximum(pairs - slot, 0).sum() + np.maximum(counts.sum(0) - fast_rows, 0).sum())


def owner_pairs(experts: np.ndarray, num_devices: int, num_experts: int) -> np.ndarray:
    """[P, P] tokens sender -> receiver that own one or more of the token's experts (the receiver may be the
    sender)."""
    num_tokens, _ = experts.shape
    home = np.arange(num_tokens) // (num_tokens // num_devices)
    owner = experts // (num_experts // num_devices)
    needed = (owner[:, :, None] == np.arange(num_devices)).any(1)  # [T, P]
    return np.stack([needed[home == device].sum(0) for device in range(num_devices)])


def bytes_per_token(experts: np.ndarray, num_devices: int, num_experts: int, row_bytes: int, impl: str) -> dict:
    """Forward bytes sent per token and device, both ways, for tokens split evenly over ``num_devices`` in order.

    experts: [T, k] the routing's selection. "ideal": each token's row once to each distinct device other than its
    own that owns one of its experts, and the output back (none for data parallelism). "sent": what ``impl`` sends,
    a routed row carrying 8 bytes of weight and expert id beside its D elements: the ragged all-to-all each routed
    row to a remote owner and back; the padded one every peer's slot of T_dev * k rows there and back; the slots one
    P - 1 slots of ceil(slot_factor * T_dev * k / P) rows there and back, plus the padded one's bytes when any pair
    overflows; the owners one P - 1 slots of tokens (``owner_slot_size``), each with 8 bytes per k, there and back,
    plus its padded fallback's when it runs; all_gather P - 1 rows each way per token; data parallel none.
    """
    num_tokens, top_k = experts.shape
    home = np.arange(num_tokens)[:, None] // (num_tokens // num_devices)
    owner = experts // (num_experts // num_devices)
    remote = owner != home
    distinct_remote = np.array([len(set(row[mask])) for row, mask in zip(owner, remote, strict=True)])
    if impl.startswith(("dp", "moe_jax")):
        return {"ideal": 0.0, "sent": 0.0}
    ideal = 2 * row_bytes * distinct_remote.mean()
    routed_row = 2 * row_bytes + 8
    if "all_gather" in impl:
        sent = 2 * row_bytes * (num_devices - 1)
    elif "padded" in impl:
        sent = routed_row * (num_devices - 1) * top_k
    elif "slots" in impl:
        tokens_per_device = num_tokens // num_devices
        rows = tokens_per_device * top_k
        slot = all_to_all.slot_size(rows, num_devices, all_to_all.DEFAULT_SLOT_FACTOR)
        fallback = rows if slot_overflow(experts, num_devices, num_experts) else 0
        sent = routed_row * (num_devices - 1) * (slot + fallback) / tokens_per_device
    elif "owners" in impl:
        # A token row there with k local expert ids and weights (8 bytes each), its summed output back.
        tokens_per_device = num_tokens // num_devices
        factor = all_to_all.DEFAULT_SLOT_FACTOR
        slot = all_to_all.owner_slot_size(tokens_per_device, num_experts, num_devices, top_k, factor)
        # The fallback's padded rounds each carry every (peer, token) pair a device could send.
        overflowed = slot_overflow(experts, num_devices, num_experts, "owners")
        fallback = num_devices * tokens_per_device if overflowed else 0
        sent = (2 * row_bytes + 8 * top_k) * (num_devices - 1) * (slot + fallback) / tokens_per_device
    else:
        sent = routed_row * remote.sum(1).mean()
    return {"ideal": float(ideal), "sent": float(sent)}


def skew(experts: np.ndarray, num_devices: int, num_experts: int) -> float:
    """The most routed rows one device's experts take, over the mean."""
    taken = routed_rows(experts, num_devices, num_experts).sum(0)
    return float(taken.max() / taken.mean())


def skewed_bias(num_experts: int) -> jax.Array:
    """+1 selection bias on the first E / 8 experts."""
    return jnp.where(jnp.arange(num_experts) < max(1, num_experts // 8), 1.0, 0.0)


def bench_shape(
    shape: LayerShape,
    options: common.Options,
    *,
    backward: bool,
    exchanges: tuple[str, ...],
    emit: Callable[[common.Record], None],
) -> list[common.Record]:
    bench = "ep-bwd" if backward else "ep"
    devices = jax.devices()
    counts = [n for n in (1, 2, 4) if n <= min(MAX_DEVICES, len(devices))]
    tokens_per_device = shape.t // counts[-1]
    inputs = functools.cache(
        lambda: [{name: s[name] for name in (*ARG_NAMES, "ct")} for s in make_inputs(shape, seed=options.seed)][:1]
    )
    flops_per_device = common.moe_ffn_flops(
        tokens_per_device, shape.d, shape.f, shape.e, shape.top_k, backward=backward
    )
    base_route = common.routing_kwargs(shape, options.seed)
    row_bytes = shape.d * 2  # bf16 rows, as the bench's inputs
    on_gpu = devices[0].platform == "gpu"
    records = []

    def time_it(impl, fn, shardings, num_devices, routing_name, experts, reference=None):
        dims = {"t": num_devices * tokens_per_device, "d": shape.d, "f": shape.f, "e": shape.e, "k": shape.top_k}
        dims |= {"devices": num_devices, "tokens_per_device": tokens_per_device}
        dims["bytes_per_token"] = bytes_per_token(experts, num_devices, shape.e, row_bytes, impl)
        dims["skew"] = skew(experts, num_devices, shape.e)
        for exchange in ("slots", "owners"):
            if exchange in impl:
                dims["overflowed_rows"] = slot_overflow(experts, num_devices, shape.e, exchange)
        record = common.Record(bench, shape.name, routing_name, impl, flops_per_device * num_devices, dims)
        if common.past_deadline(options):
            records.append(common.skip(record))
            emit(record)
            return None
        names = ARG_NAMES + (("ct",) if backward else ())
        tokens = num_devices * tokens_per_device
        arg_sets = [
            tuple(jax.device_put(s[n][:tokens] if n in ("x", "ct") else s[n], shardings[n]) for n in names)
            for s in inputs()
        ]
        try:
            analysis = fn.lower(*arg_sets[0]).compile().memory_analysis()
            dims["memory"] = {
                "temp": analysis.temp_size_in_bytes,
                "arguments": analysis.argument_size_in_bytes,
                "outputs": analysis.output_size_in_bytes,
            }
        except Exception as error:  # the measurement below reports the failure
            dims["memory"] = {"error": common.classify_failure(error)[1]}
        output = common.measure(record, fn, arg_sets, options)
        if output is not None:
            output = jax.device_get(output)
            if reference is not None:
                record.set_check(common.relative_errors(output, reference[1]), reference[0])
        records.append(record)
        emit(record)
        return output

    def differentiated(layer):
        return common.forward_backward(layer) if backward else layer

    @functools.cache
    def routed_experts(routing_name):
        """(the layer's routing keywords, experts [T, k] of the timed inputs) for ``routing_name``."""
        route_kwargs = dict(base_route)
        if routing_name == "skewed":
            route_kwargs["bias"] = skewed_bias(shape.e)
        logits = router_logits(inputs()[0]["x"], inputs()[0]["router_kernel"])
        bias = route_kwargs.get("bias")
        routed = moe_jax.route(logits, shape.top_k, bias=bias, **shape.route_options(), backend="xla")
        return route_kwargs, np.asarray(routed.experts)

    # In the order a time limit should cut last: one device, the most devices (uniform, then skewed routing), then
    # the smaller meshes; at each, data parallelism (the reference), the all-to-all exchanges, the all-gather.
    meshes_in_order = [("uniform", counts[-1]), ("skewed", counts[-1])] + [("uniform", n) for n in counts[-2:0:-1]]
    single = dict.fromkeys((*ARG_NAMES, "ct"), jax.sharding.SingleDeviceSharding(devices[0]))
    for backend in options.backends:
        route_kwargs, experts = routed_experts("uniform")
        layer = differentiated(layer_fn(shape, backend, route_kwargs, parallel=None))
        time_it(f"moe_jax:{backend}", jax.jit(layer), single, 1, "uniform", experts[:tokens_per_device])
        for routing_name, num_devices in meshes_in_order if len(counts) > 1 else []:
            route_kwargs, experts = routed_experts(routing_name)
            mesh_devices = devices[:num_devices]
            meshes = {
                kind: jax.make_mesh(shape_, AXES, axis_types=(AxisType.Explicit,) * 2, devices=mesh_devices)
                for kind, shape_ in (("dp", (num_devices, 1)), ("ep", (1, num_devices)))
            }
            used = experts[: num_devices * tokens_per_device]
            dp = differentiated(layer_fn(shape, backend, route_kwargs, parallel=dict(dispatch="all_gather")))
            dp_impl = f"dp{num_devices}:{backend}"
            out = time_it(dp_impl, on_mesh(dp, meshes["dp"]), placements(meshes["dp"]), num_devices, routing_name,
                          used)  # fmt: skip
            reference = (dp_impl, out) if out is not None else None
            variants = {}
            for name in exchanges:
                if name in GPU_ONLY_EXCHANGES and not (on_gpu and num_devices == counts[-1]):
                    continue
                parallel = dict(dispatch="all_to_all", exchange=name.removesuffix("-decomposed"))
                variants[f"all_to_all-{name}"] = (parallel, RAGGED_DECOMPOSER if "decomposed" in name else None)
            variants["all_gather"] = (dict(dispatch="all_gather"), None)
            for name, (parallel, compiler_options) in variants.items():
                layer = differentiated(layer_fn(shape, backend, route_kwargs, parallel=parallel))
                time_it(f"ep{num_devices}-{name}:{backend}", on_mesh(layer, meshes["ep"], compiler_options),
                        placements(meshes["ep"]), num_devices, routing_name, used, reference)  # fmt: skip
    return records


def run(
    shapes: list[LayerShape],
    options: common.Options,
    *,
    emit: Callable[[common.Record], None],
    exchanges: tuple[str, ...] = EXCHANGES,
):
    """Runs "ep-bwd" then "ep" over ``shapes`` on up to 4 local devices, timing the all-to-all with ``exchanges``
    (from ``EXCHANGES``). Within each bench, every shape gets an equal part of the ``options.deadline`` left when it
    starts, so that a slow shape does not starve the next; "ep" gets what "ep-bwd" leaves."""
    unknown = [name for name in exchanges if name not in EXCHANGES]
    if unknown:
        raise ValueError(f"unknown exchanges {unknown}; choose from {EXCHANGES}")
    records = []
    # Forward + backward first: the numbers docs/design.md quotes, should a time limit cut the run.
    for backward in (True, False):
        for index, shape in enumerate(shapes):
            print(f"[ep{'-bwd' if backward else ''}] {shape.name} on {jax.device_count()} devices", file=sys.stderr)
            share = options
            if options.deadline is not None:
                left = max(options.deadline - time.perf_counter(), 0.0)
                share = dataclasses.replace(options, deadline=time.perf_counter() + left / (len(shapes) - index))
            records += bench_shape(shape, share, backward=backward, exchanges=exchanges, emit=emit)
    return records


def scaling_table(records: list[common.Record]) -> str:
    """One row per record: time, tokens/s per device and its ratio to one device at the same per-device batch
    (weak-scaling efficiency), forward bytes sent per token against the ideal, the skew (and the rows past the slots
    exchange's slots), per-device memory."""
    rows = [
        "| shape | routing | devices | impl | ms | tokens/s per device | vs one device | bytes/token sent (ideal) "
        "| skew (overflowed rows) | temp MiB | rel err |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    single = {
        (r.bench, r.shape, r.impl.split(":")[-1]): r.timing.median_s
        for r in records
        if r.impl.startswith("moe_jax:") and r.timing
    }
    for r in records:
        head = f"| {r.shape} | {r.routing} | {r.dims['devices']} | {r.impl} |"
        if r.timing is None:
            rows.append(f"{head} {r.status}: {r.note} | | | | | | |")
            continue
        # Records of strong-scaling runs hold only the global batch: t tokens split over the devices.
        tokens_per_device = r.dims.get("tokens_per_device", r.dims["t"] // r.dims["devices"])
        per_device = tokens_per_device / r.timing.median_s
        baseline = single.get((r.bench, r.shape, r.impl.split(":")[-1]))
        ratio = f"{baseline / r.timing.median_s:.2f}" if baseline else ""
        traffic = r.dims.get("bytes_per_token", {})
        sent = f"{traffic.get('sent', 0):.0f} ({traffic.get('ideal', 0):.0f})" if traffic else ""
        skewness = f"{r.dims['skew']:.2f}" if "skew" in r.dims else ""
        if "overflowed_rows" in r.dims:
            skewness += f" ({r.dims['overflowed_rows']})"
        temp = r.dims.get("memory", {}).get("temp")
        temp = f"{temp / 2**20:.0f}" if temp is not None else ""
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else ""
        timing = f"{r.timing.median_s * 1e3:.3f} | {per_device:,.0f} | {ratio}"
        rows.append(f"{head} {timing} | {sent} | {skewness} | {temp} | {err} |")
    return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class ScalingPoint:
    """One timed weak-scaling record of the ep benches: a dispatch at a GPU count."""

    device_kind: str
    run: str  # the record file's name
    bench: str  # "ep" or "ep-bwd"
    shape: str
    routing: str
    dispatch: str  # "one device", "dp", "all_gather", "all_to_all-<exchange>"
    devices: int
    tokens_per_s_per_device: float
    memory_bytes: int | None  # compiled per-device temp + arguments + outputs


def dispatch_name(impl: str) -> str:
    """ "ep4-all_to_all-slots:pallas" -> "all_to_all-slots"; "dp4:pallas" -> "dp"; "moe_jax:pallas" -> "one device"."""
    name = impl.split(":")[0]
    if name == "moe_jax":
        return "one device"
    if name.startswith("dp"):
        return "dp"
    return name.split("-", 1)[1]


def weak_scaling_points(directory: str = report.RESULTS_DIR) -> list[ScalingPoint]:
    """The timed weak-scaling records (a fixed ``tokens_per_device``) of the GPU runs of "ep" and "ep-bwd" under
    ``directory``: per (GPU, bench, shape) those of the run that covers the most GPU counts, the newest among
    equals."""
    best: dict[tuple[str, str, str], tuple[tuple[int, str], list[ScalingPoint]]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json*"))):
        for run in report.read_runs(path):
            if run.meta.get("platform") != "gpu":
                continue
            by_key: dict[tuple[str, str, str], list[ScalingPoint]] = {}
            for r in run.records:
                if r.bench not in ("ep", "ep-bwd") or r.timing is None or "tokens_per_device" not in r.dims:
                    continue
                memory = r.dims.get("memory", {})
                point = ScalingPoint(
                    device_kind=run.meta["device_kind"],
                    run=os.path.basename(path),
                    bench=r.bench,
                    shape=r.shape,
                    routing=r.routing,
                    dispatch=dispatch_name(r.impl),
                    devices=r.dims["devices"],
                    tokens_per_s_per_device=r.dims["tokens_per_device"] / r.timing.median_s,
                    memory_bytes=sum(memory[k] for k in ("temp", "arguments", "outputs")) if "temp" in memory else None,
                )
                by_key.setdefault((point.device_kind, r.bench, r.shape), []).append(point)
            for key, points in by_key.items():
                rank = (len({p.devices for p in points}), run.meta["date"])
                if key not in best or rank > best[key][0]:
                    best[key] = (rank, points)
    return [point for _, points in best.values() for point in points]
