"""Backend selection: "xla" (pure-JAX reference), "pallas" (Mosaic GPU kernels), "auto"."""

import functools

import jax

from moe_jax._core.checks import check_choice

BACKENDS = ("auto", "xla", "pallas")


@functools.cache
def has_sm90_gpu() -> bool:
    """True when the default device is an NVIDIA GPU of compute capability 9.0 (H100/H200)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def resolve_backend(backend: str, *, op: str, has_kernel: bool) -> str:
    """Maps "auto" to "pallas" where ``op`` has a kernel and an sm90 GPU is present, else to "xla".

    Asking for "pallas" where ``op`` has no kernel yet raises NotImplementedError naming the op.
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        return "pallas" if has_kernel and has_sm90_gpu() else "xla"
    if backend == "pallas" and not has_kernel:
        raise NotImplementedError(
            f"{op}: no Pallas Mosaic GPU kernel exists yet; use backend='xla' (or 'auto', which falls back to it)"
        )
    device = jax.devices()[0]
    if backend == "pallas" and device.platform == "gpu" and not has_sm90_gpu():
        # Elsewhere (CPU) the kernels run under the Mosaic GPU interpreter; a real non-Hopper GPU cannot run them.
        raise NotImplementedError(
            f"{op}: the Mosaic GPU kernels need an sm90 GPU (H100/H200), found {device.device_kind}; use backend='xla'"
        )
    return backend
