"""Every shipped grouped-matmul kernel config lowers for CUDA from a CPU host (a cheap check of layouts and shared
memory), and the lowered program really contains the Mosaic GPU kernels: fwd, dgrad and wgrad.

The abstract GPU device makes ``hardware.interpret_params()`` return None (compile, don't interpret) and gives the
persistent grid an H100/H200's 132 SMs. Lowering stops before the CUDA compiler, so it needs no GPU.
"""

import jax
import jax.numpy as jnp
import pytest

import moe_jax
from benchmarks import shapes
from moe_jax.ops.grouped_matmul import config
from moe_jax.ops.grouped_matmul import sm90_pipeline as pipe
from tests.helpers import cuda_lowering

pytestmark = pytest.mark.smoke  # lowering and config checks: no numbers (tests/README.md)
MOSAIC_CALL = "mosaic_gpu_v2"


def _lowered_fwd_bwd(g, m, k, n, *, transpose_rhs=False, out_dtype=jnp.bfloat16, activation=None) -> str:
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

    def loss(lhs, rhs, group_sizes):
        out = moe_jax.grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            activation=activation,
            preferred_element_type=out_dtype,
            transpose_rhs=transpose_rhs,
            backend="pallas",
        )
        return jnp.sum(out.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1))
    return cuda_lowering(step, lhs, rhs, group_sizes)


def _shipped_problems():
    """(G, M, K, N) of every named bench shape plus every tuned-table entry."""
    problems = {(s.g, s.m, s.k, s.n) for s in shapes.GMM_SHAPES.values() if s.tag == "bench"}
    problems |= {key[1:] for key in config.tuned_configs()}
    return sorted(problems)


@pytest.mark.parametrize("g, m, k, n", _shipped_problems())
def test_shipped_configs_lower_to_three_mosaic_kernels(g, m, k, n):
    text = _lowered_fwd_bwd(g, m, k, n)
    assert text.count(MOSAIC_CALL) == 3, "expected the fwd, dgrad and wgrad Mosaic GPU kernels"


@pytest.mark.parametrize(
    "options",
    [dict(transpose_rhs=True), dict(out_dtype=jnp.float32), dict(activation="swiglu", transpose_rhs=True)],
)
def test_layouts_and_dtypes_lower(options):
    # M off 8 takes the row-padding path; a K-major rhs flips both the fwd and the dgrad B operand.
    text = _lowered_fwd_bwd(16, 4100, 512, 384, **options)
    assert text.count(MOSAIC_CALL) == 3


# Each shape with one output dtype by default (test_layouts_and_dtypes_lower lowers both); the rest is `slow`.
@pytest.mark.parametrize(
    "g, m, k, n, out_dtype",
    [
        pytest.param(*shape, dtype, marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
        for i, shape in enumerate([(4, 1024, 256, 128), (64, 8192, 1024, 7168), (1, 64, 64, 64)])
        for j, dtype in enumerate([jnp.bfloat16, jnp.float32])
    ],
)
def test_heuristic_configs_lower(g, m, k, n, out_dtype):
    """Shapes off the table (small, wide, tiny) get heuristic configs that lower within shared memory."""
    assert all((kind, g, m, k, n) not in config.tuned_configs() for kind in config.KINDS)
    assert _lowered_fwd_bwd(g, m, k, n, out_dtype=out_dtype).count(MOSAIC_CALL) == 3


# By default one model per regime of the heuristic, both projections: qwen3-235b (256 rows a group: group bands),
# phi3.5-moe (1024 rows a group, in lockstep; the widest N and longest K), the decode steps (64-row tiles, one
# consumer; gpt-oss's D = 2880). The other models' shapes are `slow`.
OFF_TABLE_BY_DEFAULT = ("qwen3-235b", "phi3.5-moe", "qwen3-30b-t128/gate_up", "gpt-oss-120b-t128/down")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(s.name, marks=() if s.name.startswith(OFF_TABLE_BY_DEFAULT) else pytest.mark.slow)
        for tag in ("heuristic", "decode")
        for s in shapes.gmm_shapes(tag)
    ],
)
def test_off_table_shapes_lower_with_heuristic_configs(name):
    """The other models' shapes and the decode-sized ones (shapes.py's "heuristic" and "decode" tags) take heuristic
    configs at real sizes: group bands in step past 256 rows a group, 64-row tiles with one consumer up to 64,
    which must lower within shared memory there too."""
    s = shapes.GMM_SHAPES[name]
    assert _lowered_fwd_bwd(s.g, s.m, s.k, s.n).count(MOSAIC_CALL) == 3


def test_overlapped_epilogue_traces_each_step_once(monkeypatch):
    """The consumers' step loop holds one copy of the step whatever the overlapped epilogue adds: a kernel whose
    first steps were peeled, one copy per stored chunk, would trace ``issue`` once per chunk more, and lower and
    compile that much longer (sm90_pipeline.consume)."""
    calls = []
    consume = pipe.consume

    def counting(first_step, num_steps, stages, produced, consumed, issue, overlapped=()):
        traced = []

        def counted_issue(k, slot):
            traced.append(k)
            issue(k, slot)

        consume(first_step, num_steps, stages, produced, consumed, counted_issue, overlapped)
        calls.append((len(overlapped), len(traced)))

    monkeypatch.setattr(pipe, "consume", counting)
    # qwen3-30b's down projection: the tuned forward and wgrad overlap their epilogues.
    s = shapes.GMM_SHAPES["qwen3-30b/down"]
    _lowered_fwd_bwd(s.g, s.m, s.k, s.n)
    assert any(overlapped for overlapped, _ in calls), f"no kernel overlapped its epilogue: {calls}"
    assert all(traced == 1 for _, traced in calls), f"(overlapped stores, steps traced) per consumer loop: {calls}"
