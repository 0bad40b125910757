#!/usr/bin/env bash
# The whole CPU test suite: lint, format check, then pytest (kernels run under the Mosaic GPU interpreter).
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k routing`.
source "$(dirname "$0")/env.sh" || exit 1
cd "$MOE_JAX_REPO" || exit 1
ruff check . || exit 1
ruff format --check . || exit 1
python -m pytest "$@"
status=$?
# pytest exits 5 when it collected no test: that is a failure here, not a pass.
[ "$status" -eq 5 ] && echo "error: pytest collected no tests" >&2
exit "$status"
