"""The benchmarks' device timer (``--timer device``) on a GPU, against the wall clock and the chip's peak."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common

pytestmark = pytest.mark.gpu

N = 8192
# Dense bf16 tensor-core peak of an H100 / H200 SXM (989 TF/s): no kernel can do a matmul faster than this.
PEAK_FLOPS = 989e12


def test_device_time_of_a_matmul_is_within_the_wall_clock_and_the_peak():
    keys = jax.random.split(jax.random.key(0), 4)
    arg_sets = [tuple(jax.random.normal(k, (N, N), jnp.bfloat16) for k in pair) for pair in (keys[:2], keys[2:])]
    matmul = jax.jit(lambda a, b: a @ b)
    wall, _ = common.time_fn(matmul, arg_sets, iters=10, warmup=2, max_seconds=2.0)
    device, first = common.device_time_fn(matmul, arg_sets, iters=10, warmup=2, max_seconds=2.0)
    assert device.timer == "device" and wall.timer == "wall"
    assert device.samples == 10 and device.reps == 1
    assert first.shape == (N, N)
    # The kernels' time is part of the call's wall time (5% for clock noise), and no faster than the peak allows.
    assert device.median_s <= wall.median_s * 1.05
    assert 2 * N**3 / device.min_s < PEAK_FLOPS
    # One call's kernels: the same in every call.
    calls = common.kernel_calls(matmul, arg_sets, 4)
    assert len(calls) == 4 and len({tuple(name for name, _, _ in call) for call in calls}) == 1
