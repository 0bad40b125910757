"""What every benchmark shares: the FLOP model, the timer, result records, run metadata and the markdown table.

Timing method (docs/design.md, "Benchmarks"): compile and run once, warm up, then take ``iters`` samples; a sample
runs the function ``reps`` times back to back (rotating over the input sets) and blocks on the last result, so that
host dispatch overlaps device work even for sub-millisecond calls; its time divided by ``reps`` is one per-call time.
We report the median of the samples and their spread (p10 to p90, relative to the median). With ``--timer device`` a
sample is instead one call's GPU time: the sum of its kernels' durations as CUPTI records them (``jax.profiler``),
without the host's dispatch and sync and the gaps between kernels (``device_time_fn``).
"""

import dataclasses
import datetime
import glob
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from benchmarks import shapes as shape_registry

# Input sets are rotated until together they are larger than this (H100/H200 L2: 50/60 MB), so that repeated calls
# read device memory rather than L2.
ROTATE_BYTES = 256 * 2**20
MAX_INPUT_SETS = 8

# --- FLOP model (the multiply-adds of the matmuls; elementwise work is not counted) ---------------------------------
FLOP_MODEL = (
    "grouped matmul fwd = 2*M*K*N (M routed rows); fwd+bwd = 3x fwd (dgrad [M,N]x[N,K] + wgrad [K,M]x[M,N]); "
    "dense baseline = one [M,K]x[K,N] bf16 matmul of the same FLOPs; "
    "moe_ffn fwd = 2*T*D*E (router) + 2*M*D*2F (gate_up) + 2*M*F*D (down), M = T*k; fwd+bwd = 3x fwd; "
    "routing: none (memory-bound stages, timed in ms)"
)


def gmm_flops(m: int, k: int, n: int, *, backward: bool) -> int:
    """FLOPs of ``[M, K] x [G, K, N]`` with every row in a group: 2MKN forward, 3x that with both gradients."""
    forward = 2 * m * k * n
    return 3 * forward if backward else forward


def moe_ffn_flops(t: int, d: int, f: int, e: int, top_k: int, *, backward: bool) -> int:
    """FLOPs of one MoE layer: router, gate_up and down matmuls (3x with gradients for x and all weights)."""
    m = t * top_k
    forward = 2 * t * d * e + 2 * m * d * (2 * f) + 2 * m * f * d
    return 3 * forward if backward else forward


# --- Timer ---------------------------------------------------------------------------------------------------------
TIMERS = ("wall", "device")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call seconds over ``samples`` samples of ``reps`` calls each; ``first_call_s`` includes compilation."""

    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    samples: int
    reps: int
    first_call_s: float
    timer: str = "wall"  # TIMERS: how a sample was taken (records of runs before the option say nothing: wall)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median."""
        return (self.p90_s - self.p10_s) / self.median_s


def input_sets_needed(set_bytes: int) -> int:
    """How many distinct input sets to rotate over so that together they exceed ``ROTATE_BYTES``."""
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATE_BYTES / max(set_bytes, 1))))


def nbytes(tree) -> int:
    """Bytes of the array leaves of ``tree`` (arrays, avals or ShapeDtypeStructs)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def input_sets(make_set: Callable[[jax.Array], dict], seed: int) -> list[dict]:
    """``make_set(key)`` for as many keys as ``input_sets_needed`` asks for a set of its size (from its shapes)."""
    count = input_sets_needed(nbytes(jax.eval_shape(make_set, jax.random.key(0))))
    return [make_set(jax.random.key(seed * 1000 + index + 1)) for index in range(count)]


def _first_calls(fn: Callable, arg_sets: Sequence[tuple], warmup: int) -> tuple[object, float, float]:
    """Runs the first call (compiling) and ``warmup`` more; returns (first output, first call's seconds, the fastest
    call's seconds: the estimate that sizes the samples)."""
    start = time.perf_counter()
    first_output = jax.block_until_ready(fn(*arg_sets[0]))
    first_call_s = time.perf_counter() - start
    estimate = first_call_s
    for call in range(1, warmup + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[call % len(arg_sets)]))
        estimate = min(estimate, time.perf_counter() - start)
    return first_output, first_call_s, max(estimate, 1e-9)


