"""Compiling a program's Mosaic GPU kernels in parallel: ``compile_lowered(jax.jit(f).lower(...))``.

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

jax 0.11.2 has no public way to compile a StableHLO module, so the pool calls the device's PJRT client with
``jax._src`` helpers; the kernels' programs are built with ``jax.extend.mlir``.
"""

import concurrent.futures
import os
import warnings

import jax
from jax._src import compiler
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import xla_client
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


def kernel_programs(lowered: jax.stages.Lowered) -> list[bytes]:
    """One program (MLIR bytecode) per distinct Mosaic GPU kernel of ``lowered``, in the order they first appear."""
    programs = {}
    for call in _custom_calls(lowered.compiler_ir("stablehlo").operation, []):
        kernel_hash = _kernel_hash(call)
        if kernel_hash is not None and kernel_hash not in programs:
            programs[kernel_hash] = jax_mlir.module_to_bytecode(_kernel_program(call))
    return list(programs.values())


def _compile_kernel(program: bytes, device: jax.Device) -> None:
    """Compiles a one-kernel program on ``device``'s client, which leaves the kernel in jaxlib's kernel cache."""
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    device.client.compile_and_load(program, xla_client.DeviceList((device,)), options)


def compile_lowered(lowered: jax.stages.Lowered, *, max_workers: int | None = None) -> jax.stages.Compiled:
    """``lowered.compile()``, with its distinct Mosaic GPU kernels compiled meanwhile on ``max_workers`` threads.

    Args:
      lowered: a lowered program (``jax.jit(f).trace(*args).lower()``), for the devices of this process.
      max_workers: threads for the kernels (default: one per kernel, at most one per CPU core).

    Returns:
      the compiled program, the same executable ``lowered.compile()`` returns (the persistent compilation cache
      answers it as it would). A kernel whose own compilation fails is compiled by the program's, which reports any
      real error; the failure is warned about.
    """
    if max_workers is not None and max_workers < 1:
        raise ValueError(f"max_workers must be at least 1, got {max_workers}")
    programs = kernel_programs(lowered)
    if not programs:
        return lowered.compile()
    workers = max_workers or min(len(programs), os.cpu_count() or 1)
    device = jax.local_devices()[0]
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mosaic-gpu-kernel")
    futures = [pool.submit(_compile_kernel, program, device) for program in programs]
    try:
        compiled = lowered.compile()
    finally:
        # Kernels not started yet are not needed any more; those running finish on their own threads.
        pool.shutdown(wait=False, cancel_futures=True)
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is not None:
            warnings.warn(
                f"a Mosaic GPU kernel did not compile on its own ({future.exception()!r}); the program compiled it",
                RuntimeWarning,
                stacklevel=2,
            )
            break
    return compiled
