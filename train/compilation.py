"""Compilation: JAX's persistent compilation cache, ahead-of-time compilation of a step with its phases timed, and
a store of compiled steps that lets a later launch skip tracing, lowering and compiling altogether.

The persistent cache keys an executable by its lowered module (Mosaic GPU kernels included, which lower to custom
calls inside it), so a second launch with it skips XLA's compilation and autotuning, not the tracing and lowering
that produce the key; with many kernels the lowering is most of what is left. ``ExecutableStore`` keys a serialized
executable by what determines the program instead (the caller's description of it, the source of the packages that
trace it, the library versions, the devices, the arguments' shapes and shardings), all known before tracing, and
loads it in place of the three phases. Timing the phases apart says which of them a change moves.
"""

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import pickle
import sys
import time
import warnings

import jax
from jax.experimental import serialize_executable

from moe_jax._core.backend import has_sm90_gpu
from moe_jax.compilation import compiling_kernels_while_lowering

# Distributions whose code shapes a compiled step: these, and any whose name starts with one of the prefixes (JAX,
# its plugins, and NVIDIA's CUDA libraries: cuDNN, cuBLAS and the compiler pick kernels and emit code).
_TRACING_DISTRIBUTIONS = ("flax", "optax", "numpy", "ml_dtypes")
_DISTRIBUTION_PREFIXES = ("jax", "nvidia")
# What jax.monitoring records when a compilation is answered by the persistent cache.
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Environment variables that change what XLA, Mosaic GPU (MOSAIC_GPU_*) or cuBLAS compile or run.
_COMPILER_VARIABLES = ("XLA_FLAGS", "NVIDIA_TF32_OVERRIDE")


def enable_compile_cache(directory: str | pathlib.Path) -> None:
    """Caches every executable this process compiles in ``directory`` (created if missing), and XLA's autotuning
    results (JAX's default companion cache).

    Call it before the first compilation: JAX opens the cache once. The thresholds are lowered to nothing because
    the steps' executables are what a launch waits for, and small or quickly compiled ones cost little to keep.
    """
    path = pathlib.Path(directory).absolute()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclasses.dataclass(frozen=True)
class CompileTimes:
    """Seconds spent tracing (Python to jaxpr), lowering (jaxpr to StableHLO, kernels included) and compiling
    (XLA, or a persistent-cache hit), or loading a stored executable in place of all three.

    ``aot``: "loaded" (an ``ExecutableStore`` held the step: trace and lower are 0, compile_s is the load),
    "saved" (compiled, then stored for the next launch) or "off" (no store, a step the persistent cache gave
    back, which ``compile_or_load`` does not store, or one that cannot be stored).
    """

    trace_s: float
    lower_s: float
    compile_s: float
    aot: str = "off"

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s


# XLA's own compilation of a step trades seconds for speed in two places: it compiles and times Triton candidates
# for every GEMM fusion of its own (the attention projections, the router, the LM head), and it unrolls each loop
# (the scanned layers, the gradient-accumulation loop) twice to overlap one iteration's asynchronous work with the
# next's. Off, its GEMMs are cuBLAS calls with the producing fusions apart, and the loops stay rolled.
QUICK_COMPILE_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_while_loop_double_buffering": False}
# Beside the Pallas kernels XLA's GEMMs are plain dense matmuls, which cuBLAS runs as fast as the Triton fusions: the
# Triton GEMMs' autotuning is seconds of the compile for no speed there (train/README.md, "Compile options").
PALLAS_COMPILE_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(*, backend: str, quick: bool) -> dict:
    """XLA compiler options of a step on ``backend``: ``PALLAS_COMPILE_OPTIONS`` where the MoE layers run on the
    Pallas kernels ("pallas", or "auto" on an sm90 GPU), XLA's defaults elsewhere, and with ``quick``
    ``QUICK_COMPILE_OPTIONS`` too (train/README.md gives what each saves and costs on an H200)."""
    kernels = backend == "pallas" or (backend == "auto" and has_sm90_gpu())
    options = dict(PALLAS_COMPILE_OPTIONS) if kernels else {}
    return options | QUICK_COMPILE_OPTIONS if quick else options


