"""Test tiers (DESIGN §5): reference on CPU, kernels under the Mosaic GPU interpreter, `gpu`-marked tests on a GPU."""

import jax
import pytest

from moe_jax._core.backend import has_sm90_gpu
from moe_jax._core.hardware import widen_cpu_pool_for_interpreter

# Before any backend exists: the tests run kernels under the interpreter, which needs more pool threads than 2 cores.
widen_cpu_pool_for_interpreter()

# Silent rank promotion hides shape bugs; the library must never rely on it.
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
    if has_sm90_gpu():
        return
    skip = pytest.mark.skip(reason="needs an sm90 GPU (run `pytest -m gpu tests/gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
