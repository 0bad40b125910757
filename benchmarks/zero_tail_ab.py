"""A/B of daa84bf in one process: moe_ffn's rows past ``sum(group_sizes)`` zero-written and read ("old") against
left unwritten and unread ("new": ``zero_tail=False`` kernels, ``combine(num_rows=...)``).

  python3 -m benchmarks.zero_tail_ab layer     # moe_ffn on one device (with and without a capacity) and over all
                                               # local devices as expert parallel (1, P) (the "ep" bench's rows)
  python3 -m benchmarks.zero_tail_ab kernels   # the gathered GLU MLP and the combine alone, one EP device's share

"old" is restored by patching moe_ffn's two calls (``zero_tail=True``, no ``num_rows``) while its variant is traced.
Each variant is its own function: two ``jax.jit`` of one function share jax's trace cache, so the second would run
the first's program. Rounds alternate old and new (``common.time_fn``, 10 samples, 1 warm-up); the table shows the
median of the round medians; ``$OUT/zero_tail_ab_<part>.json`` keeps every round. Results: benchmarks/RESULTS.md.
Since the commit after 144a8bc, moe_ffn without a capacity runs the old program (nothing lies past the sum there):
its "one device" rows then time one program twice.
"""

import contextlib
import json
import os
import sys
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import moe_jax
from benchmarks import common, expert_parallel
from benchmarks.layer import make_inputs
from benchmarks.shapes import LAYER_SHAPES
from moe_jax.ops.glu_mlp.api import routed_glu_mlp
from moe_jax.ops.grouped_matmul.packing import gate_up_block
from moe_jax.ops.moe_ffn import api as moe_ffn_api

ROUNDS = 4
SHAPE = LAYER_SHAPES["qwen3-30b-a3b"]


@contextlib.contextmanager
def old_behaviour():
    """moe_ffn as before daa84bf: its expert kernels write zeros past the sum and its combine reads every row."""
    glu_mlp, combine = moe_ffn_api.routed_glu_mlp, moe_ffn_api.combine
    with (
        mock.patch.object(moe_ffn_api, "routed_glu_mlp", lambda *a, **k: glu_mlp(*a, **{**k, "zero_tail": True})),
        mock.patch.object(moe_ffn_api, "combine", lambda *a, num_rows=None, **k: combine(*a, **k)),
    ):
        yield


