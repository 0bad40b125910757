"""Hardware helpers: the SM count on CPU, and the XLA:CPU settings the Mosaic GPU interpreter needs."""

import json
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


def _run(script: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def _pool_variables_after(statement: str, env: dict) -> dict:
    script = (
        f"import json, os\n{statement}\nprint(json.dumps({{k: os.environ.get(k) for k in ('PJRT_NPROC', 'NPROC')}}))"
    )
    return json.loads(_run(script, env).stdout.strip().splitlines()[-1])


# The environment without a pool size (conftest widened this process's pool).
UNSIZED = {key: value for key, value in os.environ.items() if key not in ("PJRT_NPROC", "NPROC")}
NARROW_HOST = (os.cpu_count() or 1) < hardware.MIN_CPU_POOL_THREADS
WIDEN = "from moe_jax._core.hardware import widen_cpu_pool_for_interpreter; widen_cpu_pool_for_interpreter()"


def test_import_leaves_the_cpu_pool_alone():
    # A wide pool on a small host slows XLA:CPU's own work (the main job took ~1.2x as long): only on request.
    assert _pool_variables_after("import moe_jax", UNSIZED) == {"PJRT_NPROC": None, "NPROC": None}


def test_widening_the_cpu_pool_keeps_a_size_the_user_set():
    expected = str(hardware.MIN_CPU_POOL_THREADS) if NARROW_HOST else None
    assert _pool_variables_after(WIDEN, UNSIZED) == {"PJRT_NPROC": expected, "NPROC": None}
    assert _pool_variables_after(WIDEN, UNSIZED | {"PJRT_NPROC": "3"}) == {"PJRT_NPROC": "3", "NPROC": None}
    assert _pool_variables_after(WIDEN, UNSIZED | {"NPROC": "5"}) == {"PJRT_NPROC": None, "NPROC": "5"}


def test_the_interpreter_warns_where_its_pool_is_narrow():
    script = "import warnings\nwarnings.simplefilter('always')\nfrom moe_jax._core import hardware\n"
    script += "hardware.interpret_params()"
    narrow = _run(script, UNSIZED).stderr
    assert ("can deadlock in a barrier wait" in narrow) == NARROW_HOST
    assert "can deadlock" not in _run(f"{WIDEN}\n{script}", UNSIZED).stderr


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
