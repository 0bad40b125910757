"""Every configuration of the sm90 quantizer kernel lowers for CUDA from a CPU host, at activation sizes of the
benchmark models (rows M = 32768 routed tokens; columns the models' d_model and d_ff: K = 2880 is no multiple of
128, and 768 FP8 columns take the 128-byte swizzle, 2880 the 64-byte one), and the square-block weight quantizer at
the models' expert weights, and the wgrad's row-block quantizer at routed-row sizes. Shared memory must fit at every
size. On an sm90 GPU the FP8 grouped matmul quantizes through these kernels, its weights with no XLA transpose."""

from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

import moe_jax
from moe_jax._core import backend as dispatch
from moe_jax.ops.quant import config as quant_config
from moe_jax.ops.quant.api import (
    quantize_blockwise,
    quantize_blockwise_with_transpose,
    quantize_row_blocks_transposed,
    quantize_square_blocks,
)

MOSAIC_CALL = "mosaic_gpu_v2"
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def _lowered(fn, shape, dtype) -> str:
    return _lowered_args(fn, jax.ShapeDtypeStruct(shape, dtype))


def _lowered_args(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=H200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "shape, dtype, block, pow2_scales",
    [
        ((32768, 7168), jnp.bfloat16, 128, False),
        ((32768, 2880), jnp.bfloat16, 128, False),
        ((32768, 768), jnp.bfloat16, 32, True),
        ((4100, 2048), jnp.float32, 128, True),  # M off a multiple of 8: one-row buffer tiles
    ],
)
def test_quantizer_lowers(shape, dtype, block, pow2_scales):
    def quantize(x):
        return quantize_blockwise(x, (1, block), pow2_scales=pow2_scales, backend="pallas")

    assert _lowered(quantize, shape, dtype).count(MOSAIC_CALL) == 1


@pytest.mark.parametrize(
    "shape, dtype, block",
    [((32768, 7168), jnp.bfloat16, 128), ((32768, 2880), jnp.float16, 32), ((4096, 2048), jnp.float32, 128)],
)
def test_quantizer_with_transposed_copy_lowers(shape, dtype, block):
    def quantize(x):
        return quantize_blockwise_with_transpose(x, block, dtype=jnp.float8_e5m2, backend="pallas")

    assert _lowered(quantize, shape, dtype).count(MOSAIC_CALL) == 1


@pytest.mark.parametrize(
    "shape, dtype, copies",
    [
        ((128, 2048, 1536), jnp.bfloat16, ("transposed", "as_is")),  # Qwen3-30B-A3B's w_gate_up, both layouts
        ((128, 768, 2048), jnp.bfloat16, ("transposed",)),  # its w_down, the forward's layout alone
        ((32, 7168, 4096), jnp.float32, ("as_is", "transposed")),  # DeepSeek-V3's, f32: a 2-stage ring
        ((32, 7168, 4096), jnp.float32, ("as_is",)),  # one f32 copy: a 3-stage ring, shared memory nearly full
        ((4, 2880, 320), jnp.float16, ("as_is",)),  # 64-byte swizzle on both FP8 copies
    ],
)
def test_square_block_quantizer_lowers(shape, dtype, copies):
    def quantize(w):
        return quantize_square_blocks(w, copies=copies, backend="pallas")

    assert _lowered(quantize, shape, dtype).count(MOSAIC_CALL) == 1


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((131072, 2048), jnp.bfloat16),
        ((131072, 768), jnp.bfloat16),
        ((32768, 2880), jnp.float16),
        ((4100, 64), jnp.float16),
    ],
)
@pytest.mark.parametrize("with_rows", [False, True])
def test_row_block_quantizer_lowers(shape, dtype, with_rows):
    """Also with the 1 x 128 copy of the rows (``copy_rows``): a second FP8 ring of one-row tiles beside x^T's."""
    num_blocks = shape[0] // 128 + 128  # the wgrad's bound with 128 groups

    def quantize(x, first_rows, row_counts):
        copy_rows = row_counts if with_rows else None
        return quantize_row_blocks_transposed(x, first_rows, row_counts, copy_rows=copy_rows, backend="pallas")

    table = jax.ShapeDtypeStruct((num_blocks,), jnp.int32)
    assert _lowered_args(quantize, jax.ShapeDtypeStruct(shape, dtype), table, table).count(MOSAIC_CALL) == 1


