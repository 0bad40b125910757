"""moe_jax.compilation: the Mosaic GPU kernels lifted out of a program lowered for CUDA (on this CPU host) are one
program per distinct kernel, each the kernel's custom call unchanged; inside compiling_kernels_while_lowering the same
programs start compiling while the program is lowered, each once; without kernels, compile_lowered is
lowered.compile()."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax.extend.mlir import ir

import moe_jax
from moe_jax import compilation
from moe_jax.compilation import MOSAIC_GPU_TARGET, compile_lowered, named_kernel_programs
from tests.helpers import on_abstract_h200

T, D, F, E, K = 256, 128, 128, 4, 2
# The kernel hash as a custom call's backend config prints it (escaped bytes).
_KERNEL_HASH = re.compile(r'kernel_hash = "((?:[^"\\]|\\.)*)"')


def _layer_loss(x, router_kernel, w_gate_up, w_down, backend="pallas"):
    y, aux = moe_jax.moe_ffn(x, router_kernel, moe_jax.pack_gate_up(w_gate_up), w_down, top_k=K, backend=backend)
    return y.astype(jnp.float32).sum() + aux.load_balancing_loss


def _abstract_layer_args():
    shapes = [((T, D), jnp.bfloat16), ((D, E), jnp.float32), ((E, D, 2 * F), jnp.bfloat16), ((E, F, D), jnp.bfloat16)]
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def _lowered_for_cuda(fn, *args):
    with on_abstract_h200():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _parse(program: bytes) -> str:
    with jax_mlir.make_ir_context():
        return str(ir.Module.parse(program))


def test_each_distinct_kernel_becomes_one_program_holding_its_custom_call_unchanged():
    lowered = _lowered_for_cuda(jax.value_and_grad(_layer_loss, argnums=(0, 1, 2, 3)), *_abstract_layer_args())
    text = lowered.as_text()
    hashes = list(dict.fromkeys(_KERNEL_HASH.findall(text)))  # distinct, in program order
    assert len(hashes) >= 8  # the layer's gating, permutes, GEMMs and their backward
    named = named_kernel_programs(lowered)
    programs = [_parse(program) for _, program in named]
    assert [_KERNEL_HASH.findall(program) for program in programs] == [[h] for h in hashes]
    for program in programs:
        assert program.count("stablehlo.custom_call") == 1 and f"@{MOSAIC_GPU_TARGET}" in program
        call = next(line for line in program.splitlines() if "stablehlo.custom_call" in line)
        # The call is the original's, attributes and types included: only its operand names differ.
        kernel_hash = _KERNEL_HASH.search(call)[1]
        original = next(line for line in text.splitlines() if f'kernel_hash = "{kernel_hash}"' in line)
        assert re.sub(r"%[\w#]+", "%", call.split("=", 1)[1]) == re.sub(r"%[\w#]+", "%", original.split("=", 1)[1])
        assert "func.func public @main" in program
    # Each program goes with its kernel's name (the one its pallas_call gives).
    names = {name for name, _ in named}
    assert {"moe_gating", "moe_gmm_gather_glu", "moe_gmm_row_scale", "moe_gmm_wgrad"} <= names and "?" not in names


def test_without_kernels_it_compiles_the_program_as_is():
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in _abstract_layer_args()]
    lowered = jax.jit(lambda *a: _layer_loss(*a, backend="xla")).trace(*args).lower()
    assert named_kernel_programs(lowered) == []
    assert compile_lowered(lowered)(*args) == lowered.compile()(*args)


def test_max_workers_must_be_positive():
    lowered = jax.jit(jnp.sin).trace(jnp.ones(3)).lower()
    with pytest.raises(ValueError, match="max_workers"):
        compile_lowered(lowered, max_workers=0)


def _recorded_kernel_compiles(monkeypatch) -> list[bytes]:
    """Replaces the one-kernel compilation with a recorder of the programs it is given (this host has no GPU)."""
    programs = []
    monkeypatch.setattr(compilation, "compile_kernel_program", lambda program, device: programs.append(program))
    return programs


def test_kernels_start_compiling_while_the_program_is_lowered(monkeypatch):
    programs = _recorded_kernel_compiles(monkeypatch)
    original_rule = compilation.mosaic_gpu_core._mosaic_gpu_lowering_rule
    with moe_jax.compiling_kernels_while_lowering(max_workers=1) as pool:
        lowered = _lowered_for_cuda(jax.value_and_grad(_layer_loss, argnums=(0, 1, 2, 3)), *_abstract_layer_args())
        for future in pool.futures:
            future.result()
        submitted_while_lowering = list(programs)
        for call in compilation._custom_calls(lowered.compiler_ir("stablehlo").operation, []):
            assert not pool.submit(call)  # each kernel once
    assert compilation.mosaic_gpu_core._mosaic_gpu_lowering_rule is original_rule
    expected = [_KERNEL_HASH.findall(_parse(program)) for _, program in named_kernel_programs(lowered)]
    assert len(expected) >= 8
    assert [_KERNEL_HASH.findall(_parse(program)) for program in submitted_while_lowering] == expected


def test_lowering_outside_the_context_submits_nothing(monkeypatch):
    programs = _recorded_kernel_compiles(monkeypatch)
    with moe_jax.compiling_kernels_while_lowering() as pool:
        pass
    _lowered_for_cuda(jax.value_and_grad(_layer_loss, argnums=(0, 1, 2, 3)), *_abstract_layer_args())
    assert programs == [] and pool.futures == []


def test_a_kernel_the_pool_cannot_take_leaves_the_lowering_whole(monkeypatch):
    def refuse(pool, call):
        raise RuntimeError("no room")

    monkeypatch.setattr(compilation.KernelPool, "submit", refuse)
    with moe_jax.compiling_kernels_while_lowering(), pytest.warns(RuntimeWarning, match="no room"):
        lowered = _lowered_for_cuda(jax.value_and_grad(_layer_loss, argnums=(0, 1, 2, 3)), *_abstract_layer_args())
    assert len(named_kernel_programs(lowered)) >= 8
