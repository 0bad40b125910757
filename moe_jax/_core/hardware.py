"""Hardware queries that also answer on a CPU host (tests run kernels under the Mosaic GPU interpreter)."""

import os

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
MIN_CPU_POOL_THREADS = 16

# What a persistent kernel assumes when no GPU is visible: small enough that the interpreter stays quick, more than one
# so that the tile schedule's round-robin is exercised.
CPU_FALLBACK_NUM_SMS = 4


def configure_cpu_for_interpreted_kernels() -> None:
    """What the Mosaic GPU interpreter needs from XLA:CPU, each unless the user set it: ``SERIAL_CPU_SCHEDULER_FLAG``
    in XLA_FLAGS (CPU backend only), and at least MIN_CPU_POOL_THREADS pool threads (PJRT_NPROC, on hosts with fewer
    cores; NPROC, which XLA also reads, counts as set).

    XLA reads both when it creates its first backend, so this runs when moe_jax is imported; it has no effect if a
    computation ran before that.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    option = SERIAL_CPU_SCHEDULER_FLAG.split("=")[0]
    if option not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SERIAL_CPU_SCHEDULER_FLAG}".strip()
    pool_set = "PJRT_NPROC" in os.environ or "NPROC" in os.environ
    if not pool_set and (os.cpu_count() or 1) < MIN_CPU_POOL_THREADS:
        os.environ["PJRT_NPROC"] = str(MIN_CPU_POOL_THREADS)


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
    return None if compiles_for_gpu() else plgpu.InterpretGPUParams()
