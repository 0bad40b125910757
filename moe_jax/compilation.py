"""Compiling a program's Mosaic GPU kernels in parallel: ``compile_lowered(jax.jit(f).lower(...))``, or as they are
lowered: ``compiling_kernels_while_lowering()``.

XLA compiles the Mosaic GPU kernels of a program (its ``mosaic_gpu_v2`` custom calls) one after another, while it
emits the program's thunks: each kernel's module goes MLIR -> LLVM -> PTX -> cubin on one thread, about a second for
a pipelined GEMM, and one MoE layer's forward + backward holds about a dozen distinct kernels. jaxlib keeps every
compiled kernel in a process-wide cache keyed by the SHA-256 of the kernel's module (the ``kernel_hash`` of the custom
call's backend config), so a kernel that any program of the process compiled is not compiled again. (Each lowering
of a kernel stamps a per-process counter into its module, the basename Mosaic GPU would dump it under, so two
lowerings of one kernel are two kernels to that cache.)

``compile_lowered`` lifts each distinct kernel out of the lowered program into a program of its own (one custom call
between the entry's arguments and results, with the same attributes, so the same hash), compiles those on a thread
pool (XLA's compilation releases the GIL) while the whole program compiles, and so the whole program's thunk
emission finds the kernels compiled. Two compilations of one kernel at the same time are harmless (the cache keeps
the first), so nothing waits on the pool: a kernel the pool has not reached yet is compiled by the program
itself. Where nothing is a Mosaic GPU kernel (the XLA backend, kernels under the CPU interpreter), it is
``lowered.compile()``.

``compiling_kernels_while_lowering`` starts each kernel's compilation earlier still, the moment the kernel is lowered:
inside it, Mosaic GPU's custom-call lowering rule (a module attribute of ``jax.experimental.mosaic.gpu.core``, which
Pallas looks up on every call) is wrapped to hand each new custom call to the thread's ``KernelPool``.

jax 0.11.2 has no public way to compile a StableHLO module, so the pool calls the device's PJRT client with
``jax._src`` helpers; the kernels' programs are built with ``jax.extend.mlir``.
"""

import concurrent.futures
import contextlib
import os
import re
import threading
import warnings
from collections.abc import Iterator

import jax
from jax._src import compiler
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import xla_client
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func

MOSAIC_GPU_TARGET = "mosaic_gpu_v2"


def _custom_calls(operation, found: list) -> list:
    """Appends every ``stablehlo.custom_call`` nested anywhere in ``operation`` to ``found``, in program order."""
    for region in operation.regions:
        for block in region.blocks:
            for child in block.operations:
                child = child.operation
                if child.name == "stablehlo.custom_call":
                    found.append(child)
                _custom_calls(child, found)
    return found


def _kernel_hash(call) -> bytes | None:
    """The kernel hash of a Mosaic GPU custom call, None for any other custom call."""
    if ir.StringAttr(call.attributes["call_target_name"]).value != MOSAIC_GPU_TARGET:
        return None
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    return ir.StringAttr(config["kernel_hash"]).value_bytes


def _kernel_program(call) -> ir.Module:
    """A module whose public ``main`` is ``call`` alone: its operands are the arguments, its results the results."""
    operand_types = [operand.type for operand in call.operands]
    result_types = [result.type for result in call.results]
    attributes = {call.attributes[i].name: call.attributes[i].attr for i in range(len(call.attributes))}
    with call.context, ir.Location.unknown():
        module = ir.Module.create()
        module.operation.attributes["sym_name"] = ir.StringAttr.get("mosaic_gpu_kernel")
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get(operand_types, result_types))
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            entry = main.add_entry_block()
            with ir.InsertionPoint(entry):
                kernel = ir.Operation.create(
                    "stablehlo.custom_call", results=result_types, operands=list(entry.arguments), attributes=attributes
                )
                func.ReturnOp(kernel.results)
    return module


# A Mosaic GPU custom call's location names its kernel: ".../moe_gmm_wgrad/mpmd_map".
_KERNEL_NAME = re.compile(r"/(\w+)/mpmd_map")


def named_kernel_programs(lowered: jax.stages.Lowered) -> list[tuple[str, bytes]]:
    """(the kernel's name, "?" where its call's location has none; one program (MLIR bytecode) of it alone) per
    distinct Mosaic GPU kernel of ``lowered``, in the order they first appear."""
    programs = {}
    for call in _custom_calls(lowered.compiler_ir("stablehlo").operation, []):
        kernel_hash = _kernel_hash(call)
        if kernel_hash is not None and kernel_hash not in programs:
            name = _KERNEL_NAME.search(str(call.location))
            program = jax_mlir.module_to_bytecode(_kernel_program(call))
            programs[kernel_hash] = (name.group(1) if name else "?", program)
    return list(programs.values())


def compile_kernel_program(program: bytes, device: jax.Device) -> None:
    """Compiles a one-kernel program on ``device``'s client, which leaves the kernel in jaxlib's kernel cache."""
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    device.client.compile_and_load(program, xla_client.DeviceList((device,)), options)


