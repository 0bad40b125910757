"""Routing + permute + combine: the XLA reference against the sm90 kernels, side by side in one process on one GPU.

    PYTHONPATH=. python3 tools/bench_routing.py [--layers qwen3-30b-a3b,deepseek-v3] [--out DIR]

For each layer it times, per backend, the stages alone (route, permute, combine) and the glue of one MoE layer
around its expert GEMMs, forward and forward+backward:

    routing = route(logits);  rows = permute(x, routing);  y = combine(y_sorted, routing, weights)
    + load_balancing_loss(routing) + z_loss(logits)

``y_sorted`` stands for the expert outputs (an input here, so that XLA cannot fold combine into permute). The
backward takes cotangents for rows, y and the loss and returns gradients for logits, x and y_sorted. Before timing,
the kernels' outputs are compared with the reference's (selection and permutation exactly). Timing: compile, warm
up, then the median of ``--samples`` samples, each the mean of enough back-to-back calls to last 20 ms; the inputs
(x and y_sorted: 64 MB to 1.9 GB) are larger than L2. A table goes to stdout, the records to DIR/bench_routing.json.
"""

import argparse
import datetime
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax

LAYERS = {
    "qwen3-30b-a3b": dict(t=16384, d=2048, e=128, k=8, options=dict(score="softmax")),
    "deepseek-v3": dict(
        t=16384, d=7168, e=256, k=8, options=dict(score="sigmoid", num_groups=8, top_groups=4, scale=2.5), bias=True
    ),
}


def median_seconds(fn, args, samples: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    reps = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps)
    return float(np.median(times))


def stages(backend: str, top_k: int, options: dict, bias):
    route = functools.partial(moe_jax.route, top_k=top_k, bias=bias, backend=backend, **options)

    def glue(logits, x, y_sorted):
        routing = route(logits)
        rows = moe_jax.permute(x, routing.sort_indices, top_k, backend=backend)
        y = moe_jax.combine(y_sorted, routing.sort_indices, top_k, routing.weights, backend=backend)
        loss = moe_jax.load_balancing_loss(routing) + moe_jax.z_loss(logits)
        return rows, y, loss

    def glue_fwd_bwd(logits, x, y_sorted, d_rows, d_y):
        outputs, vjp = jax.vjp(glue, logits, x, y_sorted)
        return outputs, vjp((d_rows, d_y, jnp.ones((), jnp.float32)))

    return {
        "route": jax.jit(route),
        "permute": jax.jit(lambda x, si: moe_jax.permute(x, si, top_k, backend=backend)),
        "combine": jax.jit(lambda y, si, w: moe_jax.combine(y, si, top_k, w, backend=backend)),
        "glue fwd": jax.jit(glue),
        "glue fwd+bwd": jax.jit(glue_fwd_bwd),
    }


def check(kernel: dict, reference: dict, args: dict) -> dict:
    """Kernel against reference at the benchmark shape: exact selection and permutation, error norms of the rest."""
    got, want = (jax.tree.map(np.asarray, s["route"](args["logits"])) for s in (kernel, reference))
    mismatched = np.flatnonzero((got.experts != want.experts).any(1))
    report = dict(
        experts_equal=bool(np.array_equal(got.experts, want.experts)),
        tokens_with_other_experts=int(mismatched.size),
        sort_indices_equal=bool(np.array_equal(got.sort_indices, want.sort_indices)),
        group_sizes_equal=bool(np.array_equal(got.group_sizes, want.group_sizes)),
        weights_max_abs_err=float(np.max(np.abs(got.weights - want.weights))),
        probs_max_abs_err=float(np.max(np.abs(got.probs - want.probs))),
    )
    if mismatched.size:  # how close were the reference's scores where the choice differs?
        probs = want.probs[mismatched[:8]]
        report["first_mismatches"] = [
            dict(
                token=int(t),
                kernel=got.experts[t].tolist(),
                reference=want.experts[t].tolist(),
                reference_probs=np.sort(p)[::-1][: got.experts.shape[1] + 1].tolist(),
            )
            for t, p in zip(mismatched[:8], probs, strict=True)
        ]
    fwd_bwd = (args["logits"], args["x"], args["y_sorted"], args["d_rows"], args["d_y"])
    got, want = (
        jax.tree.map(lambda a: np.asarray(a, np.float32), s["glue fwd+bwd"](*fwd_bwd)) for s in (kernel, reference)
    )
    names = ("rows", "y", "loss", "d_logits", "d_x", "d_y_sorted")
    for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        report[f"rel_err {name}"] = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    return report


def bench_layer(name: str, samples: int) -> dict:
    layer = LAYERS[name]
    t, d, e, k = layer["t"], layer["d"], layer["e"], layer["k"]
    keys = jax.random.split(jax.random.key(0), 6)
    bias = jax.random.normal(keys[5], (e,), jnp.float32) * 0.1 if layer.get("bias") else None
    args = dict(
        logits=jax.random.normal(keys[0], (t, e), jnp.float32) * 2,
        x=jax.random.normal(keys[1], (t, d), jnp.bfloat16),
        y_sorted=jax.random.normal(keys[2], (t * k, d), jnp.bfloat16),
        d_rows=jax.random.normal(keys[3], (t * k, d), jnp.bfloat16),
        d_y=jax.random.normal(keys[4], (t, d), jnp.bfloat16),
    )
    impls = {backend: stages(backend, k, layer["options"], bias) for backend in ("xla", "pallas")}
    record = dict(layer=name, t=t, d=d, e=e, k=k, options=layer["options"], bias=bias is not None)
    record["check"] = check(impls["pallas"], impls["xla"], args)
    routing = impls["xla"]["route"](args["logits"])
    stage_args = {
        "route": (args["logits"],),
        "permute": (args["x"], routing.sort_indices),
        "combine": (args["y_sorted"], routing.sort_indices, routing.weights),
        "glue fwd": (args["logits"], args["x"], args["y_sorted"]),
        "glue fwd+bwd": (args["logits"], args["x"], args["y_sorted"], args["d_rows"], args["d_y"]),
    }
    record["ms"] = {
        stage: {backend: 1e3 * median_seconds(impls[backend][stage], stage_args[stage], samples) for backend in impls}
        for stage in stage_args
    }
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = jax.devices()[0]
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=device.device_kind,
        jax=jax.__version__,
        command="PYTHONPATH=. python3 tools/bench_routing.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    )
    print(json.dumps(meta))
    records = []
    for name in args.layers.split(","):
        record = bench_layer(name, args.samples)
        records.append(record)
        print(json.dumps(record["check"]))
        print(f"\n{name}: T={record['t']} D={record['d']} E={record['e']} k={record['k']} {record['options']}")
        print(f"{'stage':<14}{'xla ms':>10}{'pallas ms':>11}{'speedup':>9}")
        for stage, ms in record["ms"].items():
            print(f"{stage:<14}{ms['xla']:>10.3f}{ms['pallas']:>11.3f}{ms['xla'] / ms['pallas']:>8.2f}x")
    with open(os.path.join(args.out, "bench_routing.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
