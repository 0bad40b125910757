"""The grouped-matmul configs pinned: the tuned table's entries, and the config every named shape gets from
get_config (the table or the heuristic), so that an edit of the table's file, the presets or the heuristic that moves a
tile choice fails here. A deliberate change updates these tables next to the measurement behind it
(docs/kernels/grouped_matmul.md).
"""

import pytest

from moe_jax.ops.grouped_matmul import config

# The tuned table (tuned/sm90.json) in terms of the named presets: (kind, G, M, K, N) -> config.
TABLE = {
    ("fwd", 128, 32768, 2048, 1536): config.GROUP_BANDS_SHORT_TAILS,
    ("dgrad", 128, 32768, 2048, 1536): config.GROUP_BANDS_SHORT_TAILS,
    ("wgrad", 128, 32768, 2048, 1536): config.WGRAD_BANDS,
    ("fwd", 128, 32768, 768, 2048): config.GROUP_BANDS_SHORT_TAILS,
    ("dgrad", 128, 32768, 768, 2048): config.GROUP_BANDS_SHORT_TAILS,
    ("glu_dgrad", 128, 32768, 768, 2048): config.GLU_DGRAD_SHORT_D_TILES,
    ("wgrad", 128, 32768, 768, 2048): config.WGRAD_BANDS,
    ("fwd", 128, 32768, 2880, 5760): config.GROUP_BANDS,
    ("dgrad", 128, 32768, 2880, 5760): config.GROUP_BANDS,
    ("wgrad", 128, 32768, 2880, 5760): config.WGRAD_BANDS,
    ("fwd", 128, 32768, 2880, 2880): config.GROUP_BANDS,
    ("dgrad", 128, 32768, 2880, 2880): config.GROUP_BANDS,
    ("glu_dgrad", 128, 32768, 2880, 2880): config.GLU_DGRAD_SHORT_D_TILES,
    ("wgrad", 128, 32768, 2880, 2880): config.WGRAD_BANDS,
    ("fwd", 32, 32768, 7168, 4096): config.GROUP_BANDS,
    ("dgrad", 32, 32768, 7168, 4096): config.GROUP_BANDS,
    ("wgrad", 32, 32768, 7168, 4096): config.WGRAD_BANDS,
    ("fwd", 32, 32768, 2048, 7168): config.GROUP_BANDS,
    ("dgrad", 32, 32768, 2048, 7168): config.GROUP_BANDS,
    ("glu_dgrad", 32, 32768, 2048, 7168): config.GLU_DGRAD_LONG_D_TILES,
    ("wgrad", 32, 32768, 2048, 7168): config.WGRAD_BANDS,
    ("fwd", 8, 16384, 4096, 28672): config.GROUP_BANDS,
    ("dgrad", 8, 16384, 4096, 28672): config.GROUP_BANDS,
    ("wgrad", 8, 16384, 4096, 28672): config.WGRAD_BANDS,
    ("fwd", 8, 16384, 14336, 4096): config.GROUP_BANDS,
    ("dgrad", 8, 16384, 14336, 4096): config.GROUP_BANDS,
    ("glu_dgrad", 8, 16384, 14336, 4096): config.GLU_DGRAD_TILES,
    ("wgrad", 8, 16384, 14336, 4096): config.WGRAD_BANDS,
}

