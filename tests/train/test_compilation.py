"""The store of compiled steps: a key moves with everything that shapes the program, a stored step computes what
the compiled one does, and what cannot be stored or loaded falls back to compiling."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from train import compilation
from train.compilation import (
    CACHE_HIT_EVENT,
    QUICK_COMPILE_OPTIONS,
    ExecutableStore,
    compile_or_load,
    compiler_options,
    source_digest,
)

ARGS = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))


@pytest.fixture(autouse=True)
def fresh_compilations():
    """These tests count what is compiled and stored: the suite's persistent cache (tools/test.sh sets one for the
    run) would answer some compilations, which are not stored. It is off for them; JAX checks it once per process,
    so the check is reset both ways."""
    enabled = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def affine(x, b):
    return jnp.tanh(x) @ jnp.ones((8, 3)) + b[None, :3]


def _package(root, text: str):
    package = root / "pkg"
    package.mkdir(exist_ok=True)
    (package / "module.py").write_text(text)
    return package


def test_the_key_moves_with_the_description_the_source_and_the_arguments(tmp_path):
    store = ExecutableStore(tmp_path / "store")
    package = _package(tmp_path, "A = 1\n")
    key = store.key({"config": 1}, (package,), ARGS)
    assert store.key({"config": 1}, (package,), ARGS) == key
    assert store.key({"config": 2}, (package,), ARGS) != key
    assert store.key({"config": 1}, (package,), (ARGS[0], jax.ShapeDtypeStruct((8,), jnp.bfloat16))) != key
    assert store.key({"config": 1}, (package,), (ARGS[1], ARGS[0])) != key
    _package(tmp_path, "A = 2\n")
    assert store.key({"config": 1}, (package,), ARGS) != key


def test_the_key_moves_with_the_environment(tmp_path, monkeypatch):
    store = ExecutableStore(tmp_path)
    key = store.key({}, (), ARGS)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert store.key({}, (), ARGS) != key
    monkeypatch.undo()
    precision = jax.config.values["jax_default_matmul_precision"]
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        assert store.key({}, (), ARGS) != key
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    monkeypatch.undo()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # memory, not the program
    assert store.key({}, (), ARGS) == key


def test_the_source_digest_ignores_compiled_bytecode(tmp_path):
    package = _package(tmp_path, "A = 1\n")
    digest = source_digest(package)
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "module.cpython-312.pyc").write_bytes(b"\x00")
    assert source_digest(package) == digest
    (package / "table.json").write_text("{}")
    assert source_digest(package) != digest


def test_a_stored_step_loads_and_computes_what_the_compiled_one_does(tmp_path):
    store = ExecutableStore(tmp_path)
    rng = np.random.default_rng(0)
    x, b = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    compiled, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=())
    assert times.aot == "saved" and times.trace_s > 0
    loaded, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=())
    assert times.aot == "loaded" and times.trace_s == times.lower_s == 0
    np.testing.assert_array_equal(loaded(x, b), compiled(x, b))
    np.testing.assert_allclose(loaded(x, b), np.tanh(x) @ np.ones((8, 3)) + b[None, :3], rtol=1e-5)


def test_a_step_the_persistent_cache_answers_is_not_stored(tmp_path):
    """The stored copy of an executable the cache gave back does not always run (``compile_or_load``'s comment):
    such a step is compiled, not stored. The cache's hit is the event it records."""

    def answered_by_the_cache(x, b):
        jax.monitoring.record_event(CACHE_HIT_EVENT)  # while compile_or_load compiles: as a hit would
        return affine(x, b)

    store = ExecutableStore(tmp_path)
    compiled, times = compile_or_load(jax.jit(answered_by_the_cache), *ARGS, store=store, description={}, sources=())
    assert times.aot == "off" and not list(tmp_path.glob("*.executable"))
    x, b = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    np.testing.assert_allclose(compiled(x, b), np.tanh(x) @ np.ones((8, 3)) + b[None, :3], rtol=1e-5)


def test_another_description_compiles_anew(tmp_path):
    store = ExecutableStore(tmp_path)
    compile_or_load(jax.jit(affine), *ARGS, store=store, description={"config": 1}, sources=())
    _, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={"config": 2}, sources=())
    assert times.aot == "saved"
    assert len(list(tmp_path.glob("*.executable"))) == 2


def test_compiler_options_reach_xla_and_key_the_stored_step(tmp_path):
    """An option XLA acts on visibly (dumping the program) shows the options reach the compilation; a step compiled
    with other options is another program, stored under another key."""
    store = ExecutableStore(tmp_path / "store")
    dumped = {"xla_dump_to": str(tmp_path / "dump")}
    _, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=(), options=dumped)
    assert times.aot == "saved" and list((tmp_path / "dump").iterdir())
    quick = compiler_options(backend="pallas", quick=True)
    _, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=(), options=quick)
    assert times.aot == "saved"
    _, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=(), options=dumped)
    assert times.aot == "loaded"
    assert len(list((tmp_path / "store").glob("*.executable"))) == 2


@pytest.mark.parametrize(
    "backend, quick, expected",
    [
        ("xla", False, {}),
        ("xla", True, QUICK_COMPILE_OPTIONS),
        ("pallas", False, {"xla_gpu_enable_triton_gemm": False}),
        ("auto", False, {}),  # this host has no sm90 GPU: "auto" runs the layers on XLA
        ("pallas", True, QUICK_COMPILE_OPTIONS),
    ],
)
def test_compiler_options_per_backend(backend, quick, expected):
    """XLA's defaults where the layers run on XLA; beside the kernels XLA's GEMMs go to cuBLAS; quick adds its
    options."""
    assert compiler_options(backend=backend, quick=quick) == expected


def test_auto_backend_on_an_sm90_gpu_compiles_like_pallas(monkeypatch):
    monkeypatch.setattr(compilation, "has_sm90_gpu", lambda: True)
    assert compiler_options(backend="auto", quick=False) == compiler_options(backend="pallas", quick=False)


def test_a_file_that_does_not_load_is_a_miss(tmp_path):
    store = ExecutableStore(tmp_path)
    compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=())
    (path,) = tmp_path.glob("*.executable")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="does not load"):
        _, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={}, sources=())
    assert times.aot == "saved"  # compiled, and the truncated file replaced


def test_a_step_that_calls_back_into_python_is_not_stored(tmp_path):
    def noisy(x, b):
        jax.debug.callback(lambda v: None, x.sum())
        return affine(x, b)

    store = ExecutableStore(tmp_path)
    _, times = compile_or_load(jax.jit(noisy), *ARGS, store=store, description={}, sources=())
    assert times.aot == "off"
    assert not list(tmp_path.iterdir())


def test_the_store_keeps_the_most_recently_used_steps(tmp_path):
    store = ExecutableStore(tmp_path, keep=2)
    for config in range(2):
        compile_or_load(jax.jit(affine), *ARGS, store=store, description={"config": config}, sources=())
    first = store.key({"config": 0}, (), ARGS)
    os.utime(tmp_path / f"{first}.executable", (0, 0))  # as if used long ago: then loading it makes it the newest
    _, times = compile_or_load(jax.jit(affine), *ARGS, store=store, description={"config": 0}, sources=())
    assert times.aot == "loaded"
    compile_or_load(jax.jit(affine), *ARGS, store=store, description={"config": 2}, sources=())
    kept = {path.stem for path in tmp_path.glob("*.executable")}
    assert kept == {first, store.key({"config": 2}, (), ARGS)}
