#!/usr/bin/env bash
# The whole CPU test suite: lint, format check, then pytest (kernels run under the Mosaic GPU interpreter).
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k routing`.
# pytest runs in MOE_JAX_TEST_WORKERS processes (pytest-xdist; default: the CPU count, at most 4, as each holds its
# own jax and interpreter state). On 2 cores the suite takes 16-22 minutes with two workers (README.md).
source "$(dirname "$0")/env.sh" || exit 1
cd "$MOE_JAX_REPO" || exit 1
ruff check . || exit 1
ruff format --check . || exit 1
cpus=$(nproc 2>/dev/null || echo 1)
workers=${MOE_JAX_TEST_WORKERS:-$((cpus < 4 ? cpus : 4))}
python -m pytest -n "$workers" "$@"
status=$?
# pytest exits 5 when it collected no test: that is a failure here, not a pass.
[ "$status" -eq 5 ] && echo "error: pytest collected no tests" >&2
exit "$status"
