"""Hardware queries that also answer on a CPU host (tests run kernels under the Mosaic GPU interpreter)."""

import jax

# What a persistent kernel assumes when no GPU is visible: small enough that the interpreter stays quick, more than one
# so that the tile schedule's round-robin is exercised.
CPU_FALLBACK_NUM_SMS = 4


def num_sms() -> int:
    """Streaming multiprocessors of the default device (an abstract mesh's device wins, as in jax's own kernels)."""
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return abstract_device.num_cores
    device = jax.devices()[0]
    if device.platform == "gpu":
        return device.core_count
    return CPU_FALLBACK_NUM_SMS
