"""Hardware helpers: the SM count on CPU, the XLA:CPU settings the Mosaic GPU interpreter needs, and the cached
``ptxas`` query of kernels lowered for a GPU."""

import json
import os
import subprocess
import sys
import textwrap
import types

from moe_jax._core import hardware
from tests.helpers import on_abstract_h200


def test_cpu_has_a_fallback_sm_count():
    assert hardware.num_sms() == hardware.CPU_FALLBACK_NUM_SMS


def _fake_mosaic_gpu_library(monkeypatch) -> list:
    """Stands in a Mosaic GPU extension whose ptxas query records each call; returns the record."""
    calls = []

    def query():
        calls.append(len(calls))
        return 87

    library = types.SimpleNamespace(_mosaic_gpu_ext=types.SimpleNamespace(_get_ptxas_isa_version=query))
    monkeypatch.setattr(hardware.fragmented_array, "mgpu_lib", library)
    return calls


def test_lowering_for_a_gpu_asks_ptxas_once(monkeypatch):
    calls = _fake_mosaic_gpu_library(monkeypatch)
    with on_abstract_h200():
        assert hardware.interpret_params() is None
        assert hardware.interpret_params() is None
    extension = hardware.fragmented_array.mgpu_lib._mosaic_gpu_ext
    assert [extension._get_ptxas_isa_version() for _ in range(3)] == [87, 87, 87]
    assert calls == [0]


def test_the_interpreter_leaves_the_ptxas_query_alone(monkeypatch):
    calls = _fake_mosaic_gpu_library(monkeypatch)
    assert hardware.interpret_params() is not None
    extension = hardware.fragmented_array.mgpu_lib._mosaic_gpu_ext
    assert [extension._get_ptxas_isa_version() for _ in range(2)] == [87, 87]
    assert calls == [0, 1]


def test_caching_the_ptxas_query_is_a_no_op_without_the_extension(monkeypatch):
    monkeypatch.setattr(hardware.fragmented_array, "mgpu_lib", None)
    hardware.cache_ptxas_isa_version()


def _run(script: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


# The environment as a user's process starts: no pool size and no XLA flags (conftest configured this process).
UNSET = {key: value for key, value in os.environ.items() if key not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
NARROW_HOST = (os.cpu_count() or 1) < hardware.MIN_CPU_POOL_THREADS
CONFIGURE = "import moe_jax\nmoe_jax.configure_cpu_interpreter()"


def _settings_after(statement: str, env: dict) -> dict:
    """The interpreter's variables after ``statement`` runs in a fresh process with ``env``."""
    names = ("PJRT_NPROC", "NPROC", "XLA_FLAGS")
    script = f"import json, os\n{statement}\nprint(json.dumps({{k: os.environ.get(k) for k in {names}}}))"
    return json.loads(_run(script, env).stdout.strip().splitlines()[-1])


def test_import_leaves_the_environment_unchanged():
    # Importing a library must not reconfigure XLA behind the user's back: the interpreter's settings are opt-in.
    script = "import json, os\nbefore = dict(os.environ)\nimport moe_jax\nprint(json.dumps(dict(os.environ) == before))"
    for env in (UNSET, UNSET | {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true", "PJRT_NPROC": "3"}):
        assert _run(script, env).stdout.strip().splitlines()[-1] == "true"


def test_configuring_the_interpreter_serialises_the_scheduler_and_widens_a_narrow_pool():
    settings = _settings_after(CONFIGURE, UNSET)
    assert settings["XLA_FLAGS"] == hardware.SERIAL_CPU_SCHEDULER_FLAG
    assert settings["PJRT_NPROC"] == (str(hardware.MIN_CPU_POOL_THREADS) if NARROW_HOST else None)
    assert settings["NPROC"] is None


def test_configuring_the_interpreter_keeps_what_the_user_set():
    user_flags = "--xla_cpu_use_thunk_runtime=true"
    settings = _settings_after(CONFIGURE, UNSET | {"XLA_FLAGS": user_flags, "PJRT_NPROC": "3"})
    assert settings == {
        "PJRT_NPROC": "3",
        "NPROC": None,
        "XLA_FLAGS": f"{user_flags} {hardware.SERIAL_CPU_SCHEDULER_FLAG}",
    }
    serial_off = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    settings = _settings_after(CONFIGURE, UNSET | {"XLA_FLAGS": serial_off, "NPROC": "5"})
    assert settings == {"PJRT_NPROC": None, "NPROC": "5", "XLA_FLAGS": serial_off}


def test_the_interpreter_warns_unless_configured():
    script = "import warnings\nwarnings.simplefilter('always')\nfrom moe_jax._core import hardware\n"
    script += "hardware.interpret_params()"
    unconfigured = _run(script, UNSET).stderr
    assert "can deadlock in a barrier wait" in unconfigured and "configure_cpu_interpreter()" in unconfigured
    assert ("one thread per core" in unconfigured) == NARROW_HOST
    assert "can deadlock" not in _run(f"{CONFIGURE}\n{script}", UNSET).stderr


def test_a_jitted_backward_with_concurrent_kernels_finishes():
    # Seen deadlocking under XLA:CPU's concurrency-optimised scheduler: the backward's independent kernels ran at the
    # same time in the interpreter's global state. A subprocess with a deadline turns a hang into a failure.
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import moe_jax
        moe_jax.configure_cpu_interpreter()
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
    result = subprocess.run([sys.executable, "-c", script], env=UNSET, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
