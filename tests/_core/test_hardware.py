"""Hardware helpers: the SM count on CPU, and the XLA:CPU setting the Mosaic GPU interpreter needs."""

import os
import subprocess
import sys
import textwrap

import moe_jax  # noqa: F401  (its import sets XLA_FLAGS)
from moe_jax._core import hardware


def test_cpu_has_a_fallback_sm_count():
    assert hardware.num_sms() == hardware.CPU_FALLBACK_NUM_SMS


def test_import_serialises_the_cpu_scheduler():
    assert hardware.SERIAL_CPU_SCHEDULER_FLAG in os.environ["XLA_FLAGS"]


def test_a_jitted_backward_with_concurrent_kernels_finishes():
    # Seen deadlocking under XLA:CPU's concurrency-optimised scheduler: the backward's independent kernels ran at the
    # same time in the interpreter's global state. A subprocess with a deadline turns a hang into a failure.
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import moe_jax
        group_sizes = jnp.full((8,), 16, jnp.int32)
        keys = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(keys[0], (128, 128), jnp.bfloat16)
        w_gate_up = jax.random.normal(keys[1], (8, 128, 128), jnp.bfloat16)
        w_down = jax.random.normal(keys[2], (8, 64, 128), jnp.bfloat16)
        row_scale = jax.random.uniform(keys[3], (128,))
        dy = jax.random.normal(keys[4], (128, 128), jnp.bfloat16)
        mlp = lambda *a: moe_jax.glu_mlp(*a[:3], group_sizes, row_scale=a[3], backend="pallas")
        grads = jax.jit(lambda *a: jax.vjp(mlp, *a[:4])[1](a[4]))(x, w_gate_up, w_down, row_scale, dy)
        print(all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads))
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