def compile_ahead(
    jitted, *args, parallel_kernels: bool = True, options: dict | None = None
) -> tuple[jax.stages.Compiled, CompileTimes]:
    """``jitted.trace(*args).lower().compile(options)`` with each phase timed; ``args`` may be
    ``jax.ShapeDtypeStruct``s. With ``parallel_kernels`` each Mosaic GPU kernel starts compiling on a thread pool as
    soon as it is lowered (``moe_jax.compiling_kernels_while_lowering``), else they compile one after another inside
    XLA's compilation. ``options``: XLA compiler options (``compiler_options``)."""
    kernels = compiling_kernels_while_lowering() if parallel_kernels else contextlib.nullcontext()
    with kernels as pool:
        start = time.perf_counter()
        traced = jitted.trace(*args)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        lowered_at = time.perf_counter()
        compiled = pool.compile(lowered, options) if parallel_kernels else lowered.compile(options)
        compiled_at = time.perf_counter()
    return compiled, CompileTimes(traced_at - start, lowered_at - traced_at, compiled_at - lowered_at)


def abstract(tree):
    """The ``jax.ShapeDtypeStruct``s (shardings included) of a tree of arrays."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def source_digest(*packages: str | pathlib.Path) -> str:
    """SHA-256 over the relative paths and bytes of every file under the ``packages`` directories (compiled
    ``__pycache__`` files aside): any edit to the code that traces a step, or to data it reads, changes it."""
    digest = hashlib.sha256()
    for package in map(pathlib.Path, packages):
        files = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(package.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> dict:
    """What outside the caller's description changes a compiled program: library versions, devices, the compilers'
    environment variables and JAX's configuration (its cache and logging options aside, which change no program)."""
    distributions = {
        dist.metadata["Name"].lower(): dist.version
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
        and (
            dist.metadata["Name"].lower().startswith(_DISTRIBUTION_PREFIXES)
            or dist.metadata["Name"].lower() in _TRACING_DISTRIBUTIONS
        )
    }
    devices = jax.devices()
    return {
        "distributions": dict(sorted(distributions.items())),
        "platform": devices[0].platform,
        "platform_version": devices[0].client.platform_version,
        # The SM count too: a MIG slice keeps its GPU's kind, and the persistent kernels size their grids by it.
        "devices": [(d.id, d.device_kind, getattr(d, "core_count", None)) for d in devices],
        "python": sys.version,
        "process_count": jax.process_count(),
        "variables": {
            name: value
            for name, value in sorted(os.environ.items())
            if name in _COMPILER_VARIABLES or name.startswith("MOSAIC_GPU_")
        },
        "jax_config": {
            name: repr(value)
            for name, value in sorted(jax.config.values.items())
            if "cache" not in name and not name.startswith(("jax_log", "jax_debug_log"))
        },
    }


