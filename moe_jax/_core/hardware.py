"""Hardware queries that also answer on a CPU host (tests run kernels under the Mosaic GPU interpreter)."""

import functools
import os
import warnings

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

# XLA:CPU's concurrency-optimised scheduler runs independent custom calls of one program at the same time, but the
# Mosaic GPU interpreter keeps one kernel's simulated memory and barriers in global state: two interpreted kernels
# at once (e.g. the dgrad and wgrad of a jitted backward) deadlock in a barrier wait. Seen with jax 0.11.2 on CPU.
SERIAL_CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

# The interpreter runs each simulated warpgroup as an XLA:CPU computation of its own, and a barrier wait is a Python
# callback that blocks whichever thread runs it, at times one of the CPU client's pool threads. The pool has one thread
# per core unless PJRT_NPROC says otherwise, so on a 2-core host two blocked waits (or one and the kernel's own
# callback) left no thread for the warpgroup that would release them: the notebook's first interpreted moe_ffn at its
# "cpu" size hung (jax 0.11.2, 2026-11-26; docs/kernels/grouped_matmul.md) and ran through 4 of 4 with a pool of 16.
# Not set at import: 16 threads on 2 cores slowed XLA's own work (the main job for 120 steps, XLA only, three rounds
# alternating: 91-102 s against 74-83 s with the default pool).
MIN_CPU_POOL_THREADS = 16
_POOL_VARIABLES = ("PJRT_NPROC", "NPROC")  # what XLA reads for its pool size, in this order

# What a persistent kernel assumes when no GPU is visible: small enough that the interpreter stays quick, more than one
# so that the tile schedule's round-robin is exercised.
CPU_FALLBACK_NUM_SMS = 4


def serialize_interpreted_kernels() -> None:
    """Adds ``SERIAL_CPU_SCHEDULER_FLAG`` to XLA_FLAGS unless the user set that option; CPU backend only.

    XLA reads the flags when it creates its first backend, so this runs when moe_jax is imported; it has no effect if
    a computation ran before that.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    option = SERIAL_CPU_SCHEDULER_FLAG.split("=")[0]
    if option not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SERIAL_CPU_SCHEDULER_FLAG}".strip()


def _cpu_pool_is_narrow() -> bool:
    """Whether XLA:CPU's pool will have fewer than MIN_CPU_POOL_THREADS threads (no size set, fewer cores)."""
    return not any(name in os.environ for name in _POOL_VARIABLES) and (os.cpu_count() or 1) < MIN_CPU_POOL_THREADS


def widen_cpu_pool_for_interpreter() -> None:
    """Sets PJRT_NPROC to MIN_CPU_POOL_THREADS where the pool would be narrower (unless PJRT_NPROC or NPROC is set).

    For processes that run kernels under the Mosaic GPU interpreter (the tests, the notebook); call it before the
    first JAX computation, as XLA reads the size when it creates its CPU backend.
    """
    if _cpu_pool_is_narrow():
        os.environ["PJRT_NPROC"] = str(MIN_CPU_POOL_THREADS)


@functools.cache
def _warn_if_the_interpreter_may_starve() -> None:
    if _cpu_pool_is_narrow():
        warnings.warn(
            f"The Mosaic GPU interpreter can deadlock in a barrier wait on this {os.cpu_count()}-core host: XLA:CPU's "
            f"pool has one thread per core and each waiting warpgroup holds one. Set PJRT_NPROC={MIN_CPU_POOL_THREADS} "
            "before the first JAX computation (moe_jax._core.hardware.widen_cpu_pool_for_interpreter()).",
            RuntimeWarning,
            stacklevel=3,
        )


def num_sms() -> int:
    """Streaming multiprocessors of the default device (an abstract mesh's device wins, as in jax's own kernels)."""
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    # A mesh of CPU devices has an abstract device without a core count: fall through to the CPU fallback.
    if abstract_device is not None and abstract_device.num_cores is not None:
        return abstract_device.num_cores
    device = jax.devices()[0]
    if device.platform == "gpu":
        return device.core_count
    return CPU_FALLBACK_NUM_SMS


def compiles_for_gpu() -> bool:
    """True when kernels are built for a real GPU: one is present, or an abstract mesh names a GPU device.

    The abstract device is how a CPU host lowers kernels for CUDA (``.lower(lowering_platforms=("cuda",))``) in
    tests: ``jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=...platform="gpu"...))``.
    """
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return abstract_device.platform == "gpu"
    return jax.devices()[0].platform == "gpu"


def interpret_params():
    """None when compiling for a GPU; elsewhere the Mosaic GPU interpreter (``force_gpu_interpret_mode`` wins)."""
    if compiles_for_gpu():
        return None
    _warn_if_the_interpreter_may_starve()
    return plgpu.InterpretGPUParams()