def _timing(per_call: list[float], reps: int, first_call_s: float, timer: str) -> Timing:
    p10, median, p90 = np.percentile(per_call, [10, 50, 90])
    return Timing(float(median), float(p10), float(p90), float(min(per_call)), len(per_call), reps, first_call_s, timer)


def time_fn(
    fn: Callable,
    arg_sets: Sequence[tuple],
    *,
    iters: int,
    warmup: int,
    max_seconds: float,
    min_samples: int = 3,
    min_sample_seconds: float = 2e-2,
) -> tuple[Timing, object]:
    """Times ``fn(*args)`` rotating over ``arg_sets``; returns the timing and the output of the first call.

    ``iters`` samples at most, fewer when they would take longer than ``max_seconds`` (never fewer than
    ``min_samples``): slow baselines (XLA's dense-masked ragged_dot) then cost seconds, not minutes. A sample is
    ``reps`` calls dispatched back to back and one host sync, as many as fill ``min_sample_seconds``, so that the
    first dispatch and the sync spread over many calls. With 2-ms samples the grouped forward at qwen3-30b/gate_up
    timed 0.499-0.515 ms per call against 0.457-0.461 ms of kernel time in a sustained loop (CUPTI); with 20-ms
    samples, 0.472-0.483 ms (H100).
    """
    first_output, first_call_s, estimate = _first_calls(fn, arg_sets, warmup)
    call = warmup
    reps = max(1, math.ceil(min_sample_seconds / estimate))
    samples = max(min_samples, min(iters, int(max_seconds / (reps * estimate))))
    per_call = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(reps):
            call += 1
            out = fn(*arg_sets[call % len(arg_sets)])
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / reps)
    return _timing(per_call, reps, first_call_s, "wall"), first_output


def device_time_fn(
    fn: Callable, arg_sets: Sequence[tuple], *, iters: int, warmup: int, max_seconds: float, min_samples: int = 3
) -> tuple[Timing, object]:
    """Like ``time_fn``, but a sample is one call's GPU time: the sum of its kernels' durations (CUPTI).

    The host's dispatch and sync and any gap between the call's kernels are left out, so the samples spread less than
    the wall clock's (a 2-ms grouped matmul: ~1% against 5-13%, H100) and compare kernels rather than launch paths.
    Needs a GPU: elsewhere the trace holds no kernel and this raises RuntimeError.
    """
    first_output, first_call_s, estimate = _first_calls(fn, arg_sets, warmup)
    samples = max(min_samples, min(iters, int(max_seconds / estimate)))
    calls = kernel_calls(fn, arg_sets, samples, warmup=0)
    per_call = [sum(duration for _, _, duration in call) / 1e9 for call in calls]
    return _timing(per_call, 1, first_call_s, "device"), first_output


def kernel_calls(
    fn: Callable, arg_sets: Sequence[tuple], calls: int, warmup: int = 3
) -> list[list[tuple[str, int, int]]]:
    """Per call of ``fn`` (rotating over ``arg_sets``, after ``warmup`` untraced calls), its GPU kernels as (name,
    start_ns, duration_ns), from a ``jax.profiler`` (CUPTI) trace. Each call is waited for before the next one starts,
    so that no two calls' kernels interleave."""
    for call in range(warmup):
        jax.block_until_ready(fn(*arg_sets[call % len(arg_sets)]))

    def run():
        for call in range(calls):
            jax.block_until_ready(fn(*arg_sets[call % len(arg_sets)]))

    return split_calls([event[:3] for event in profiled_kernels(run)], calls)


