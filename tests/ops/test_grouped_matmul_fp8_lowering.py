"""The FP8 kernel lowers for CUDA from a CPU host at the gate_up shapes of qwen3-30b and dsv3-ep8, with every
epilogue and weight layout, and at gpt-oss-120b's (K, N = 2880: partial 128-wide blocks), and its config takes exactly
the pipeline stages that fit in shared memory.

The abstract H200 makes ``hardware.interpret_params()`` return None (compile, don't interpret); lowering runs Mosaic
GPU's whole pipeline, shared-memory check included, and stops before the CUDA compiler. A forward and backward hold
three Mosaic GPU kernels: the forward with its epilogue, the plain dgrad and the FP8 wgrad.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

import moe_jax
from benchmarks import shapes
from moe_jax._core import backend as dispatch
from moe_jax.ops.grouped_matmul import config, launch, sm90_fp8_wgrad
from moe_jax.ops.grouped_matmul import sm90_fresh_product as fresh
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, gate_up_block
from tests.helpers import cuda_lowering, pairwise_by_default

pytestmark = pytest.mark.smoke  # lowering and config checks: no numbers (tests/README.md)

MOSAIC_CALL = "mosaic_gpu_v2"
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
NAMED = ["qwen3-30b/gate_up", "dsv3-ep8/gate_up"]


def _lowered(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=H200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _lowers(fn, *args) -> bool:
    """Whether ``fn`` lowers for the H200; any failure but a shared-memory overflow fails the test."""
    try:
        _lowered(fn, *args)
        return True
    except ValueError as error:
        assert "exceeds available shared memory" in str(error)
        return False


def _assert_the_most_stages_that_fit(chosen, kernel, args, fits) -> None:
    """``kernel(*args, cfg=...)`` lowers at ``chosen``'s stages and not at one more, and ``fits(cfg)`` says the same."""
    for stages, expected in ((chosen.num_stages, True), (chosen.num_stages + 1, False)):
        cfg = dataclasses.replace(chosen, num_stages=stages)
        assert _lowers(functools.partial(kernel, cfg=cfg), *args) == expected == fits(cfg), stages


