"""Hardware queries that also answer on a CPU host (tests run kernels under the Mosaic GPU interpreter)."""

import functools
import os
import warnings

import jax
from jax.experimental.mosaic.gpu import fragmented_array
from jax.experimental.pallas import mosaic_gpu as plgpu

# XLA:CPU's concurrency-optimised scheduler runs independent custom calls of one program at the same time, but the
# Mosaic GPU interpreter keeps one kernel's simulated memory and barriers in global state: two interpreted kernels
# at once (e.g. the dgrad and wgrad of a jitted backward) deadlock in a barrier wait. Seen with jax 0.11.2 on CPU.
SERIAL_CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_SERIAL_CPU_SCHEDULER_OPTION = SERIAL_CPU_SCHEDULER_FLAG.split("=")[0]

# The interpreter runs each simulated warpgroup as an XLA:CPU computation of its own, and a barrier wait is a Python
# callback that blocks whichever thread runs it, at times one of the CPU client's pool threads. The pool has one thread
# per core unless PJRT_NPROC says otherwise, so on a 2-core host two blocked waits (or one and the kernel's own
# callback) leave no thread for the warpgroup that would release them (docs/kernels/grouped_matmul.md, "Running
# kernels on a CPU"); a pool of 16 runs through. Only on request: 16 threads on 2 cores slow XLA's own work.
MIN_CPU_POOL_THREADS = 16
_POOL_VARIABLES = ("PJRT_NPROC", "NPROC")  # what XLA reads for its pool size, in this order

# What a persistent kernel assumes when no GPU is visible: small enough that the interpreter stays quick, more than one
# so that the tile schedule's round-robin is exercised.
CPU_FALLBACK_NUM_SMS = 4


def configure_cpu_interpreter() -> None:
    """Sets the XLA:CPU options under which the Mosaic GPU interpreter runs kernels without deadlocking.

    For processes that run ``backend="pallas"`` on a CPU host (the tests, the notebook, ``python -m train`` or
    ``python -m benchmarks`` without a GPU). Call it before the first JAX computation: XLA reads both options when it
    creates its CPU backend, and ignores later changes. It

    - adds ``SERIAL_CPU_SCHEDULER_FLAG`` to ``XLA_FLAGS`` unless that option is set there already;
    - sets ``PJRT_NPROC`` to ``MIN_CPU_POOL_THREADS`` where the CPU client's pool would be narrower (fewer cores, and
      neither ``PJRT_NPROC`` nor ``NPROC`` set).

    Neither matters to a GPU backend. ``import moe_jax`` changes no environment variable; this is the one place that
    does.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _SERIAL_CPU_SCHEDULER_OPTION not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SERIAL_CPU_SCHEDULER_FLAG}".strip()
    if _cpu_pool_is_narrow():
        os.environ["PJRT_NPROC"] = str(MIN_CPU_POOL_THREADS)


def _cpu_pool_is_narrow() -> bool:
    """Whether XLA:CPU's pool will have fewer than MIN_CPU_POOL_THREADS threads (no size set, fewer cores)."""
    return not any(name in os.environ for name in _POOL_VARIABLES) and (os.cpu_count() or 1) < MIN_CPU_POOL_THREADS


@functools.cache
def _warn_if_the_interpreter_may_deadlock() -> None:
    missing = []
    if _SERIAL_CPU_SCHEDULER_OPTION not in os.environ.get("XLA_FLAGS", ""):
        missing.append(f"XLA_FLAGS lacks {SERIAL_CPU_SCHEDULER_FLAG} (two interpreted kernels may run at once)")
    if _cpu_pool_is_narrow():
        missing.append(
            f"XLA:CPU's pool has one thread per core on this {os.cpu_count()}-core host and each waiting warpgroup "
            "holds one"
        )
    if missing:
        warnings.warn(
            f"The Mosaic GPU interpreter can deadlock in a barrier wait: {'; '.join(missing)}. Call "
            "moe_jax.configure_cpu_interpreter() before the first JAX computation.",
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
    """None when compiling for a GPU; elsewhere the Mosaic GPU interpreter (``force_gpu_interpret_mode`` wins).

    Every kernel launch asks this before its kernel is lowered, so for a GPU it also makes the lowering's ``ptxas``
    query cheap (``cache_ptxas_isa_version``).
    """
    if compiles_for_gpu():
        cache_ptxas_isa_version()
        return None
    _warn_if_the_interpreter_may_deadlock()
    return plgpu.InterpretGPUParams()


def cache_ptxas_isa_version() -> None:
    """Answers Mosaic GPU's query for the newest PTX ISA that ``ptxas`` supports from a per-process cache.

    jax 0.11.2's ``FragmentedArray.astype`` asks jaxlib for that version on every conversion that involves a type of 8
    bits or fewer, and each bool -> int32 conversion is one (every ``pl.when`` and ``lax.cond`` in a kernel makes
    one: about 40 a grouped-matmul kernel). jaxlib does not cache the answer and asks ``ptxas`` each time, which on
    a GPU host makes it most of a kernel's lowering time (docs/kernels/grouped_matmul.md, "Lowering and compile
    time"). The answer cannot change within a process. A no-op where jaxlib has no Mosaic GPU extension (CPU-only
    installs) and when already cached.
    """
    extension = getattr(fragmented_array.mgpu_lib, "_mosaic_gpu_ext", None)
    query = getattr(extension, "_get_ptxas_isa_version", None)
    if query is None or getattr(query, "cache_info", None) is not None:
        return
    extension._get_ptxas_isa_version = functools.cache(query)