class KernelPool:
    """Compiles one program per distinct Mosaic GPU kernel on a thread pool, each kernel once (by its hash).

    Kernels arrive from a lowered program (``compile``) or, inside ``compiling_kernels_while_lowering``, one by one as
    they are lowered; each is compiled as a one-kernel program, which leaves it in jaxlib's kernel cache.
    """

    def __init__(self, max_workers: int | None = None):
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max_workers = max_workers or os.cpu_count() or 1
        self._executor = None
        self._closed = False
        self._hashes: set[bytes] = set()
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, call) -> bool:
        """Starts compiling ``call``'s kernel unless it is no Mosaic GPU kernel or already started; says whether
        it started."""
        kernel_hash = _kernel_hash(call)
        if self._closed or kernel_hash is None or kernel_hash in self._hashes:
            return False
        self._hashes.add(kernel_hash)
        program = jax_mlir.module_to_bytecode(_kernel_program(call))
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self._max_workers, thread_name_prefix="mosaic-gpu-kernel"
            )
        self.futures.append(self._executor.submit(compile_kernel_program, program, jax.local_devices()[0]))
        return True

    def compile(self, lowered: jax.stages.Lowered, compiler_options: dict | None = None) -> jax.stages.Compiled:
        """``lowered.compile(compiler_options)``, with the kernels of ``lowered`` not started yet started first."""
        for call in _custom_calls(lowered.compiler_ir("stablehlo").operation, []):
            self.submit(call)
        try:
            return lowered.compile(compiler_options)
        finally:
            self.close()

    def close(self) -> None:
        """Drops the kernels not started yet (the program compiles what it needs itself); those running finish on
        their own threads. Warns once if a kernel had failed to compile on its own by then."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for future in self.futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                warnings.warn(
                    f"a Mosaic GPU kernel did not compile on its own ({future.exception()!r}); the program compiled it",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break


def compile_lowered(lowered: jax.stages.Lowered, *, max_workers: int | None = None) -> jax.stages.Compiled:
    """``lowered.compile()``, with its distinct Mosaic GPU kernels compiled meanwhile on ``max_workers`` threads.

    Args:
      lowered: a lowered program (``jax.jit(f).trace(*args).lower()``), for the devices of this process.
      max_workers: threads for the kernels (default: one per CPU core).

    Returns:
      the compiled program, the same executable ``lowered.compile()`` returns (the persistent compilation cache
      answers it as it would). A kernel whose own compilation fails is compiled by the program's, which reports any
      real error; a failure known when the program is compiled is warned about.
    """
    return KernelPool(max_workers).compile(lowered)


class _LoweringHook:
    """Wraps Mosaic GPU's custom-call lowering rule while any thread is inside ``compiling_kernels_while_lowering``,
    so that each kernel lowered by such a thread goes to that thread's pool as soon as its custom call exists."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._rule = None
        self.pools = threading.local()

    def __enter__(self):
        with self._lock:
            if self._users == 0:
                self._rule = mosaic_gpu_core._mosaic_gpu_lowering_rule
                mosaic_gpu_core._mosaic_gpu_lowering_rule = self._lower_and_submit
            self._users += 1

    def __exit__(self, *exc_info):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                mosaic_gpu_core._mosaic_gpu_lowering_rule = self._rule

    def _lower_and_submit(self, ctx, *args, **kwargs):
        results = self._rule(ctx, *args, **kwargs)
        pool = getattr(self.pools, "current", None)
        if pool is not None and results:
            owner = results[0].owner
            try:
                pool.submit(getattr(owner, "operation", owner))  # the custom call
            except Exception as error:  # the program's own compilation compiles the kernel
                warnings.warn(
                    f"a Mosaic GPU kernel could not be handed to the pool ({error!r})", RuntimeWarning, stacklevel=2
                )
        return results


_HOOK = _LoweringHook()


@contextlib.contextmanager
def compiling_kernels_while_lowering(*, max_workers: int | None = None) -> Iterator[KernelPool]:
    """A ``KernelPool`` that starts compiling each Mosaic GPU kernel this thread lowers inside the context as soon as
    it is lowered, while Python lowers the rest of the program::

        with moe_jax.compiling_kernels_while_lowering() as kernels:
            compiled = kernels.compile(jax.jit(step).trace(*args).lower())

    ``compile`` then compiles the program while the kernels still running finish. Lowering is Python and a
    kernel's compilation is XLA's (seconds, the GIL released; docs/kernels/grouped_matmul.md, "Lowering and compile
    time"), so the kernels compile while Python lowers the rest of the program. Other threads' lowerings are left
    alone. Leaving the context drops the kernels not started yet.
    """
    pool = KernelPool(max_workers)
    outer = getattr(_HOOK.pools, "current", None)
    _HOOK.pools.current = pool
    try:
        with _HOOK:
            yield pool
    finally:
        _HOOK.pools.current = outer
        pool.close()