def _block_scaled(shape, block_shape) -> moe_jax.BlockScaled:
    """An abstract e4m3 BlockScaled of ``shape`` in ``block_shape`` blocks, with its f32 scales."""
    scales = tuple(-(-size // block) for size, block in zip(shape, block_shape, strict=True))
    return moe_jax.BlockScaled(
        jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct(scales, jnp.float32), block_shape
    )


def _fwd_bwd_text(name, *, activation=None, row_scale=False, transpose_rhs=True, out_dtype=jnp.bfloat16) -> str:
    s = shapes.GMM_SHAPES[name]
    lhs = jax.ShapeDtypeStruct((s.m, s.k), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((s.g, s.n, s.k) if transpose_rhs else (s.g, s.k, s.n), jnp.bfloat16)
    if activation is not None:
        weights = PackedGateUp(weights, gate_up_block(s.n // 2), transposed=transpose_rhs)
    scale = jax.ShapeDtypeStruct((s.m,), jnp.float32) if row_scale else None

    def loss(lhs, rhs, group_sizes, row_scale):
        out = moe_jax.grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            activation=activation,
            row_scale=row_scale,
            preferred_element_type=out_dtype,
            transpose_rhs=transpose_rhs,
            quantization="fp8_block",
            backend="pallas",
        )
        return jnp.sum(out.astype(jnp.float32))

    group_sizes = jax.ShapeDtypeStruct((s.g,), jnp.int32)
    return _lowered(jax.value_and_grad(loss, argnums=(0, 1)), lhs, weights, group_sizes, scale)


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize(
    "options, kernel",
    [
        (dict(), "moe_gmm_fp8"),
        (dict(activation="swiglu"), "moe_gmm_fp8_glu"),
        (dict(row_scale=True, out_dtype=jnp.float32), "moe_gmm_fp8_row_scale"),
        (dict(transpose_rhs=False), "moe_gmm_fp8"),  # [G, K, N] weights: transposed in XLA first
    ],
)
def test_named_shapes_lower_to_the_fp8_forward_dgrad_and_wgrad_kernels(name, options, kernel):
    text = _fwd_bwd_text(name, **options)
    assert text.count(MOSAIC_CALL) == 3
    # The kernels' names appear with suffixes (a counter, "_mosaic_gpu") too.
    names = {re.sub(r"(_\d+|_mosaic_gpu)$", "", found) for found in re.findall(r"moe_gmm\w*", text)}
    assert names == {kernel, "moe_gmm_fp8", "moe_gmm_wgrad_fp8"}


@pytest.mark.parametrize("name", ["gpt-oss-120b/gate_up", "gpt-oss-120b/down"])
def test_contractions_with_a_partial_block_lower_to_the_fp8_kernels(name):
    """gpt-oss's K = 2880 (gate_up and down) and down's N = 2880, the dgrad's contraction, end in a 64-wide block: the
    forward, the dgrad and the wgrad still run the FP8 kernels."""
    text = _fwd_bwd_text(name)
    assert text.count(MOSAIC_CALL) == 3
    names = {re.sub(r"(_\d+|_mosaic_gpu)$", "", found) for found in re.findall(r"moe_gmm\w*", text)}
    assert names == {"moe_gmm_fp8", "moe_gmm_wgrad_fp8"}


@pytest.mark.parametrize(
    "block_n, consumers, row_scale, out_dtype",
    pairwise_by_default([(128, None), (config.FP8_WIDE_BLOCK_N, 2)], [False, True], [jnp.bfloat16, jnp.float32]),
)
def test_config_takes_the_stages_that_fit(out_dtype, row_scale, block_n, consumers):
    """Config.smem_bytes counts the scales' buffers as laid out: fp8_config's stages lower at dsv3-ep8 gate_up (the
    longest K: the most weight scales), one more stage does not, and Config.fits says the same; 192-column tiles
    hold two weight blocks' scales a consumer."""
    s = shapes.GMM_SHAPES["dsv3-ep8/gate_up"]
    itemsize = jnp.dtype(out_dtype).itemsize
    chosen = config.fp8_config(
        m=s.m, k=s.k, n=s.n, g=s.g, out_itemsize=itemsize, row_scale=row_scale, consumers=consumers, block_n=block_n
    )
    assert chosen.block_n == block_n
    buffers = dict(row_vectors=int(row_scale), scale_k_blocks=config.fp8_scale_k_blocks(s.k))
    # Every consumer's row of weight scales starts on 128 bytes (a TMA destination): 32 f32, the least such count.
    assert buffers["scale_k_blocks"] % 32 == 0 and 0 <= buffers["scale_k_blocks"] - s.k // 128 < 32
    x, w = _block_scaled((s.m, s.k), (1, 128)), _block_scaled((s.g, s.n, s.k), (1, 128, 128))
    scale = jax.ShapeDtypeStruct((s.m,), jnp.float32) if row_scale else None
    group_sizes = jax.ShapeDtypeStruct((s.g,), jnp.int32)

    def forward(x, w, group_sizes, row_scale, cfg):
        return launch.run_forward_kernel(
            x.values,
            w.values,
            group_sizes,
            row_scale,
            None,
            out_dtype,
            True,
            keep=False,
            config=cfg,
            x_scales=x.scales.T,
            # The kernel's layout: blocks padded as run_fp8_forward_kernel pads them.
            w_scales=jnp.pad(w.scales, [(0, 0), (0, 1), (0, buffers["scale_k_blocks"] - s.k // 128)]),
        )

    fits = functools.partial(config.Config.fits, in_itemsize=1, out_itemsize=itemsize, **buffers)
    _assert_the_most_stages_that_fit(chosen, forward, (x, w, group_sizes, scale), fits)


@pytest.mark.parametrize("consumers", [3, 2])
def test_glu_forward_keeping_fp8_blocks_takes_the_stages_that_fit(consumers):
    """fp8_config(glu_forward=True, keep_blocks=True)'s stages lower for the GLU forward that keeps its
    pre-activation in FP8 blocks, at dsv3-ep8 gate_up (the most weight scales), one more stage does not, and
    Config.fits says the same, the block's buffer and its scales counted as laid out."""
    s = shapes.GMM_SHAPES["dsv3-ep8/gate_up"]
    chosen = config.fp8_config(m=s.m, k=s.k, n=s.n, g=s.g, glu_forward=True, consumers=consumers, keep_blocks=True)
    buffers = dict(
        row_vectors=config.row_vector_count(False, False, True),
        scale_k_blocks=config.fp8_scale_k_blocks(s.k),
        kept_fp8=True,
    )
    x, w = _block_scaled((s.m, s.k), (1, 128)), _block_scaled((s.g, s.n, s.k), (1, 128, 128))
    group_sizes = jax.ShapeDtypeStruct((s.g,), jnp.int32)

    def forward(x, w, group_sizes, cfg):
        options = dict(keep=True, keep_blocks=True, config=cfg)
        return launch.run_fp8_forward_kernel(x, w, group_sizes, None, "swiglu", jnp.bfloat16, **options)

    fits = functools.partial(config.Config.fits, in_itemsize=1, out_itemsize=2, **buffers)
    _assert_the_most_stages_that_fit(chosen, forward, (x, w, group_sizes), fits)


@pytest.mark.parametrize("scaled_gate_up", [False, True])
def test_glu_backward_config_takes_the_stages_that_fit(scaled_gate_up):
    """fp8_config(glu_backward=True)'s stages lower for the FP8 GLU backward at deepseek-v3's widths (D 7168: the
    most weight scales), one more stage does not, and Config.fits says the same, with the pre-activation in FP8
    blocks (its one-byte rows and their scales counted as laid out) or in bf16."""
    m, d, f, g = 32768, 7168, 2048, 32
    chosen = config.fp8_config(m=m, k=d, n=f, g=g, row_scale=True, glu_backward=True, scaled_gate_up=scaled_gate_up)
    buffers = dict(
        operand_cols=2 * config.FP8_BLOCK,
        operand_fp8=scaled_gate_up,
        row_vectors=config.row_vector_count(True, True, False),
        scale_k_blocks=config.fp8_scale_k_blocks(d),
    )
    d_y, w_down = _block_scaled((m, d), (1, 128)), _block_scaled((g, f, d), (1, 128, 128))
    gate_up = _block_scaled((m, 2 * f), (1, 128)) if scaled_gate_up else jax.ShapeDtypeStruct((m, 2 * f), jnp.bfloat16)
    row_scale = jax.ShapeDtypeStruct((m,), jnp.float32)
    group_sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

    def backward(d_y, w_down, group_sizes, gate_up, row_scale, cfg):
        return launch.run_glu_dgrad(
            d_y, w_down, group_sizes, gate_up, row_scale, "swiglu", config=cfg, out_dtype=jnp.bfloat16
        )

    fits = functools.partial(config.Config.fits, in_itemsize=1, out_itemsize=2, **buffers)
    _assert_the_most_stages_that_fit(chosen, backward, (d_y, w_down, group_sizes, gate_up, row_scale), fits)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_wgrad_config_takes_the_stages_that_fit(out_dtype):
    """sm90_fp8_wgrad.smem_bytes counts the buffers as laid out: fp8_wgrad_config's stages lower at dsv3-ep8 gate_up,
    one more stage does not, and smem_bytes says the same."""
    s = shapes.GMM_SHAPES["dsv3-ep8/gate_up"]
    itemsize = jnp.dtype(out_dtype).itemsize
    chosen = launch.fp8_wgrad_config(m=s.m, p=s.k, q=s.n, g=s.g, out_itemsize=itemsize)
    x = jax.ShapeDtypeStruct((s.m, s.k), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((s.m, s.n), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((s.g,), jnp.int32)

    def wgrad(x, y, group_sizes, cfg):
        return launch.run_fp8_wgrad_kernel(x, y, group_sizes, out_dtype=out_dtype, config=cfg)

    def fits(cfg):
        return sm90_fp8_wgrad.smem_bytes(cfg, itemsize) <= config.SMEM_BYTES - 2048

    _assert_the_most_stages_that_fit(chosen, wgrad, (x, y, group_sizes), fits)


def test_quantize_master_inside_a_differentiated_function_lowers(monkeypatch):
    """quantize_master's copies are constants (the quantizer kernel has no derivative): a loss that makes them from
    the weights it is differentiated by lowers for CUDA on the kernels, the quantizer's included, and its gradient is
    the master's."""
    monkeypatch.setattr(dispatch, "has_sm90_gpu", lambda: True)
    weights = jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((2,), jnp.int32)

    def loss(weights, x, group_sizes):
        master = moe_jax.quantize_master(weights)
        out = moe_jax.grouped_matmul(x, master, group_sizes, quantization="fp8_block", backend="pallas")
        return jnp.sum(jnp.square(out.astype(jnp.float32)))  # the gradients need the forward and both copies

    grad = jax.grad(loss, argnums=(0, 1))
    assert jax.eval_shape(grad, weights, x, group_sizes) == (weights, x)
    kernels = set(re.findall(r"moe_\w+?_mosaic_gpu", cuda_lowering(grad, weights, x, group_sizes)))
    expected = ("moe_quantize_square_blocks", "moe_gmm_fp8", "moe_gmm_wgrad_fp8")
    assert {f"{name}_mosaic_gpu" for name in expected} <= kernels


class _WgmmaRecorder:
    """Stands in for sm90_fresh_product's ``llvm``: records the scale-d operand (0 or 1) of every wgmma instruction
    that passes through it."""

    def __init__(self, llvm):
        self.llvm = llvm
        self.scale_d = []

    def __getattr__(self, name):
        return getattr(self.llvm, name)

    def inline_asm(self, result, operands, asm, constraints, **kwargs):
        if "wgmma.mma_async" in asm:
            constant = operands[fresh._scale_d_index(asm, constraints)].owner.attributes["value"]
            self.scale_d.append(ir.IntegerAttr(constant).value)
        return self.llvm.inline_asm(result, operands, asm, constraints, **kwargs)


@pytest.mark.parametrize("name", ["dsv3-ep8/gate_up", "gpt-oss-120b/down", "qwen3-30b/down"])
def test_each_step_product_ignores_its_accumulator_registers(monkeypatch, name):
    """Every fresh product of the FP8 kernels (forward, dgrad, wgrad) lowers to wgmma instructions of which the first
    has scale-d = 0 (its accumulator's registers are never set) and the others 1: four k-steps of 32 a 128-wide block,
    in one 128-byte swizzle group or (gpt-oss's K = 2880: sm90_fp8.ring_swizzle_columns) two 64-byte ones. At
    qwen3-30b's short groups the forward and the dgrad multiply under a branch (a consumer without rows to store
    skips its MMAs: Config.keep_ctas_in_step off), at the other two shapes outside any."""
    recorder = _WgmmaRecorder(fresh.llvm)
    monkeypatch.setattr(fresh, "llvm", recorder)
    _fwd_bwd_text(name)
    products = [recorder.scale_d[i : i + 4] for i in range(0, len(recorder.scale_d), 4)]
    assert products == [[0, 1, 1, 1]] * 3, recorder.scale_d
