#!/usr/bin/env bash
# The CPU test suite: lint, format check, then pytest (kernels run under the Mosaic GPU interpreter; tests/README.md).
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k routing`.
# The default run leaves out the `slow` tests, the rest of cross-products whose every pair of parts a default test
# covers; MOE_JAX_FULL_TESTS=1 runs them too (about 2 minutes more on 2 cores).
# pytest runs in MOE_JAX_TEST_WORKERS processes (pytest-xdist; default: one more than the CPU count, at most 4, as
# each holds its own jax and interpreter state), which steal queued tests from each other; the longest tests start
# first (tests/conftest.py's LONG_TESTS). A worker waits part of its time (on the subprocesses of the mesh, benchmark
# and notebook tests, on the interpreter's blocked barrier waits), so one worker more than the cores keeps them busy:
# on 2 cores the default run's pytest takes 11.5-19.5 minutes with 3 workers (fresh clone, CI machine; the same code
# varies that much with the machine's speed on the day). A fresh clone's set-up (tools/env.sh) adds half a minute when
# pip has the packages cached, 2-3 minutes when it downloads them.
source "$(dirname "$0")/env.sh" || exit 1
cd "$MOE_JAX_REPO" || exit 1
ruff check . || exit 1
ruff format --check . || exit 1
cpus=$(nproc 2>/dev/null || echo 1)
workers=${MOE_JAX_TEST_WORKERS:-$((cpus < 4 ? cpus + 1 : 4))}
# The tests compile many small XLA programs, whose compile time dominates their run time: with unoptimised code
# generation the reference and interpreter tests take about three quarters of the time, and without LLVM's expensive
# passes (which still run at level 0) the mesh tests' compiles take a fifth less again (GPU runs use
# tools/gpu_tests.sh, which leaves this alone).
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Most of those programs are small (the reference's ops dispatched one at a time, the interpreter's), and the workers
# and the subprocesses they start (virtual-device meshes, the benchmark CLI, the notebook's kernel) compile many of
# the same ones: they share one persistent compilation cache, which compiles each once. It lives in a fresh directory
# for this run unless JAX_COMPILATION_CACHE_DIR names one.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/moe_jax_test_cache.XXXXXX") || exit 1
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
tier=(-m "not slow")
[ "${MOE_JAX_FULL_TESTS:-0}" = 1 ] && tier=()
python -m pytest -n "$workers" --dist worksteal "${tier[@]}" "$@"
status=$?
# pytest exits 5 when it collected no test: that is a failure here, not a pass.
[ "$status" -eq 5 ] && echo "error: pytest collected no tests" >&2
exit "$status"
