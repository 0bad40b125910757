"""pytest plugin of tools/gpu_tests.sh: records each failed test (setup, call or teardown) or collection as a line
``<kind> <node id>`` in the file named by ``GPU_FAILURE_KINDS``, kind ``oom`` where the failure text says the GPU ran
out of memory and ``other`` otherwise.

The script re-runs only the ``oom`` ones: a test that ran out of memory beside other shards may pass with the card to
itself, while any other failure (a wrong value, a race that shows one run in ten) stays a failure.
"""

import os
import re

# XLA's allocator ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate ...") and the CUDA driver's.
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)


def _record(report) -> None:
    if report.failed:
        kind = "oom" if OUT_OF_MEMORY.search(report.longreprtext) else "other"
        with open(os.environ["GPU_FAILURE_KINDS"], "a") as failures:
            failures.write(f"{kind} {report.nodeid}\n")


pytest_runtest_logreport = pytest_collectreport = _record