def profiled_kernels(run: Callable[[], object]) -> list[tuple[str, int, int, str]]:
    """The GPU kernels that ``run()`` launched, as (name, start_ns, duration_ns, the HLO op that launched it or "")
    from a ``jax.profiler`` (CUPTI) trace of the call."""
    trace_dir = tempfile.mkdtemp(prefix="moe_jax_profile_")
    with jax.profiler.trace(trace_dir):
        run()
    [path] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            if "stream" in line.name.lower():  # CUPTI's kernel lines; the others are XLA's op and module spans
                events += [(event.name, event.start_ns, event.duration_ns, _hlo_op(event)) for event in line.events]
    return events


# XLA's annotation of a launch, as the trace may carry it in a string stat: "...#hlo_op=fusion.3,hlo_module=...#".
_ANNOTATED_HLO_OP = re.compile(r"hlo_op=([^,#\s]+)")


def _hlo_op(event) -> str:
    """The HLO op that launched a trace's kernel event: its "hlo_op" stat, or the one its annotation names, or ""."""
    stats = [(key, str(value)) for key, value in event.stats]
    for key, value in stats:
        if key == "hlo_op":
            return value
    return next((match[1] for _, value in stats if (match := _ANNOTATED_HLO_OP.search(value))), "")


def split_calls(events: list[tuple[str, int, int]], calls: int) -> list[list[tuple[str, int, int]]]:
    """(name, start_ns, duration_ns) kernel events of ``calls`` equal calls, in start order, cut into one list per
    call. Raises RuntimeError when they do not divide evenly (no kernel at all: no GPU; or calls that differ)."""
    events = sorted(events, key=lambda event: event[1])
    if not events or len(events) % calls:
        raise RuntimeError(f"{len(events)} GPU kernel events for {calls} calls: not the same kernels in every call")
    per_call = len(events) // calls
    return [events[i : i + per_call] for i in range(0, len(events), per_call)]


def named_shapes(text: str | None, registry: dict, by_tag: Callable[[str], list], default: list) -> list:
    """The shapes a command line's ``text`` names: comma-separated names from ``registry``, or tags of
    ``benchmarks.shapes`` (e.g. "heuristic"), each standing for ``by_tag(tag)``; ``default`` when ``text`` is None."""
    if text is None:
        return default
    chosen, unknown = [], []
    for item in text.split(","):
        if item in shape_registry.TAGS:
            chosen += by_tag(item)
        elif item in registry:
            chosen.append(registry[item])
        else:
            unknown.append(item)
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; known: {', '.join(registry)} and the tags {shape_registry.TAGS}")
    return chosen


def selection_bias(num_experts: int, seed: int) -> jax.Array:
    """[E] f32 ~ N(0, 0.1^2): the selection bias of a router that has one (DeepSeek-V3), the same for every
    implementation in a run; it moves the experts whose scores lie within ~0.1 of the k-th best."""
    return jax.random.normal(jax.random.key(seed + 7919), (num_experts,), jnp.float32) * 0.1


def routing_kwargs(shape, seed: int) -> dict:
    """``moe_jax.route``'s keyword arguments at a LayerShape: top_k, its router options and, where the router has
    one, the run's ``selection_bias``."""
    bias = selection_bias(shape.e, seed) if shape.selection_bias else None
    return dict(top_k=shape.top_k, bias=bias, **shape.route_options())


def moe_ffn_layer(shape, backend: str, route_kwargs: dict, quantization: str | None = None) -> Callable:
    """``(x, router_kernel, w_gate_up, w_down) -> (y, (load_balancing_loss, z_loss))``: ``moe_jax.moe_ffn`` at a
    LayerShape with its router options (``routing_kwargs``) on ``backend``, with ``quantization``."""

    def layer(x, router_kernel, w_gate_up, w_down):
        y, aux = moe_jax.moe_ffn(
            x,
            router_kernel,
            w_gate_up,
            w_down,
            activation=shape.activation,
            backend=backend,
            quantization=quantization,
            **route_kwargs,
        )
        return y, (aux.load_balancing_loss, aux.z_loss)

    return layer