# (G, M, K, N) of every named shape (benchmarks/shapes.py) -> the config get_config picks for: fwd, fwd with f32
# outputs, dgrad, wgrad, glu_dgrad with a row scale, and glu_dgrad through gpt_oss's clamps. A config reads
# "<block_m>x<block_n>x<block_k> w<compute warpgroups> s<stages> e<epilogue_n> <grid_minor><grid_width>", then "o"
# with the overlapped epilogue and "t" with the CTAs kept in step.
PINNED = {
    (4, 256, 128, 256): (
        "64x128x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # ci/gate_up
    (4, 256, 128, 128): (
        "64x128x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "128x128x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # ci/down
    (5, 200, 128, 64): (
        "64x128x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "128x128x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # ci/ragged
    (128, 32768, 2048, 1536): (
        "128x256x64 w2 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 g16 o",
        "128x256x64 w2 s4 e64 g16 o",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # qwen3-30b/gate_up
    (128, 32768, 768, 2048): (
        "128x256x64 w2 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 g16 o",
        "128x256x64 w2 s4 e64 g16 o",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # qwen3-30b/down
    (128, 32768, 2880, 5760): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x256x64 w2 s4 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # gpt-oss-120b/gate_up
    (128, 32768, 2880, 2880): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # gpt-oss-120b/down
    (32, 32768, 7168, 4096): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s5 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # dsv3-ep8/gate_up
    (32, 32768, 2048, 7168): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x256x64 w2 s4 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # dsv3-ep8/down
    (8, 16384, 4096, 28672): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x256x64 w2 s4 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # mixtral/gate_up
    (8, 16384, 14336, 4096): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s5 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # mixtral/down
    (64, 32768, 2048, 2048): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 n16",
        "128x128x64 w2 s6 e64 n16",
    ),  # olmoe-1b-7b/gate_up
    (64, 32768, 1024, 2048): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 n8",
        "128x128x64 w2 s6 e64 n8",
    ),  # olmoe-1b-7b/down
    (64, 24576, 2048, 2816): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # deepseek-v2-lite/gate_up
    (64, 24576, 1408, 2048): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 n11",
        "128x128x64 w2 s6 e64 n11",
    ),  # deepseek-v2-lite/down
    (128, 32768, 4096, 3072): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s5 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # qwen3-235b/gate_up
    (128, 32768, 1536, 4096): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s5 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # qwen3-235b/down
    (16, 16384, 4096, 12800): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x256x64 w2 s4 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # phi3.5-moe/gate_up
    (16, 16384, 6400, 4096): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s5 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # phi3.5-moe/down
    (40, 32768, 1536, 1024): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 n12",
        "128x128x64 w2 s6 e64 n12",
    ),  # granite-3b/gate_up
    (40, 32768, 512, 1536): (
        "128x256x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s3 e64 g16 o t",
        "128x128x64 w2 s4 e64 g16 o t",
        "128x256x64 w2 s4 e64 m16 o",
        "128x128x64 w2 s6 e64 n4",
        "128x128x64 w2 s6 e64 n4",
    ),  # granite-3b/down
    (128, 1024, 2048, 1536): (
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # qwen3-30b-t128/gate_up
    (128, 1024, 768, 2048): (
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # qwen3-30b-t128/down
    (128, 512, 2880, 5760): (
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x256x64 w2 s4 e64 g16 t",
        "128x128x64 w2 s5 e64 g16 t",
    ),  # gpt-oss-120b-t128/gate_up
    (128, 512, 2880, 2880): (
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # gpt-oss-120b-t128/down
    (128, 8192, 2048, 1536): (
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # qwen3-30b-t1024/gate_up
    (128, 8192, 768, 2048): (
        "64x256x64 w1 s4 e64 g16 o",
        "64x256x64 w1 s4 e64 g16 o",
        "64x128x64 w1 s4 e64 g16 o",
        "128x256x64 w2 s3 e64 m16 o",
        "128x128x64 w2 s6 e64 g16 t",
        "128x128x64 w2 s6 e64 g16 t",
    ),  # qwen3-30b-t1024/down
}


def _label(c: config.Config) -> str:
    overlap, in_step = " o" if c.overlap_epilogue else "", " t" if c.keep_ctas_in_step else ""
    tile = f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_compute_wgs} s{c.num_stages} e{c.epilogue_n}"
    return f"{tile} {c.grid_minor}{c.grid_width}{overlap}{in_step}"


def test_tuned_table_holds_the_named_presets():
    assert dict(config.tuned_configs()) == TABLE


@pytest.mark.parametrize("g, m, k, n", list(PINNED))
def test_named_shapes_get_their_pinned_configs(g, m, k, n):
    def chosen(kind: str, **options) -> str:
        return _label(config.get_config(kind, m=m, k=k, n=n, g=g, **options))

    glu_dgrad = chosen("glu_dgrad", row_scale=True), chosen("glu_dgrad", row_scale=True, clamped=True)
    actual = (chosen("fwd"), chosen("fwd", out_itemsize=4), chosen("dgrad"), chosen("wgrad"), *glu_dgrad)
    assert actual == PINNED[g, m, k, n]


# (G, M, K, N) of the FP8 sweep's shapes (benchmarks/gmm_fp8_sweep.py) and a decode-sized one -> fp8_config's tiles of
# the forward (output columns N), of the GLU forward on the same weights, and of the dgrad (output columns K,
# contraction N: launch.run_fp8_forward_kernel on w [G, K, N]): three consumers on 128 columns from
# FP8_THREE_CONSUMERS_MIN_N output columns, two below on 192 columns (128 with a GLU), one on decode-sized groups.
FP8_PINNED = {
    (32, 32768, 7168, 4096): ("192x128x128 w3", "192x128x128 w3", "192x128x128 w3"),
    (32, 32768, 2048, 7168): ("192x128x128 w3", "192x128x128 w3", "128x192x128 w2"),
    (128, 32768, 2880, 2880): ("128x192x128 w2", "128x128x128 w2", "128x192x128 w2"),
    (8, 16384, 4096, 28672): ("192x128x128 w3", "192x128x128 w3", "192x128x128 w3"),
    (128, 32768, 2048, 1536): ("128x192x128 w2", "128x128x128 w2", "128x192x128 w2"),
    (32, 1024, 7168, 4096): ("64x128x128 w1", "64x128x128 w1", "64x128x128 w1"),
}


@pytest.mark.parametrize("g, m, k, n", list(FP8_PINNED))
def test_fp8_shapes_get_their_pinned_tiles(g, m, k, n):
    def tiles(c: config.Config) -> str:
        return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_compute_wgs}"

    forward = config.fp8_config(m=m, k=k, n=n, g=g)
    glu = config.fp8_config(m=m, k=k, n=n, g=g, glu_forward=True)
    dgrad = config.fp8_config(m=m, k=n, n=k, g=g)
    assert (tiles(forward), tiles(glu), tiles(dgrad)) == FP8_PINNED[g, m, k, n]
