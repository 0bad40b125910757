"""Hardware queries that also answer on a CPU host (tests run kernels under the Mosaic GPU interpreter)."""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

# What a persistent kernel assumes when no GPU is visible: small enough that the interpreter stays quick, more than one
# so that the tile schedule's round-robin is exercised.
CPU_FALLBACK_NUM_SMS = 4


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