def layer_output(layer: Callable) -> Callable:
    """``moe_ffn_layer``'s function returning y alone."""
    return lambda *arrays: layer(*arrays)[0]


@jax.jit
def _leaf_error(actual, expected):
    actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(actual - expected)) / jnp.sum(jnp.square(expected)))


def forward_backward(fn: Callable, num_differentiated: int | None = None) -> Callable:
    """``(*args, ct) -> (out, *grads)``: ``fn(*args)`` and its vjp for the cotangent ``ct``, differentiating the first
    ``num_differentiated`` arguments (default: all of them)."""

    def run(*args_and_ct):
        *args, ct = args_and_ct
        count = len(args) if num_differentiated is None else num_differentiated
        out, vjp = jax.vjp(lambda *differentiated: fn(*differentiated, *args[count:]), *args[:count])
        return (out, *vjp(ct))

    return run


def relative_errors(actual, expected) -> list[float]:
    """``||actual - expected|| / ||expected||`` in f32 for each leaf of two equally structured pytrees."""
    return [float(e) for e in jax.tree.leaves(jax.tree.map(_leaf_error, actual, expected))]


# --- Options and one measurement --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options:
    """What the CLI chose: which implementations run and how long each is timed."""

    backends: tuple[str, ...] = ("xla", "pallas")
    baselines: tuple[str, ...] = ("dense", "ragged_dot", "tokamax")
    tokamax_sweep: bool = True
    iters: int = 20
    warmup: int = 2
    max_seconds: float = 1.0
    min_samples: int = 3
    seed: int = 0
    timer: str = "wall"  # TIMERS: time_fn ("wall") or device_time_fn ("device")
    deadline: float | None = None  # time.perf_counter() after which measurements are skipped (--time-limit)
    quantization: str | None = None  # gmm: time grouped_matmul(quantization=...) instead ("gmm-fp8")


# --- Records ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Record:
    """One (bench, shape, routing, implementation[, stage]) measurement, or why there is none.

    ``status`` is "ok", "n/a" (not available here: no kernel yet, peer not installed, no GPU), "OOM", "error",
    "skipped" (past the run's time limit) or "wrong" (timed, but an output that must be exact differs from
    ``checked_against``'s); ``note`` says why for anything but "ok". ``rel_err_leaves`` compares each output (and
    gradient) with ``checked_against``; ``rel_err`` is their max. ``flops`` is 0 for a bench without a FLOP model
    (routing: memory-bound stages), ``stage`` names the part of the op a bench times separately (routing's "route",
    "permute", ...).
    """

    bench: str
    shape: str
    routing: str
    impl: str
    flops: int
    dims: dict
    status: str = "ok"
    note: str = ""
    timing: Timing | None = None
    rel_err: float | None = None
    rel_err_leaves: list[float] | None = None
    checked_against: str = ""
    config: dict | None = None
    stage: str = ""

    @property
    def tflops(self) -> float | None:
        return self.flops / self.timing.median_s / 1e12 if self.timing and self.flops else None

    def set_check(self, leaf_errors: list[float], against: str) -> None:
        self.rel_err_leaves, self.rel_err, self.checked_against = leaf_errors, max(leaf_errors), against

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["tflops"] = self.tflops
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Record":
        # Records of older runs lack the fields added since (and ``timing`` where nothing was timed): defaults.
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        fields["timing"] = Timing(**data["timing"]) if data.get("timing") else None
        return cls(**fields)


