"""The routing glue of one MoE layer ("routing"): route, permute, combine and the three together, forward and
forward + backward, backend "xla" (the reference) against "pallas" (the sm90 kernels), side by side.

At each named layer shape (``benchmarks.shapes.LAYER_SHAPES``), routed by the shape's router options (with a random
selection bias ``common.selection_bias`` where the router has one), per backend, the stages:

- "route":    ``moe_jax.route(logits [T, E])``
- "permute":  ``moe_jax.permute(x [T, D], sort_indices, k) -> rows [T * k, D]``
- "combine":  ``moe_jax.combine(y_sorted [T * k, D], sort_indices, k, weights) -> y [T, D]``
- "glue":     route + permute + combine + ``load_balancing_loss`` + ``z_loss`` (everything of the layer but its
              expert GEMMs); permute and combine take the routing's ``positions`` (no inverse of ``sort_indices``)
- "glue-bwd": "glue" and its vjp for cotangents of rows, y and the loss: gradients of logits, x and y_sorted.
- "glue-fused": what ``moe_ffn`` runs outside its kernels now that the permute happens inside the gate_up kernel's
              loads (``routed_glu_mlp``): route + the sorted rows' routing weights (``row_scale``) + an unweighted
              combine + the aux losses. The forward glue on the Pallas path is this plus the gathered gate_up
              kernel's extra time over a plain one (the layer bench's experts:pallas-gathered - experts:pallas).

``y_sorted`` stands for the expert outputs: an input, so that XLA cannot fold combine into permute. permute and
combine take the XLA reference's routing of the same logits. Inputs: logits ~ N(0, 4) (f32; softmax then spreads
over a few experts), x, y_sorted and the cotangents ~ N(0, 1) in bf16. Each stage rotates over as many input sets as
take more than ``common.ROTATE_BYTES`` together (the route stage alone reads only logits).

Check, on the first input set: each backend's outputs against the "xla" backend's. Integer outputs (experts,
group_sizes, sort_indices) must be equal — otherwise the record's status is "wrong" and its note says which and how
many entries differ; every float output and gradient by its relative error (``rel_err_leaves``, in the order that
``checked_against`` names them). No FLOP model: these stages move memory; the table gives milliseconds and each
backend's speedup over xla.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from benchmarks import common
from benchmarks.shapes import LayerShape

STAGES = ("route", "permute", "combine", "glue", "glue-bwd", "glue-fused")
REFERENCE = "xla"
# What each stage takes, by name (``Inputs.get``); sort_indices and weights are the XLA routing of the same logits.
STAGE_ARGS = {
    "route": ("logits",),
    "permute": ("x", "sort_indices"),
    "combine": ("y_sorted", "sort_indices", "weights"),
    "glue": ("logits", "x", "y_sorted"),
    "glue-bwd": ("logits", "x", "y_sorted", "d_rows", "d_y"),
    "glue-fused": ("logits", "y_sorted"),
}
_DRAWN = ("logits", "x", "y_sorted", "d_rows", "d_y")


def stage_functions(shape: LayerShape, backend: str, route_kwargs: dict) -> dict[str, Callable]:
    """Jitted ``fn(*STAGE_ARGS[stage]) -> dict of named outputs`` for every stage, on ``backend``."""
    k = shape.top_k
    route = functools.partial(moe_jax.route, backend=backend, **route_kwargs)

    def route_stage(logits):
        routing = route(logits)
        return {field.name: getattr(routing, field.name) for field in dataclasses.fields(routing)}

    def glue(logits, x, y_sorted):
        routing = route(logits)
        rows = moe_jax.permute(x, routing.sort_indices, k, positions=routing.positions, backend=backend)
        y = moe_jax.combine(
            y_sorted, routing.sort_indices, k, routing.weights, positions=routing.positions, backend=backend
        )
        loss = moe_jax.load_balancing_loss(routing) + moe_jax.z_loss(routing)
        return {"rows": rows, "y": y, "loss": loss}

    def glue_fused(logits, y_sorted):
        routing = route(logits)
        row_scale = routing.weights.reshape(-1)[routing.sort_indices]
        y = moe_jax.combine(y_sorted, routing.sort_indices, k, positions=routing.positions, backend=backend)
        loss = moe_jax.load_balancing_loss(routing) + moe_jax.z_loss(routing)
        return {"row_scale": row_scale, "y": y, "loss": loss}

    def glue_bwd(logits, x, y_sorted, d_rows, d_y):
        outputs, vjp = jax.vjp(glue, logits, x, y_sorted)
        d_logits, d_x, d_y_sorted = vjp({"rows": d_rows, "y": d_y, "loss": jnp.ones((), jnp.float32)})
        return outputs | {"d_logits": d_logits, "d_x": d_x, "d_y_sorted": d_y_sorted}

    return {
        "route": jax.jit(route_stage),
        "permute": jax.jit(lambda x, si: {"rows": moe_jax.permute(x, si, k, backend=backend)}),
        "combine": jax.jit(lambda y, si, w: {"y": moe_jax.combine(y, si, k, w, backend=backend)}),
        "glue": jax.jit(glue),
        "glue-bwd": jax.jit(glue_bwd),
        "glue-fused": jax.jit(glue_fused),
    }


@functools.partial(jax.jit, static_argnames=("dims", "dtype", "std"))
def _normal(key, *, dims: tuple[int, ...], dtype, std: float) -> jax.Array:
    return (jax.random.normal(key, dims, jnp.float32) * std).astype(dtype)


class Inputs:
    """The arrays of one layer shape by (name, input set): each drawn from its own key on first use, then kept."""

    def __init__(self, shape: LayerShape, seed: int, route_kwargs: dict):
        t, d, e, m = shape.t, shape.d, shape.e, shape.m
        self.specs = {
            "logits": jax.ShapeDtypeStruct((t, e), jnp.float32),
            "x": jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
            "y_sorted": jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
            "d_rows": jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
            "d_y": jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
            "sort_indices": jax.ShapeDtypeStruct((m,), jnp.int32),
            "weights": jax.ShapeDtypeStruct((t, shape.top_k), jnp.float32),
        }
        self.seed = seed
        self.route = jax.jit(functools.partial(moe_jax.route, backend=REFERENCE, **route_kwargs))
        self.arrays: dict[tuple[str, int], jax.Array] = {}

    def set_count(self, stage: str) -> int:
        """Input sets to rotate over for ``stage``: together larger than L2."""
        return common.input_sets_needed(common.nbytes([self.specs[name] for name in STAGE_ARGS[stage]]))

    def get(self, name: str, index: int) -> jax.Array:
        if (name, index) not in self.arrays:
            if name in _DRAWN:
                key = jax.random.fold_in(jax.random.key(self.seed * 1000 + index + 1), _DRAWN.index(name))
                spec = self.specs[name]
                std = 2.0 if name == "logits" else 1.0
                self.arrays[name, index] = _normal(key, dims=spec.shape, dtype=spec.dtype, std=std)
            else:  # sort_indices, weights: the reference routing of this set's logits
                routing = self.route(self.get("logits", index))
                self.arrays["sort_indices", index] = routing.sort_indices
                self.arrays["weights", index] = routing.weights
        return self.arrays[name, index]

    def arg_sets(self, stage: str) -> list[tuple]:
        return [tuple(self.get(name, i) for name in STAGE_ARGS[stage]) for i in range(self.set_count(stage))]


def compare(actual: dict, expected: dict) -> tuple[list[str], list[float], str]:
    """(float output names, their relative errors, a note naming every integer output that is not equal)."""
    names, errors, unequal = [], [], []
    for name, want in expected.items():
        got = actual[name]
        if jnp.issubdtype(want.dtype, jnp.integer):
            differ = int(np.count_nonzero(np.asarray(got) != np.asarray(want)))
            if differ:
                unequal.append(f"{name}: {differ} of {want.size} entries differ")
        else:
            names.append(name)
            errors.append(common.relative_errors(got, want)[0])
    return names, errors, "; ".join(unequal)


def bench_shape(
    shape: LayerShape, stages: tuple[str, ...], options: common.Options, *, emit: Callable[[common.Record], None]
) -> list[common.Record]:
    """Times every stage on every backend at one layer shape; ``emit`` receives each record when it is done."""
    route_kwargs = common.routing_kwargs(shape, options.seed)
    dims = {"t": shape.t, "d": shape.d, "e": shape.e, "k": shape.top_k, **shape.route_options()}
    dims["selection_bias"] = shape.selection_bias
    functions = {backend: stage_functions(shape, backend, route_kwargs) for backend in options.backends}
    inputs = Inputs(shape, options.seed, route_kwargs)
    records = []
    for stage in stages:
        stage_records = {
            backend: common.Record("routing", shape.name, "router", f"moe_jax:{backend}", 0, dims, stage=stage)
            for backend in options.backends
        }
        if common.past_deadline(options):
            for record in stage_records.values():
                records.append(common.skip(record))
                emit(record)
            continue
        arg_sets = inputs.arg_sets(stage)
        outputs = {
            backend: common.measure(stage_records[backend], functions[backend][stage], arg_sets, options)
            for backend in options.backends
        }
        expected = outputs.get(REFERENCE)
        if expected is None and any(out is not None for out in outputs.values()):
            # The reference was not timed (or failed): run it once for the check.
            try:
                expected = stage_functions(shape, REFERENCE, route_kwargs)[stage](*arg_sets[0])
            except Exception as error:  # e.g. out of memory: the timings stand, unchecked
                print(f"  [routing] no {REFERENCE} reference for {stage}: {error}", file=sys.stderr, flush=True)
        for backend, record in stage_records.items():
            if backend != REFERENCE and outputs[backend] is not None and expected is not None:
                names, errors, unequal = compare(outputs[backend], expected)
                record.set_check(errors, f"moe_jax:{REFERENCE}: integer outputs equal, rel err of {', '.join(names)}")
                if unequal:
                    record.status, record.note = "wrong", unequal
            records.append(record)
            emit(record)
        del outputs, expected
    return records


def run(
    shapes: list[LayerShape],
    options: common.Options,
    *,
    stages: tuple[str, ...] = STAGES,
    emit: Callable[[common.Record], None],
) -> list[common.Record]:
    """Runs "routing" over ``shapes``."""
    records = []
    for shape in shapes:
        print(f"[routing] {shape.name}", file=sys.stderr, flush=True)
        records += bench_shape(shape, stages, options, emit=emit)
    return records


# --- Table -----------------------------------------------------------------------------------------------------------
def _cell(record: common.Record | None) -> str:
    if record is None:
        return ""
    if record.timing is None:
        return f"{record.status}: {record.note}" if record.note else record.status
    return f"{record.timing.median_s * 1e3:.3f} ({record.timing.spread * 100:.0f}%)"


def _check(record: common.Record) -> str:
    if record.status == "wrong":
        return f"WRONG: {record.note}"
    if record.rel_err is None:
        return ""
    return f"equal, rel err <= {record.rel_err:.1e}"


def markdown_table(records: list[common.Record]) -> str:
    """One row per (shape, stage), one column of milliseconds per implementation, then each one's speedup over xla
    and its check against xla."""
    impls = list(dict.fromkeys(r.impl for r in records))
    reference = f"moe_jax:{REFERENCE}"
    others = [impl for impl in impls if impl != reference]
    speedups = others if reference in impls else []
    by_key = {(r.shape, r.stage, r.impl): r for r in records}
    header = ["shape", "stage", *(f"{impl} ms" for impl in impls), *(f"{impl} vs xla" for impl in speedups)]
    header += [f"{impl} check" for impl in others]
    align = ["---", "---", *["---:"] * (len(impls) + len(speedups)), *["---"] * len(others)]
    rows = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for shape, stage in dict.fromkeys((r.shape, r.stage) for r in records):
        row = {impl: by_key.get((shape, stage, impl)) for impl in impls}
        cells = [shape, stage, *(_cell(row[impl]) for impl in impls)]
        for impl in speedups:
            timed = row[reference] and row[impl] and row[reference].timing and row[impl].timing
            cells.append(f"{row[reference].timing.median_s / row[impl].timing.median_s:.2f}x" if timed else "")
        cells += [_check(row[impl]) if row[impl] else "" for impl in others]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


TABLE_NOTE = (
    "routing: ms = median per call (spread = (p90 - p10) / median); vs xla = xla ms / this backend's ms; check = "
    "integer outputs (experts, group_sizes, sort_indices) equal to xla's, max relative error of the float outputs and "
    "gradients against xla's; glue = route + permute + combine + load_balancing_loss + z_loss; "
    "glue-fused = the same without the permute (moe_ffn gathers in its gate_up kernel), with the rows' weights"
)