class ExecutableStore:
    """Compiled steps serialized under ``directory``, one file per key (``key``'s SHA-256).

    A key covers everything that determines the program, so a change to any of it makes a new key and the old file
    is never read for it: a stored step runs only where it would have compiled to the same program. A file that
    fails to load (truncated, written by another jaxlib) counts as a miss. Files are written whole (a temporary
    file renamed into place), so a process that dies mid-write leaves no half file under a key. Each is about the
    size of its persistent-cache entry, and every edit to the code makes new keys, so the store keeps the ``keep``
    most recently used and deletes the rest as it saves.

    Loading a file runs what it holds: use a directory only this user writes (``serialize_executable``'s warning).
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 8):
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the step just saved), got {keep}")
        self.directory = pathlib.Path(directory)
        self.keep = keep

    def key(self, description: dict, sources: tuple[str | pathlib.Path, ...], args, options: dict | None = None) -> str:
        """The key of a step compiled at ``args`` (arrays or ``jax.ShapeDtypeStruct``s with shardings) with the XLA
        compiler ``options``, where ``description`` (JSON-serialisable) fixes what the step's function closes over
        (its configuration) and ``sources`` are the package directories whose code traces it."""
        leaves, tree = jax.tree.flatten(args)
        arguments = [(leaf.shape, str(leaf.dtype), repr(getattr(leaf, "sharding", None))) for leaf in leaves]
        contents = {
            "description": description,
            "source": source_digest(*sources),
            "environment": _environment(),
            "tree": str(tree),
            "arguments": arguments,
            "compiler_options": options or {},
        }
        return hashlib.sha256(json.dumps(contents, sort_keys=True, default=repr).encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.executable"

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The step stored under ``key``, or None where there is none or it does not load."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            os.utime(path)  # recently used: kept the longest
            return compiled
        except Exception as error:  # any failure to load is a miss: the step compiles instead
            warnings.warn(
                f"the stored step {path} does not load ({error!r}); compiling it", RuntimeWarning, stacklevel=3
            )
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Stores ``compiled`` under ``key``; False where it cannot be: it calls back into Python (the Mosaic GPU
        interpreter's kernels do), or does not serialize (with a warning)."""
        # A host callback is a pointer into this process: another process would call whatever lies there. (JAX's
        # persistent cache binds the loading process's own callbacks, which it has from lowering the step; a stored
        # step is loaded without lowering.) Keep-alives are not refused: the ones JAX makes (custom partitioning,
        # which cuDNN attention uses) serve the compilation only. serialize_executable reads the same private
        # attribute.
        unloaded = getattr(compiled._executable, "_unloaded_executable", None)
        if unloaded is not None and unloaded.host_callbacks:
            return False
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as error:  # a step that does not serialize is compiled on every launch
            warnings.warn(
                f"the compiled step cannot be stored ({error!r}); the next launch compiles it",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self._path(key).with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(data)
        temporary.replace(self._path(key))
        stored = sorted(self.directory.glob("*.executable"), key=_last_used, reverse=True)
        for stale in stored[self.keep :]:
            stale.unlink(missing_ok=True)
        return True


def _last_used(path: pathlib.Path) -> float:
    """A stored step's modification time (loading touches it); 0 for one another process has just deleted."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def compile_or_load(
    jitted,
    *args,
    store: ExecutableStore | None,
    description: dict,
    sources: tuple[str | pathlib.Path, ...],
    options: dict | None = None,
) -> tuple[jax.stages.Compiled, CompileTimes]:
    """``compile_ahead(jitted, *args, options=options)``, unless ``store`` holds the step under its key
    (``ExecutableStore.key`` of ``description``, ``sources``, ``args`` and ``options``): then that, loaded. A step
    compiled here is stored for the next launch where it can be (``CompileTimes.aot`` says). Without a store it is
    ``compile_ahead``."""
    if store is None:
        return compile_ahead(jitted, *args, options=options)
    start = time.perf_counter()
    key = store.key(description, sources, args, options)
    compiled = store.load(key)
    if compiled is not None:
        return compiled, CompileTimes(0.0, 0.0, time.perf_counter() - start, aot="loaded")
    hits = []

    def count_cache_hits(event: str, **_):
        if event == CACHE_HIT_EVENT:
            hits.append(event)

    jax.monitoring.register_event_listener(count_cache_hits)
    try:
        compiled, times = compile_ahead(jitted, *args, options=options)
    finally:
        jax.monitoring.unregister_event_listener(count_cache_hits)
    # An executable the persistent cache gave back does not always serialize into one that runs: on the CPU the
    # stored copy loads, then fails on its first call ("Function ... not found"). Only fresh compilations are stored;
    # the next launch hits the cache again.
    saved = not hits and store.save(key, compiled)
    return compiled, dataclasses.replace(times, aot="saved" if saved else "off")
