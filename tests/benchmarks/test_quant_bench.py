"""The quantizer bench on CPU: its floor's bytes, its streaming peer's, and one tiny run through both backends (the
kernel under the GPU interpreter) with its bit-for-bit check and table."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, quant

TINY = common.Options(iters=1, warmup=0, max_seconds=0.05, min_samples=1)


def test_floor_bytes_are_the_input_and_every_output_once():
    x = jax.ShapeDtypeStruct((192, 320), jnp.bfloat16)
    # x in bf16; per copy FP8 values and f32 scales of 1 x 128 blocks (3 per row of x, 2 per row of x^T).
    rows = 192 * 320 * 2 + 192 * 320 + 192 * 3 * 4
    transposed = 320 * 192 + 320 * 2 * 4
    variants = quant.variants(quant.SHAPES["ci/x"])
    assert quant.moved_bytes(lambda x: variants["1x128"](x, "xla"), x) == rows
    assert quant.moved_bytes(lambda x: variants["1x128+t"](x, "xla"), x) == rows + transposed
    # MXFP8: 1 x 32 blocks with one-byte e8m0 scales.
    assert quant.moved_bytes(lambda x: variants["mxfp8"](x, "xla"), x) == 192 * 320 * 3 + 192 * 10
    # Weights: w in bf16; per copy FP8 values and one f32 scale per 128 x 128 block (2 x 3 of them per group).
    w = jax.ShapeDtypeStruct((2, 256, 320), jnp.bfloat16)
    copy = 2 * 256 * 320 + 2 * 2 * 3 * 4
    weight_variants = quant.variants(quant.SHAPES["ci/w"])
    assert quant.moved_bytes(lambda w: weight_variants["128x128 fwd"](w, "xla"), w) == 2 * 256 * 320 * 2 + copy
    assert quant.moved_bytes(lambda w: weight_variants["128x128+t"](w, "xla"), w) == 2 * 256 * 320 * 2 + 2 * copy


def test_the_peer_writes_the_fp8_copies_bytes_in_bf16():
    """The streaming pass reads x once and writes as many bytes as the variant's FP8 values (one copy: x's; two:
    x's and x^T's), and computes what it says."""
    x = jax.random.normal(jax.random.key(0), (192, 320), jnp.bfloat16)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    variants = quant.variants(quant.SHAPES["ci/x"])
    copies = {name: quant.fp8_copies(lambda x, fn=fn: fn(x, "xla"), spec) for name, fn in variants.items()}
    assert copies == {"1x128": 1, "1x128+t": 2, "mxfp8": 1, "wgrad": 1, "wgrad+rows": 2}
    w = jax.ShapeDtypeStruct((2, 256, 320), jnp.bfloat16)
    weight_variants = quant.variants(quant.SHAPES["ci/w"])
    assert quant.fp8_copies(lambda w: weight_variants["128x128+t"](w, "xla"), w) == 2
    assert quant.fp8_copies(lambda w: weight_variants["128x128 fwd"](w, "xla"), w) == 1
    for n in (1, 2):
        assert quant.moved_bytes(functools.partial(quant.streaming_pass, copies=n), spec) == 192 * 320 * (2 + n)
    x32 = np.asarray(x, np.float32)

    def in_bf16(y):  # exact f32 results, rounded once as the pass's bf16 output is
        return np.asarray(jnp.asarray(y, jnp.bfloat16), np.float32)

    np.testing.assert_array_equal(np.asarray(quant.streaming_pass(x, copies=2), np.float32), in_bf16(x32 * 1.5))
    pairs = np.asarray(quant.streaming_pass(x, copies=1), np.float32)
    np.testing.assert_array_equal(pairs, in_bf16(x32[:, 0::2] + x32[:, 1::2]))


def test_tiny_run_times_both_backends_and_finds_them_equal():
    records = quant.run([quant.SHAPES["ci/x"], quant.SHAPES["ci/w"]], TINY, emit=lambda record: None)
    rows = [(r.shape, r.stage, r.impl) for r in records]
    impls = ["hbm-floor", quant.PEER, "moe_jax:xla", "moe_jax:pallas"]
    x_variants = ("1x128", "1x128+t", "mxfp8", "wgrad", "wgrad+rows")
    expected = [("ci/x", variant, impl) for variant in x_variants for impl in impls]
    expected += [("ci/w", variant, impl) for variant in ("128x128", "128x128 fwd", "128x128+t") for impl in impls]
    assert rows == expected
    assert all(r.status == "ok" and r.timing is not None for r in records)
    assert [r.rel_err for r in records if r.impl == "moe_jax:pallas"] == [0.0] * 8  # no byte differs
    table = quant.markdown_table(records)
    assert table.count("bit-exact") == 8 and "| ci/w | 128x128 |" in table and "| ci/w | 128x128+t |" in table
    assert f"| moe_jax:pallas / {quant.PEER} |" in table


def test_fractions_are_rates_over_the_floors_and_the_peers():
    """A row moving other bytes than the floor (the peer) is compared by rate, not by time."""

    def record(impl, bytes_, seconds):
        timing = common.Timing(seconds, seconds, seconds, seconds, 1, 1, 0.0, "device")
        return common.Record("quant", "s", "-", impl, 0, {"bytes": bytes_}, stage="v", timing=timing)

    records = [record("hbm-floor", 100, 1.0), record(quant.PEER, 60, 1.0), record("moe_jax:pallas", 100, 2.0)]
    cells = [cell.strip() for cell in quant.markdown_table(records).splitlines()[-1].strip("|").split("|")]
    # shape, variant, ms (floor, peer, kernel), GB/s (peer, kernel), roofline (peer, kernel), kernel / peer, check.
    assert cells[5:7] == ["0", "0"] and cells[7:10] == ["60%", "50%", "83%"]
