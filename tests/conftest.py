"""Test tiers (tests/README.md): reference on CPU, kernels under the Mosaic GPU interpreter, `smoke` lowering and
config checks, `gpu`-marked tests on a GPU, expert parallelism on virtual CPU devices."""

import collections
import os
import pathlib
import sys

import jax
import pytest

# The repository root, so that `tests`, `benchmarks` and `train` import however pytest was started.
REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import moe_jax  # noqa: E402
from moe_jax._core.backend import has_sm90_gpu  # noqa: E402

# Before any backend exists: the tests run kernels under the interpreter (moe_jax.configure_cpu_interpreter).
moe_jax.configure_cpu_interpreter()

# Silent rank promotion hides shape bugs; the library must never rely on it.
jax.config.update("jax_numpy_rank_promotion", "raise")

TIERS = ("gpu", "smoke")  # marked tiers; every other test checks numbers on the CPU

# The longest tests (node-id prefixes: a module, or one test function with all its parameters), longest first.
# pytest-xdist's worksteal hands each worker a contiguous share of the collection and lets an idle worker steal the
# end of another's queue; these run first, dealt round-robin to the starts of the shares (the order below), so that
# none is left for the end of the run. A module's tests that share a module fixture (a subprocess on virtual devices)
# stay together on one worker, which runs the fixture once.
LONG_TESTS = (
    "tests/parallel/test_all_to_all.py",
    "tests/ops/test_moe_ffn_pallas.py",
    "tests/notebooks/test_notebooks.py",
    "tests/benchmarks/test_benchmarks_cli.py",
    "tests/train/test_train.py::test_two_device_mesh_matches_one_device",
    "tests/ops/test_glu_mlp_fp8_pallas.py::test_fp8_routed_glu_mlp_matches_the_xla_recipe",
    "tests/parallel/test_expert_parallel.py",
    "tests/ops/test_moe_ffn_fp8_pallas.py::test_kernel_path_matches_the_xla_path",
    "tests/ops/test_glu_mlp_fp8_pallas.py::test_fp8_glu_mlp_matches_the_xla_recipe",
    "tests/train/test_train.py::test_expert_parallel_run_resumes_bit_exactly",
    "tests/ops/test_grouped_matmul_fp8_pallas.py::test_glu_forward_keeps_the_pre_activation_in_fp8_blocks",
)


def _long_tests_first(items, num_workers):
    """Reorders ``items`` in place: each worker's share of them (as pytest-xdist splits the collection: the first
    worker len // num_workers items, the next that share of the rest, ...) starts with its LONG_TESTS."""
    groups = {prefix: [] for prefix in LONG_TESTS}
    rest = []
    for item in items:
        prefix = next((p for p in LONG_TESTS if item.nodeid == p or item.nodeid.startswith((f"{p}::", f"{p}["))), None)
        (groups[prefix] if prefix else rest).append(item)
    shares = [[] for _ in range(num_workers)]
    for index, group in enumerate(group for group in groups.values() if group):
        shares[index % num_workers].extend(group)
    ordered, left = [], len(items)
    for worker, share in enumerate(shares):
        size = left // (num_workers - worker)
        left -= size
        fill = max(size - len(share), 0)
        ordered += share + rest[:fill]
        rest = rest[fill:]
    items[:] = ordered + rest


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the shares are of the tests that run
def pytest_collection_modifyitems(config, items):
    _long_tests_first(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if has_sm90_gpu():
        return
    skip = pytest.mark.skip(reason="needs an sm90 GPU (run `pytest -m gpu tests/gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per tier, so that the lowering and config checks are not counted as numerical tests."""
    outcomes = collections.defaultdict(collections.Counter)
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "nodeid", None) is None or not hasattr(report, "keywords"):
                continue
            tier = next((name for name in TIERS if name in report.keywords), "numerical")
            outcomes[tier][outcome] += 1
    if outcomes:
        terminalreporter.section("tiers")
        for tier in ("numerical", *TIERS):
            if outcomes[tier]:
                counts = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes[tier].items()))
                terminalreporter.write_line(f"{tier}: {counts}")
