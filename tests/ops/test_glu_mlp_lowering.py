"""Every new kernel configuration of the fused GLU path lowers for CUDA from a CPU host, at the named model shapes.

``glu_mlp`` forward + backward is six Mosaic GPU kernels (gate_up with the GLU epilogue keeping the pre-activation,
down with the row-scale epilogue, the GLU-backward dgrad, two wgrads, the gate_up dgrad), seven when the backward
recomputes the pre-activation; forward alone it is two (the GLU epilogue without the kept pre-activation). Across
the cases every activation meets the forward and the backward epilogue, with and without a row scale, and every
model's (D, F) the heuristic configs (shared-memory fit included); the standalone ``grouped_matmul`` epilogues (row
scale alone, GLU + row scale) lower with their gradients. Shapes: ``benchmarks.shapes.GMM_SHAPES``'s "<model>/gate_up"
entries, (G, M, K = D, N = 2F).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul import config, launch
from tests.helpers import cuda_lowering, on_abstract_h200

pytestmark = pytest.mark.smoke  # lowering and config checks: no numbers (tests/README.md)
MOSAIC_CALL = "mosaic_gpu_v2"


def _lowered(
    model: str, activation: str, *, row_scale: bool, recompute: bool, backward: bool = True, quantization=None
) -> str:
    shape = shapes.GMM_SHAPES[f"{model}/gate_up"]
    g, m, d, d_ff = shape.g, shape.m, shape.k, shape.n // 2
    args = (
        jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d, 2 * d_ff), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d_ff, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )

    def loss(x, w_gate_up, w_down, group_sizes, scale):
        packed = moe_jax.PackedGateUp(w_gate_up, 64)
        row_scales = scale if row_scale else None
        if quantization is not None:
            y = moe_jax.glu_mlp(
                x,
                packed,
                w_down,
                group_sizes,
                activation=activation,
                row_scale=row_scales,
                backend="pallas",
                quantization=quantization,
            )
        else:
            y = glu_mlp_api._glu_mlp(
                x, packed, w_down, group_sizes, activation, row_scales, True, "pallas", recompute_gate_up=recompute
            )
        return jnp.sum(y.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 4)) if backward else loss
    return cuda_lowering(step, *args)


@pytest.mark.parametrize(
    "model, activation, row_scale, recompute, kernels",
    [
        ("qwen3-30b", "swiglu", True, False, 6),
        ("gpt-oss-120b", "gpt_oss", True, False, 6),  # F = 2880: a half-empty last column tile
        ("dsv3-ep8", "geglu", False, True, 7),
    ],
)
def test_glu_mlp_forward_and_backward_lower(model, activation, row_scale, recompute, kernels):
    text = _lowered(model, activation, row_scale=row_scale, recompute=recompute)
    assert text.count(MOSAIC_CALL) == kernels


# FP8: the same six kernels on FP8 operands, the GLU backward in the FP8 dgrad's epilogue (gpt-oss: its contraction,
# D = 2880, ends in a 64-wide block).
@pytest.mark.parametrize(
    "model, activation, row_scale",
    [("qwen3-30b", "swiglu", True), ("gpt-oss-120b", "gpt_oss", True), ("dsv3-ep8", "geglu", False)],
)
def test_fp8_glu_mlp_forward_and_backward_lower(model, activation, row_scale):
    text = _lowered(model, activation, row_scale=row_scale, recompute=False, quantization="fp8_block")
    assert text.count(MOSAIC_CALL) == 6
    assert "moe_gmm_fp8_glu_bwd" in text


def test_fp8_glu_mlp_forward_alone_lowers():
    text = _lowered("qwen3-30b", "swiglu", row_scale=True, recompute=False, backward=False, quantization="fp8_block")
    assert text.count(MOSAIC_CALL) == 2


def _routed_args(model: str, top_k: int) -> tuple:
    """(tokens x [T, D], sort_indices [T * k], w_gate_up [G, D, 2F], w_down [G, F, D], group_sizes [G], row_scale
    [T * k]) of a model's routed MLP, T * k its gate_up shape's rows."""
    shape = shapes.GMM_SHAPES[f"{model}/gate_up"]
    g, m, d, d_ff = shape.g, shape.m, shape.k, shape.n // 2
    return (
        jax.ShapeDtypeStruct((m // top_k, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.int32),
        jax.ShapeDtypeStruct((g, d, 2 * d_ff), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d_ff, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )


@pytest.mark.parametrize("backend, gathered", [("pallas_gather", True), ("pallas_sorted", False)])
def test_fp8_routed_glu_mlp_lowers_gathered_or_sorted(backend, gathered):
    """qwen3-30b's routed FP8 MLP from tokens (T * 8 rows): "pallas_gather"'s gate_up kernel gathers the tokens'
    FP8 rows; "pallas_sorted"'s reads permuted rows."""
    top_k = 8

    def forward(x, sort_indices, w_gate_up, w_down, group_sizes, scale):
        w_gate_up = moe_jax.PackedGateUp(w_gate_up, 64)
        options = dict(row_scale=scale, backend=backend, quantization="fp8_block")
        return glu_mlp_api.routed_glu_mlp(x, sort_indices, top_k, w_gate_up, w_down, group_sizes, **options)

    text = cuda_lowering(forward, *_routed_args("qwen3-30b", top_k))
    assert ("moe_gmm_fp8_gather_glu" in text) == gathered
    assert ("moe_gmm_fp8_glu" in text) != gathered