@pytest.mark.parametrize("backward", [False, True])
def test_fp8_grouped_matmul_quantizes_through_the_kernels_on_sm90(backward):
    """On an sm90 GPU the FP8 grouped matmul quantizes its weights [G, K, N] with the square-block kernel (the
    forward's [G, N, K] copy, and with the backward also the dgrad's [G, K, N]) and the wgrad's operands with the
    row-block kernel: no XLA transpose touches the weights."""
    args = (
        jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )

    def loss(lhs, rhs, group_sizes):
        out = moe_jax.grouped_matmul(lhs, rhs, group_sizes, quantization="fp8_block", backend="pallas")
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.value_and_grad(loss, argnums=(0, 1)) if backward else loss
    with mock.patch.object(dispatch, "has_sm90_gpu", return_value=True):
        text = _lowered_args(fn, *args)
    # Forward: the weights' quantizer, x's, the FP8 GEMM; backward: also dy's quantizer, the dgrad, the two wgrad
    # operands' quantizers and the wgrad.
    assert text.count(MOSAIC_CALL) == (8 if backward else 3)
    assert "moe_quantize_square_blocks" in text
    assert ("moe_quantize_row_blocks_transposed" in text) == backward
    transposes = [line for line in text.splitlines() if "stablehlo.transpose" in line]
    assert not any("4x256x512" in line or "4x512x256" in line for line in transposes)


def test_equal_quantizer_launches_in_one_program_share_one_kernel():
    """Launches on equal operand types and options lower once (``sm90.launch_per_signature``): in one program, two
    arrays of one shape give one Mosaic GPU kernel, a third shape its own; each of the three quantizer kernels."""
    rows, cols = (4096, 2048), (4096, 1024)
    arrays = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in (rows, rows, cols)]
    weights = [jax.ShapeDtypeStruct((2, 1024, 512), jnp.bfloat16)] * 2
    table = jax.ShapeDtypeStruct((40,), jnp.int32)

    def quantize_all(x, y, z, w, v, first_rows, row_counts):
        blocks = [quantize_blockwise(a, (1, 128), backend="pallas").values for a in (x, y, z)]
        row_blocks = [quantize_row_blocks_transposed(a, first_rows, row_counts, backend="pallas") for a in (x, y, z)]
        squares = [quantize_square_blocks(a, copies=("as_is",), backend="pallas") for a in (w, v)]
        return blocks, row_blocks, squares

    text = _lowered_args(quantize_all, *arrays, *weights, table, table)
    assert text.count(MOSAIC_CALL) == 2 + 2 + 1


@pytest.mark.smoke
def test_quantizer_rings_take_the_measured_depths_and_fit():
    """heuristic_config keeps x's layout passes on the shallow ring, gives the others the deepest that fits, never
    more than shared memory holds, and names a pass it does not know."""
    for in_dtype in quant_config.INPUT_DTYPES:
        for pass_name in quant_config.PASSES:
            for with_transpose in (False, True):
                ring = quant_config.heuristic_config(in_dtype, with_transpose, pass_name)
                assert ring.smem_bytes(in_dtype, with_transpose) <= quant_config.SMEM_BYTES
    shallow, deepest = quant_config.SHALLOW_STAGES, quant_config.MAX_STAGES
    assert quant_config.heuristic_config(jnp.bfloat16, False, "1 x 128").stages == shallow
    assert quant_config.heuristic_config(jnp.bfloat16, True, "square").stages == shallow
    assert quant_config.heuristic_config(jnp.bfloat16, True, "1 x 128").stages == deepest
    assert quant_config.heuristic_config(jnp.bfloat16, False, "1 x 32").stages == deepest
    assert quant_config.heuristic_config(jnp.bfloat16, False, "row blocks").stages == deepest
    assert quant_config.heuristic_config(jnp.float32, True, "1 x 128").stages == 2  # 3 f32 tiles do not fit beside x^T
    bands = {name: quant_config.heuristic_config(jnp.bfloat16, False, name).block_band for name in quant_config.PASSES}
    assert bands == {"1 x 128": 1, "1 x 32": 1, "square": 1, "row blocks": 16, "gathered row blocks": 4}
    with pytest.raises(ValueError, match="block_band must be a power of two, got 3"):
        quant_config.Config(2, block_band=3)
    with pytest.raises(ValueError, match="pass_name"):
        quant_config.heuristic_config(jnp.bfloat16, False, "1 x 64")
