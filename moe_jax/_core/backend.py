"""Backend selection: one decision point per op, an ordered table of implementations.

Each op lists its implementations in order of preference (kernels first, the pure-JAX reference last). Every entry
says whether it can run a call (``unsupported`` returns the reason it cannot, or None) and, for ``backend="auto"``,
whether it should (``preferred``: the kernel measured faster there). ``select`` turns the user's backend string into
one entry:

  "auto"    the first entry that can run the call and prefers it; kernels only on an sm90 GPU (H100/H200);
  "pallas"  a kernel entry that can run the call (the first that also prefers it, else the first that can), or
            NotImplementedError saying why none can; on a CPU host the kernels run under the Mosaic GPU interpreter;
  "xla"     the reference.

An op may have several kernel entries ("pallas_gather", "pallas_sorted"): naming one selects exactly it, which is how
tests and benchmarks pin a variant. Layers resolve their backend once per call and pass the chosen names down.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from moe_jax._core.checks import check_choice

BACKENDS = ("auto", "xla", "pallas")


@functools.cache
def has_sm90_gpu() -> bool:
    """True when the default device is an NVIDIA GPU of compute capability 9.0 (H100/H200)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _supported(call: Any) -> None:
    return None


def _always(call: Any) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run an op.

    Attributes:
      name: "xla", "pallas", or "pallas_<variant>" where an op has several kernels.
      unsupported: ``call -> str | None``, why this implementation cannot run ``call`` (None: it can).
      preferred: ``call -> bool``, whether "auto" takes it where it can run (False where the next entry is faster).
    """

    name: str
    unsupported: Callable[[Any], str | None] = _supported
    preferred: Callable[[Any], bool] = _always

    @property
    def is_kernel(self) -> bool:
        return self.name.startswith("pallas")


XLA = Implementation("xla")


def _kernel_hardware_problem(op: str) -> str | None:
    """Why kernels cannot run on this host: a GPU that is not sm90 (a CPU host runs them under the interpreter)."""
    device = jax.devices()[0]
    if device.platform == "gpu" and not has_sm90_gpu():
        return f"{op}: the Mosaic GPU kernels need an sm90 GPU (H100/H200), found {device.device_kind}"
    return None


def select(op: str, backend: str, implementations: Sequence[Implementation], call: Any) -> Implementation:
    """The implementation of ``op`` that ``backend`` selects for ``call`` (see the module docstring).

    Raises:
      ValueError: ``backend`` is neither a backend nor the name of one of the implementations.
      NotImplementedError: ``backend`` asks for a kernel that cannot run ``call`` (the message says why).
    """
    names = tuple(impl.name for impl in implementations)
    check_choice("backend", backend, (*BACKENDS, *(n for n in names if n not in BACKENDS)))
    if backend == "auto":
        return next(
            impl
            for impl in implementations
            if (not impl.is_kernel or has_sm90_gpu()) and impl.unsupported(call) is None and impl.preferred(call)
        )
    if backend == "xla":
        return next(impl for impl in implementations if impl.name == "xla")
    candidates = [impl for impl in implementations if impl.is_kernel and backend in ("pallas", impl.name)]
    reasons = [reason for impl in candidates if (reason := impl.unsupported(call)) is not None]
    if len(reasons) == len(candidates):
        # Every distinct reason, once: the kernels may each refuse for their own.
        reason = "; ".join(dict.fromkeys(reasons)) if reasons else "no Pallas Mosaic GPU kernel exists"
        raise NotImplementedError(f"{op}: {reason}; use backend='xla' (or 'auto', which falls back to it)")
    if hardware := _kernel_hardware_problem(op):
        raise NotImplementedError(f"{hardware}; use backend='xla'")
    runnable = [impl for impl in candidates if impl.unsupported(call) is None]
    return next((impl for impl in runnable if impl.preferred(call)), runnable[0])