@pytest.mark.parametrize("backend, permuted_fp8_rows", [("pallas_sorted", 2), ("pallas_gather", 0)])
def test_fp8_routed_backward_takes_the_tokens_dy(backend, permuted_fp8_rows):
    """With its rows summed inside the kernels' VJP (``combine``), the routed FP8 MLP's backward quantizes each
    token's dy once: "pallas_sorted" permutes the FP8 rows of dy as it permutes x's (two permutes of one-byte rows,
    moved as 16-bit words, [T, D / 2] -> [T * k, D / 2]) and no bf16 row of dy is written; "pallas_gather" gathers
    both in its kernels (no permute)."""
    t, top_k, d, d_ff, g = 64, 2, 256, 128, 4

    def loss(x, w_gate_up, w_down, sort_indices, group_sizes, scale):
        options = dict(row_scale=scale, backend=backend, quantization="fp8_block", combine="pallas")
        args = (x, sort_indices, top_k, moe_jax.PackedGateUp(w_gate_up, 64), w_down, group_sizes)
        return jnp.sum(glu_mlp_api.routed_glu_mlp(*args, **options).astype(jnp.float32))

    args = (
        jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d, 2 * d_ff), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d_ff, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((t * top_k,), jnp.float32),
    )
    calls = [
        line for line in cuda_lowering(jax.grad(loss, argnums=(0, 1, 2)), *args).splitlines() if MOSAIC_CALL in line
    ]
    permutes = [line for line in calls if line.endswith(f"-> tensor<{t * top_k}x{d // 2}xf16>")]
    bf16_rows = [line for line in calls if line.endswith(f"-> tensor<{t * top_k}x{d}xbf16>")]
    assert len(permutes) == permuted_fp8_rows
    assert all(f"(tensor<{t}x{d // 2}xf16>" in line for line in permutes)
    # The one bf16 [T * k, D] a kernel writes is d_rows, x's gradient rows (the gate_up dgrad's output): the forward's
    # y rows, the down kernel's output, are not lowered, as jax.grad discards them.
    assert len(bf16_rows) == 1 and "f8E4M3FN" in bf16_rows[0]


def test_glu_mlp_forward_alone_lowers():
    assert _lowered("mixtral", "swiglu", row_scale=True, recompute=False, backward=False).count(MOSAIC_CALL) == 2


def test_standalone_epilogues_lower_with_their_gradients():
    """grouped_matmul's own fused epilogues under jax.grad: row scale alone, and GLU + row scale (both keeping the
    pre-activation for the XLA-differentiated epilogue), each with its dgrad and wgrad kernels."""
    shape = shapes.GMM_SHAPES["qwen3-30b/gate_up"]
    g, m, k, n = shape.g, shape.m, shape.k, shape.n
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )

    def loss(x, w, group_sizes, scale):
        scaled = moe_jax.grouped_matmul(x, w, group_sizes, row_scale=scale, backend="pallas")
        packed = moe_jax.PackedGateUp(w, 64)
        glu = moe_jax.grouped_matmul(x, packed, group_sizes, activation="geglu", row_scale=scale, backend="pallas")
        return jnp.sum(scaled.astype(jnp.float32)) + jnp.sum(glu.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1, 3))
    text = cuda_lowering(step, *args)
    assert text.count(MOSAIC_CALL) == 6


