"""The FP8 kernel's sweep (``python -m benchmarks.gmm_fp8_sweep``) on CPU: every variant it times is a config the FP8
kernel takes and that fits in shared memory at every shape it runs, its table's ratios, and its refusal to run
without a GPU. (The timings and the checks themselves need the GPU.)"""

import os

import pytest

from benchmarks import common, gmm_fp8_sweep
from benchmarks.shapes import GMM_SHAPES
from moe_jax.ops.grouped_matmul import config, sm90_fp8


@pytest.mark.parametrize("index, name", list(enumerate(gmm_fp8_sweep.SHAPES)))
def test_every_variant_is_a_config_the_fp8_kernel_takes(index, name):
    shape = GMM_SHAPES[name]
    dims = {"m": shape.m, "k": shape.k, "n": shape.n, "g": shape.g}
    for variant, (make, everywhere) in gmm_fp8_sweep.VARIANTS.items():
        if not (everywhere or index == 0):
            continue
        tiles = make({**dims, "out_itemsize": 4})
        sm90_fp8.check(tiles, w_transposed=True, overlap=False)
        assert tiles.fits(1, 4, scale_k_blocks=config.fp8_scale_k_blocks(shape.k)), variant
    auto = gmm_fp8_sweep.VARIANTS["auto"][0]({**dims, "out_itemsize": 4})
    assert auto == config.fp8_config(**dims, out_itemsize=4)  # what grouped_matmul runs at f32 outputs


def test_table_gives_the_ratio_to_the_dense_fp8_row_and_the_peak():
    def record(impl, seconds, cfg=None):
        r = common.Record(gmm_fp8_sweep.BENCH, "s", "uniform", impl, int(1e12), {}, config=cfg)
        r.timing = common.Timing(seconds, seconds, seconds, seconds, 3, 1, 1.0, "device")
        return r

    fp8 = record("fp8:auto", 1e-3, {"block_m": 192, "block_n": 128, "num_compute_wgs": 3, "num_stages": 4})
    fp8.set_check([1e-4], "XLA")
    lines = gmm_fp8_sweep.table([record("dense-fp8", 5e-4), fp8]).splitlines()
    assert lines[3] == ("| s | fp8:auto | 192 | 128 | 3 | 4 | 1.000 | 1000 | 0.500 | 0.505 | 1.0e-04 | 1.0 | ok |")


def test_main_needs_a_gpu(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main adds the Triton flag: undone after
    assert gmm_fp8_sweep.main([]) == 2
    assert gmm_fp8_sweep.NO_TRITON_GEMM_FLAG in os.environ["XLA_FLAGS"]


def test_unknown_variants_are_named(capsys):
    with pytest.raises(SystemExit):
        gmm_fp8_sweep.main(["--variants", "auto,4 consumers"])
    assert "--variants: unknown ['4 consumers']" in capsys.readouterr().err
