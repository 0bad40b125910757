"""Named problem shapes shared by the benchmarks and the tests.

Two registries, each entry tagged "ci" (tiny: tests and the CPU benchmark smoke run), "bench" (the real models the
project targets, which the tuned kernel tables cover), "heuristic" (other models' grouped matmuls, off the tuned tables:
what a user's own model gets from the kernels' config heuristics) or "decode" (qwen3-30b's and gpt-oss-120b's at
decode-sized batches of tokens, 4-64 rows per expert, also off the tables):

- ``GMM_SHAPES``: grouped matmuls (G, M, K, N), one gate_up and one down projection per model;
- ``LAYER_SHAPES``: whole MoE layers (T, D, F, E, k) with their routers' options, for ``moe_ffn`` and for the
  routing glue (``route``, ``permute``, ``combine``).

Routings say how the M rows of a grouped matmul fall into the G groups. The group sizes are drawn on device from a
seed, so a benchmark never moves them through the host:

- "uniform": each row picks an expert uniformly at random (the default);
- "zipf1.2": a row picks the expert of rank r with probability proportional to ``r ** -1.2`` (ranks shuffled);
- "half": one expert (chosen by the seed) takes half the rows, the rest pick uniformly among the other G - 1.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax._core.checks import check_positive_int
from moe_jax.ops.routing.api import RoutingOptions

TAGS = ("ci", "bench", "heuristic", "decode")
ROUTINGS = ("uniform", "zipf1.2", "half")
ZIPF_EXPONENT = 1.2


def _check_tag(tag: str) -> None:
    if tag not in TAGS:
        raise ValueError(f"tag must be one of {TAGS}, got {tag!r}")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulShape:
    """A grouped matmul ``[M, K] x [G, K, N] -> [M, N]`` whose M rows are split into G groups by a routing.

    Attributes:
      name: "<model>/<projection>", e.g. "qwen3-30b/gate_up".
      g: groups (local experts).  m: routed rows.  k: contraction.  n: output columns.
      tag: "ci", "bench", "heuristic" or "decode".
    """

    name: str
    g: int
    m: int
    k: int
    n: int
    tag: str

    def __post_init__(self):
        _check_tag(self.tag)
        for field in ("g", "m", "k", "n"):
            check_positive_int(f"{self.name}: {field}", getattr(self, field))

    def group_sizes(self, routing: str = "uniform", seed: int = 0) -> jax.Array:
        """[G] int32 rows per group, summing to M, drawn on device."""
        return make_group_sizes(jax.random.key(seed), self.g, self.m, routing)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """An MoE layer: T tokens of width D, E experts of hidden width F, k experts per token (M = T * k rows).

    Attributes:
      name: the model, e.g. "qwen3-30b-a3b".
      t, d, f, e, top_k: T, D, F, E, k.
      activation: the gated activation of the experts ("swiglu", "geglu", "gpt_oss").
      tag: "ci", "bench", "heuristic" or "decode".
      score, renormalize, num_groups, top_groups, scale: the router's options, as in ``moe_jax.route``.
      selection_bias: whether the router adds a bias [E] to the scores for selection (DeepSeek-V3's aux-loss-free
        balancing); its values are the user's (benchmarks and tests draw them at random).
    """

    name: str
    t: int
    d: int
    f: int
    e: int
    top_k: int
    activation: str
    tag: str
    score: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    selection_bias: bool = False

    def __post_init__(self):
        _check_tag(self.tag)
        for field in ("t", "d", "f", "e"):
            check_positive_int(f"{self.name}: {field}", getattr(self, field))
        RoutingOptions(
            score=self.score, num_groups=self.num_groups, top_groups=self.top_groups, scale=self.scale
        ).check(self.e, self.top_k)

    @property
    def m(self) -> int:
        """Routed rows T * k."""
        return self.t * self.top_k

    def route_options(self) -> dict:
        """The keyword arguments of ``moe_jax.route`` (and ``moe_ffn``) for this router, all but ``bias``."""
        return dict(
            score=self.score,
            renormalize=self.renormalize,
            num_groups=self.num_groups,
            top_groups=self.top_groups,
            scale=self.scale,
        )


def make_group_sizes(key: jax.Array, num_groups: int, num_rows: int, routing: str) -> jax.Array:
    """[num_groups] int32 group sizes summing to ``num_rows``: every row draws its group under ``routing``."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    return _draw_group_sizes(key, num_groups, num_rows, routing)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_group_sizes(key: jax.Array, num_groups: int, num_rows: int, routing: str) -> jax.Array:
    pick_key, shuffle_key = jax.random.split(key)
    if routing == "uniform":
        groups = jax.random.randint(pick_key, (num_rows,), 0, num_groups)
    elif routing == "zipf1.2":
        log_weights = -ZIPF_EXPONENT * jnp.log(jnp.arange(1, num_groups + 1, dtype=jnp.float32))
        ranks = jax.random.categorical(pick_key, log_weights, shape=(num_rows,))
        # Which expert is the hot one should not always be expert 0 (a kernel's schedule may favour the first group).
        groups = jax.random.permutation(shuffle_key, num_groups)[ranks]
    else:  # "half"
        hot = jax.random.randint(shuffle_key, (), 0, num_groups)
        # Cold rows pick among the G - 1 other experts: draw in [0, G - 1) and step over the hot one.
        cold = jax.random.randint(pick_key, (num_rows,), 0, max(num_groups - 1, 1))
        cold = jnp.where(cold >= hot, cold + 1, cold) if num_groups > 1 else cold
        groups = jnp.where(jnp.arange(num_rows) < num_rows // 2, hot, cold)
    return jnp.zeros((num_groups,), jnp.int32).at[groups].add(1)


GMM_SHAPES: dict[str, GroupedMatmulShape] = {
    shape.name: shape
    for shape in (
        # Tiny shapes: K and N multiples of 64 so a kernel's tiles fit; "ci/ragged" has M off every tile multiple.
        GroupedMatmulShape("ci/gate_up", g=4, m=256, k=128, n=256, tag="ci"),
        GroupedMatmulShape("ci/down", g=4, m=256, k=128, n=128, tag="ci"),
        GroupedMatmulShape("ci/ragged", g=5, m=200, k=128, n=64, tag="ci"),
        GroupedMatmulShape("qwen3-30b/gate_up", g=128, m=32768, k=2048, n=1536, tag="bench"),
        GroupedMatmulShape("qwen3-30b/down", g=128, m=32768, k=768, n=2048, tag="bench"),
        GroupedMatmulShape("gpt-oss-120b/gate_up", g=128, m=32768, k=2880, n=5760, tag="bench"),
        GroupedMatmulShape("gpt-oss-120b/down", g=128, m=32768, k=2880, n=2880, tag="bench"),
        GroupedMatmulShape("dsv3-ep8/gate_up", g=32, m=32768, k=7168, n=4096, tag="bench"),
        GroupedMatmulShape("dsv3-ep8/down", g=32, m=32768, k=2048, n=7168, tag="bench"),
        GroupedMatmulShape("mixtral/gate_up", g=8, m=16384, k=4096, n=28672, tag="bench"),
        GroupedMatmulShape("mixtral/down", g=8, m=16384, k=14336, n=4096, tag="bench"),
        # Other open MoE models (public configs: hidden D, expert width F, E experts, top k), M = T * k rows at T =
        # 4096 tokens (8192 for phi3.5-moe's top-2). gate_up is [M, D] x [E, D, 2F], down [M, F] x [E, F, D].
        GroupedMatmulShape("olmoe-1b-7b/gate_up", g=64, m=32768, k=2048, n=2048, tag="heuristic"),
        GroupedMatmulShape("olmoe-1b-7b/down", g=64, m=32768, k=1024, n=2048, tag="heuristic"),
        GroupedMatmulShape("deepseek-v2-lite/gate_up", g=64, m=24576, k=2048, n=2816, tag="heuristic"),
        GroupedMatmulShape("deepseek-v2-lite/down", g=64, m=24576, k=1408, n=2048, tag="heuristic"),
        GroupedMatmulShape("qwen3-235b/gate_up", g=128, m=32768, k=4096, n=3072, tag="heuristic"),
        GroupedMatmulShape("qwen3-235b/down", g=128, m=32768, k=1536, n=4096, tag="heuristic"),
        GroupedMatmulShape("phi3.5-moe/gate_up", g=16, m=16384, k=4096, n=12800, tag="heuristic"),
        GroupedMatmulShape("phi3.5-moe/down", g=16, m=16384, k=6400, n=4096, tag="heuristic"),
        GroupedMatmulShape("granite-3b/gate_up", g=40, m=32768, k=1536, n=1024, tag="heuristic"),
        GroupedMatmulShape("granite-3b/down", g=40, m=32768, k=512, n=1536, tag="heuristic"),
        # train's gpu-moe shared expert: one group of a micro-batch's 16k tokens.
        GroupedMatmulShape("gpu-moe-shared/gate_up", g=1, m=16384, k=2048, n=1536, tag="heuristic"),
        GroupedMatmulShape("gpu-moe-shared/down", g=1, m=16384, k=768, n=2048, tag="heuristic"),
        # qwen3-30b's and gpt-oss-120b's projections at T = 128 tokens (a decode step's batch: 8 / 4 rows an expert)
        # and qwen3-30b's at T = 1024 (64): reading the weights is the whole cost, so the benches' hbm-floor row is
        # the bar.
        GroupedMatmulShape("qwen3-30b-t128/gate_up", g=128, m=1024, k=2048, n=1536, tag="decode"),
        GroupedMatmulShape("qwen3-30b-t128/down", g=128, m=1024, k=768, n=2048, tag="decode"),
        GroupedMatmulShape("gpt-oss-120b-t128/gate_up", g=128, m=512, k=2880, n=5760, tag="decode"),
        GroupedMatmulShape("gpt-oss-120b-t128/down", g=128, m=512, k=2880, n=2880, tag="decode"),
        GroupedMatmulShape("qwen3-30b-t1024/gate_up", g=128, m=8192, k=2048, n=1536, tag="decode"),
        GroupedMatmulShape("qwen3-30b-t1024/down", g=128, m=8192, k=768, n=2048, tag="decode"),
    )
}

LAYER_SHAPES: dict[str, LayerShape] = {
    shape.name: shape
    for shape in (
        LayerShape("ci/layer", t=64, d=128, f=64, e=4, top_k=2, activation="swiglu", tag="ci"),
        # DeepSeek-V3's router at a tiny size: sigmoid, group-limited (2 of 4 groups eligible), bias, scale.
        LayerShape(
            "ci/grouped",
            t=64,
            d=128,
            f=64,
            e=8,
            top_k=2,
            activation="swiglu",
            tag="ci",
            score="sigmoid",
            num_groups=4,
            top_groups=2,
            scale=2.5,
            selection_bias=True,
        ),
        LayerShape("qwen3-30b-a3b", t=16384, d=2048, f=768, e=128, top_k=8, activation="swiglu", tag="bench"),
        # gpt-oss-120b's MoE layer: its router takes the top 4 logits and a softmax over them (= softmax, then
        # renormalised); D = 2880 is no multiple of 128.
        LayerShape("gpt-oss-120b", t=16384, d=2880, f=2880, e=128, top_k=4, activation="gpt_oss", tag="bench"),
        # Mixtral 8x7B's MoE layer: coarse experts, top-2 (fewer than the expert-parallel devices: where an
        # all-to-all sends less than an all-gather).
        LayerShape("mixtral-8x7b", t=16384, d=4096, f=14336, e=8, top_k=2, activation="swiglu", tag="bench"),
        # DeepSeek-V3's MoE layer (256 routed experts of width 2048; its shared expert is not part of this layer):
        # sigmoid scores, 8 groups of which the best 4 are eligible, an aux-loss-free selection bias, weights x 2.5.
        LayerShape(
            "deepseek-v3",
            t=16384,
            d=7168,
            f=2048,
            e=256,
            top_k=8,
            activation="swiglu",
            tag="bench",
            score="sigmoid",
            num_groups=8,
            top_groups=4,
            scale=2.5,
            selection_bias=True,
        ),
        # Decode steps: the first two bench layers at T = 128 tokens.
        LayerShape("qwen3-30b-a3b-t128", t=128, d=2048, f=768, e=128, top_k=8, activation="swiglu", tag="decode"),
        LayerShape("gpt-oss-120b-t128", t=128, d=2880, f=2880, e=128, top_k=4, activation="gpt_oss", tag="decode"),
    )
}


def gmm_shapes(tag: str) -> list[GroupedMatmulShape]:
    """The grouped-matmul shapes carrying ``tag``, in registry order."""
    _check_tag(tag)
    return [shape for shape in GMM_SHAPES.values() if shape.tag == tag]


def layer_shapes(tag: str) -> list[LayerShape]:
    """The layer shapes carrying ``tag``, in registry order."""
    _check_tag(tag)
    return [shape for shape in LAYER_SHAPES.values() if shape.tag == tag]
