"""Test tiers (tests/README.md): reference on CPU, kernels under the Mosaic GPU interpreter, `smoke` lowering and
config checks, `gpu`-marked tests on a GPU, expert parallelism on virtual CPU devices."""

import collections
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


def pytest_collection_modifyitems(config, items):
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