def layer_cases() -> dict[str, tuple[Callable, Callable, list]]:
    """name -> (old, new: two jitted moe_ffn forwards or forward + backwards, input sets)."""
    route_kwargs = common.routing_kwargs(SHAPE, 0)
    names = (*expert_parallel.ARG_NAMES, "ct")
    input_sets = [{name: s[name] for name in names} for s in make_inputs(SHAPE, seed=0)]
    num_devices = jax.device_count()
    mesh = jax.make_mesh((1, num_devices), expert_parallel.AXES, axis_types=(AxisType.Explicit,) * 2)
    one_device = dict.fromkeys(names, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    variants = (
        (f"ep{num_devices}", {}, True),
        ("one device, capacity 1.0", {"capacity_factor": 1.0}, False),
        ("one device", {}, False),
    )
    cases = {}
    for name, extra, parallel in variants:
        layer = expert_parallel.layer_fn(SHAPE, "pallas", route_kwargs | extra, parallel=parallel)
        placements = expert_parallel.placements(mesh) if parallel else one_device
        for backward in (False, True):
            fn = common.forward_backward(layer) if backward else layer

            def make(fn=fn, parallel=parallel):
                def fresh(*operands):  # a new function object: its own trace cache
                    return fn(*operands)

                return expert_parallel.on_mesh(fresh, mesh) if parallel else jax.jit(fresh)

            arg_names = names if backward else names[:-1]
            args = [tuple(jax.device_put(s[n], placements[n]) for n in arg_names) for s in input_sets]
            cases[f"{name} {'forward + backward' if backward else 'forward'}"] = (make(), make(), args)
    return cases


def kernel_cases() -> dict[str, tuple[Callable, Callable, list]]:
    """One of two EP devices at qwen3: 64 local experts over the group's T * k rows, its own the first half; old
    and new by the ops' own arguments."""
    t, d, f, e, k = SHAPE.t, SHAPE.d, SHAPE.f, SHAPE.e // 2, SHAPE.top_k
    m = t * k
    keys = iter(jax.random.split(jax.random.key(0), 6))

    def normal(dims, fan_in):
        return (jax.random.normal(next(keys), dims, jnp.float32) * fan_in**-0.5).astype(jnp.bfloat16)

    x, ct = normal((t, d), 1), normal((t, d), 1)
    w_gate_up, w_down = moe_jax.PackedGateUp(normal((e, d, 2 * f), d), gate_up_block(f)), normal((e, f, d), f)
    sort_indices = jax.random.permutation(next(keys), m).astype(jnp.int32)
    own_rows = m // 2
    group_sizes = jnp.full((e,), own_rows // e, jnp.int32)
    row_scale = jax.random.uniform(next(keys), (m,), jnp.float32)
    y_sorted = jnp.where(jnp.arange(m)[:, None] < own_rows, normal((m, d), 1), 0)

    def mlp(zero_tail):
        return lambda x, w1, w2, s: routed_glu_mlp(
            x, sort_indices, k, w1, w2, group_sizes, row_scale=s, zero_tail=zero_tail, backend="pallas"
        )

    def combine(zero_tail):
        num_rows = None if zero_tail else own_rows
        return lambda y: moe_jax.combine(y, sort_indices, k, num_rows=num_rows, backend="pallas")

    def mlp_combine(zero_tail):
        return lambda *a: combine(zero_tail)(mlp(zero_tail)(*a))

    mlp_args, combine_args = (x, w_gate_up, w_down, row_scale), (y_sorted,)
    cases = {
        "GLU MLP + combine, forward": (mlp_combine, mlp_args, False),
        "GLU MLP + combine, forward + backward": (mlp_combine, mlp_args, True),
        "GLU MLP, forward": (mlp, mlp_args, False),
        "combine, forward": (combine, combine_args, False),
        "combine, forward + backward": (combine, combine_args, True),
    }

    def jitted(fn, backward):
        return jax.jit(common.forward_backward(fn) if backward else fn)

    return {
        name: (jitted(build(True), backward), jitted(build(False), backward), [args + ((ct,) if backward else ())])
        for name, (build, args, backward) in cases.items()
    }


def main(part: str) -> None:
    rows, records = [], []
    for name, (old, new, args) in (layer_cases() if part == "layer" else kernel_cases()).items():
        with old_behaviour():  # the layer's old program is traced here (the kernels' cases do not call moe_ffn)
            old_out = jax.device_get(jax.block_until_ready(old(*args[0])))
        diff = max(common.relative_errors(jax.device_get(new(*args[0])), old_out))
        times = {"old": [], "new": []}
        for _ in range(ROUNDS):
            for which, fn in (("old", old), ("new", new)):
                timing, _ = common.time_fn(fn, args, iters=10, warmup=1, max_seconds=0.5)
                times[which].append(timing.median_s * 1e3)
        old_ms, new_ms = np.median(times["old"]), np.median(times["new"])
        rows.append(f"| {name} | {old_ms:.3f} | {new_ms:.3f} | {new_ms / old_ms:.3f} | {diff:.1e} |")
        records.append(dict(case=name, old_ms=times["old"], new_ms=times["new"], rel_diff=diff))
        print(rows[-1], flush=True)
    header = "| case | old ms | new ms | new / old | rel diff |\n|---|---:|---:|---:|---:|"
    print(f"\n{jax.devices()[0].device_kind} x {jax.device_count()}, {SHAPE.name}\n\n{header}\n" + "\n".join(rows))
    with open(os.path.join(os.environ.get("OUT", "."), f"zero_tail_ab_{part}.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, devices=jax.device_count(), records=records), f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("layer", "kernels"):
        raise SystemExit("usage: python3 -m benchmarks.zero_tail_ab layer|kernels")
    main(sys.argv[1])