@pytest.mark.parametrize("quantization, kernels", [(None, 0), ("fp8_block", 6)])
def test_dense_glu_mlp_lowers_kernels_only_quantized(quantization, kernels):
    """The shared experts' one-group MLP at gpu-moe's shape, forward and backward with backend="pallas": unquantized
    six dense matmuls (two forward, four backward) and no Mosaic GPU kernel; with fp8_block the FP8 glu_mlp's six
    grouped matmuls."""
    shape = shapes.GMM_SHAPES["gpu-moe-shared/gate_up"]
    args = (
        jax.ShapeDtypeStruct((shape.m, shape.k), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, shape.k, shape.n), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, shape.n // 2, shape.k), jnp.bfloat16),
    )

    def loss(x, w_gate_up, w_down):
        y = moe_jax.dense_glu_mlp(x, w_gate_up, w_down, backend="pallas", quantization=quantization)
        return jnp.sum(y.astype(jnp.float32))

    text = cuda_lowering(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    assert text.count(MOSAIC_CALL) == kernels
    assert quantization or text.count("stablehlo.dot_general") == 6


# routed_glu_mlp gathers the gate_up kernel's rows from the tokens (cp.async in the producer: only a real lowering
# builds it) with each model's tuned gate_up config, in group bands (the gather forced: by default only
# F <= 1024 fuses). Its backward adds a permute (the sorted rows for the gate_up wgrad) and a combine (d_x) to
# glu_mlp's six kernels, at gpt-oss's D = 2880 (no multiple of 128) too; the other models' tuned configs are `slow`.
@pytest.mark.parametrize(
    "model, top_k",
    [
        ("qwen3-30b", 8),
        ("gpt-oss-120b", 4),
        pytest.param("dsv3-ep8", 8, marks=pytest.mark.slow),
        pytest.param("mixtral", 2, marks=pytest.mark.slow),
    ],
)
def test_routed_glu_mlp_lowers_with_its_gather(model, top_k):
    args = _routed_args(model, top_k)

    def loss(x, sort_indices, w_gate_up, w_down, group_sizes, scale):
        packed = moe_jax.PackedGateUp(w_gate_up, 64)
        y = glu_mlp_api.routed_glu_mlp(
            x, sort_indices, top_k, packed, w_down, group_sizes, row_scale=scale, backend="pallas_gather"
        )
        return jnp.sum(y.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 2, 3, 5))
    text = cuda_lowering(step, *args)
    assert text.count(MOSAIC_CALL) == 8


class _Captured(Exception):
    pass


@pytest.mark.parametrize(
    "model, activation",
    [("gpt-oss-120b", "gpt_oss"), ("qwen3-30b", "gpt_oss"), ("gpt-oss-120b", "swiglu"), ("mixtral", "geglu")],
)
def test_forward_keeping_the_pre_activation_takes_the_table_tiles(monkeypatch, model, activation):
    """The forward that keeps the pre-activation (for gpt_oss rounded to each value's side of the clamps) takes the
    table's 256-column tiles: it computes each stored value in its store's branch, which spills nothing there."""
    shape = shapes.GMM_SHAPES[f"{model}/gate_up"]

    def capture(*args, **kwargs):
        raise _Captured(kwargs["config"])

    monkeypatch.setattr(launch.sm90, "grouped_matmul_rows", capture)
    args = (
        jax.ShapeDtypeStruct((shape.m, shape.k), jnp.bfloat16),
        jax.ShapeDtypeStruct((shape.g, shape.k, shape.n), jnp.bfloat16),
        jax.ShapeDtypeStruct((shape.g,), jnp.int32),
    )

    def forward(x, w, group_sizes):
        return launch.run_forward_kernel(x, w, group_sizes, None, activation, jnp.bfloat16, False, keep=True)

    with on_abstract_h200(), pytest.raises(_Captured) as captured:
        jax.eval_shape(forward, *args)
    assert captured.value.args[0] == config.tuned_configs()[("fwd", shape.g, shape.m, shape.k, shape.n)]


