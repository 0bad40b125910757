"""Compilation: JAX's persistent compilation cache, and ahead-of-time compilation of a step with its phases timed.

The persistent cache keys an executable by its lowered module (Mosaic GPU kernels included, which lower to custom
calls inside it), so a second launch skips XLA's compilation and autotuning, not the tracing and lowering that
produce the key. Timing the phases apart says which of them a change moves.
"""

import dataclasses
import pathlib
import time

import jax


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
    (XLA, or a persistent-cache hit)."""

    trace_s: float
    lower_s: float
    compile_s: float

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s


def compile_ahead(jitted, *args) -> tuple[jax.stages.Compiled, CompileTimes]:
    """``jitted.trace(*args).lower().compile()`` with each phase timed; ``args`` may be ``jax.ShapeDtypeStruct``s."""
    start = time.perf_counter()
    traced = jitted.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    return compiled, CompileTimes(traced_at - start, lowered_at - traced_at, compiled_at - lowered_at)


def abstract(tree):
    """The ``jax.ShapeDtypeStruct``s (shardings included) of a tree of arrays."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