def classify_failure(error: BaseException) -> tuple[str, str]:
    """(status, note) for an exception raised by a candidate: n/a, OOM or error."""
    text = str(error)
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if isinstance(error, NotImplementedError):
        return "n/a", first_line[:160]
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        # XLA's first line is often a wrapper ("Failed to get configs ..."); the allocation that failed says more.
        allocation = re.search(r"[Oo]ut of memory while trying to allocate [\d.]+ ?[KMGT]?i?B", text)
        return "OOM", allocation.group(0) if allocation else first_line[:160]
    return "error", f"{type(error).__name__}: {first_line[:160]}"


def past_deadline(options: Options) -> bool:
    """True once the run's --time-limit is spent: benches then skip even building their inputs."""
    return options.deadline is not None and time.perf_counter() > options.deadline


def skip(record: Record) -> Record:
    record.status, record.note = "skipped", "past --time-limit"
    return record


def measure(record: Record, fn: Callable, arg_sets: Sequence[tuple], options: Options) -> object:
    """Times ``fn`` into ``record`` (or records why it could not run); returns its first output, or None."""
    if past_deadline(options):
        skip(record)
        return None
    timer = device_time_fn if options.timer == "device" else time_fn
    try:
        record.timing, output = timer(
            fn,
            arg_sets,
            iters=options.iters,
            warmup=options.warmup,
            max_seconds=options.max_seconds,
            min_samples=options.min_samples,
        )
    except Exception as error:  # a candidate failing (no kernel, OOM, bad config) must not stop the table
        record.status, record.note = classify_failure(error)
        return None
    return output


def git_revision() -> str:
    """$MOE_JAX_GIT_REVISION if set, else the checkout's commit (+ "-dirty").

    The variable wins because a tree copied to the GPU machine can carry a stale .git (the device tool copies the
    working tree, not the history): whoever sets the variable knows which commit the files are.
    """
    if os.environ.get("MOE_JAX_GIT_REVISION"):
        return os.environ["MOE_JAX_GIT_REVISION"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain"], capture_output=True, text=True).stdout
        return rev + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_metadata(command: str, peers: dict[str, str]) -> dict:
    """Device, versions, git revision, date and command of this run."""
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "python": platform.python_version(),
        "git_revision": git_revision(),
        "command": command,
        "peers": peers,
        "flop_model": FLOP_MODEL,
    }


def read_run(path: str) -> tuple[dict, list[Record]]:
    """(meta, records) of a run streamed with ``JsonlWriter``: its metadata line, then one line per record."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[0]["meta"], [Record.from_json(line) for line in lines[1:]]


class JsonlWriter:
    """Appends one JSON line per record as soon as it exists, so a run cut short still leaves its numbers."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            open(path, "w").close()

    def write(self, obj: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(obj) + "\n")


# --- Table ---------------------------------------------------------------------------------------------------------
TABLE_HEADER = (
    "| shape | routing | impl | GFLOP | median ms | spread | TF/s | vs dense | rel err |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|",
)


def _number(value: float) -> str:
    """One decimal from 1 up, three significant digits below (tiny CPU shapes)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def markdown_table(records: Sequence[Record], note_width: int = 90) -> str:
    """One row per record; "vs dense" is the TF/s ratio to the dense matmul of the same shape and bench."""
    dense = {(r.bench, r.shape): r.tflops for r in records if r.impl == "dense" and r.tflops}
    rows = list(TABLE_HEADER)
    for r in records:
        head = f"| {r.shape} | {r.routing} | {r.impl} | {_number(r.flops / 1e9)} |"
        if r.timing is None:
            note = f"{r.status}: {r.note}" if r.note else r.status
            if len(note) > note_width:
                note = note[: note_width - 3] + "..."
            rows.append(f"{head} {note} | | | | |")
            continue
        ceiling = dense.get((r.bench, r.shape))
        ratio = f"{r.tflops / ceiling:.2f}" if ceiling else ""
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else ""
        rows.append(
            f"{head} {r.timing.median_s * 1e3:.3f} | {r.timing.spread * 100:.0f}% | {_number(r.tflops)} | {ratio} | "
            f"{err} |"
        )
    return "\n".join(rows)