@pytest.mark.parametrize(
    "model, activation, expected, recompute",
    [
        ("gpt-oss-120b", "swiglu", "table", False),
        ("gpt-oss-120b", "geglu", "table", True),
        ("qwen3-30b", "geglu", "table", True),
        ("dsv3-ep8", "swiglu", "table", False),  # 128 x 256 tiles: four slots per tile
        ("dsv3-ep8", "geglu", "table", False),  # recomputing is slower next to 256 columns
        ("gpt-oss-120b", "gpt_oss", "table", True),
        ("qwen3-30b", "gpt_oss", "table", True),
        ("dsv3-ep8", "gpt_oss", "128 x 128 ring", True),  # gpt_oss's tiles are at most 128 columns wide
    ],
)
def test_glu_backward_config_and_recomputed_grads(monkeypatch, model, activation, expected, recompute):
    """The GLU-backward dgrad carries its packed gate/up rows in the pipeline's ring (the table's tiles; gpt_oss's at
    most config.CLAMPED_GLU_MAX_BLOCK_N columns wide), and recomputes h, d_gate and d_up per store for the activations
    of launch.RECOMPUTED_GRADS on tiles of at most RECOMPUTE_MAX_BLOCK_N columns."""
    shape = shapes.GMM_SHAPES[f"{model}/down"]  # (G, M, F, D)
    g, m, d_ff, d = shape.g, shape.m, shape.k, shape.n

    def capture(*args, **kwargs):
        raise _Captured(kwargs["config"], kwargs["epilogue"])

    monkeypatch.setattr(launch.sm90, "grouped_matmul_rows", capture)
    args = (
        jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d_ff, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m, 2 * d_ff), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    with on_abstract_h200(), pytest.raises(_Captured) as captured:
        jax.eval_shape(functools.partial(launch.run_glu_dgrad, activation=activation), *args)
    chosen, epilogue = captured.value.args
    configs = {"table": config.tuned_configs()[("glu_dgrad", g, m, d_ff, d)], "128 x 128 ring": config.GLU_DGRAD_TILES}
    assert chosen == configs[expected]
    assert epilogue.ring_slots(chosen) == chosen.block_n // 64
    assert epilogue.recompute_grads == recompute


# Bytes by hand: stages x (x block [128, 64] + w block [block_n, 64]) bf16, the epilogue's double buffer
# [2, 128, 64] bf16, and with a row scale one 1024-byte buffer for both [128] f32 vectors.
@pytest.mark.parametrize(
    "block_n, stages, row_scale, smem_bytes, expected",
    [
        (128, 6, True, 6 * 32768 + 32768 + 1024, True),
        (128, 7, False, 7 * 32768 + 32768, False),
        (256, 4, True, 4 * 49152 + 32768 + 1024, True),
        (256, 5, False, 5 * 49152 + 32768, False),
    ],
)
def test_ring_glu_backward_fits_exactly_where_it_lowers(block_n, stages, row_scale, smem_bytes, expected):
    """Config.smem_bytes counts the GLU backward's buffers (none for the gate/up rows, which the ring carries) as laid
    out, and Config.fits agrees with Mosaic GPU's shared-memory check: 6 stages of 128 x 128 tiles, or 4 of 128 x 256,
    fit with a row scale, exactly at the limit (its two [128] f32 vectors share one 1024-byte buffer and the row sums
    reserve no reduction scratch); one more stage does not fit even without one."""
    c = dataclasses.replace(config.GLU_DGRAD_TILES, block_n=block_n, num_stages=stages)
    m, d_ff, d, g = 1024, 256, 256, 4
    args = (
        jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, d_ff, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m, 2 * d_ff), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.float32) if row_scale else None,
    )
    dgrad = functools.partial(launch.run_glu_dgrad, activation="swiglu", config=c)
    try:
        with on_abstract_h200():
            jax.jit(dgrad).trace(*args).lower(lowering_platforms=("cuda",))
        lowers = True
    except ValueError as error:
        assert "exceeds available shared memory" in str(error)
        lowers = False
    assert config.gate_up_ring_slots(c) == block_n // 64
    assert c.smem_bytes(2, 2, **config.epilogue_smem("glu_dgrad", c, row_scale)) == smem_bytes
    assert c.fits(**config.epilogue_smem("glu_dgrad", c, row_scale)) == lowers == expected


@pytest.mark.parametrize(
    "base, stages, overlap, slots",
    [
        ("GLU_DGRAD_TILES", 2, False, 2),  # fewer stages than chunks: the ring is walked in one order
        ("GLU_DGRAD_TILES", 2, True, 0),  # the next tile's first steps need a slot while the chunks wait
        ("GLU_DGRAD_TILES", 3, True, 2),
        ("GLU_DGRAD_LONG_D_TILES", 3, False, 4),
        ("GLU_DGRAD_LONG_D_TILES", 3, True, 0),
    ],
)
def test_ring_slots_need_more_stages_than_chunks_only_with_the_overlapped_epilogue(base, stages, overlap, slots):
    """An overlapped epilogue reads a tile's ring slots after the next tile's first steps: with no more stages than
    chunks that would hang the GPU, so such configs load the gate/up rows into the consumers' own buffer."""
    c = dataclasses.replace(getattr(config, base), num_stages=stages, overlap_epilogue=overlap)
    assert config.gate_up_ring_slots(c) == slots
