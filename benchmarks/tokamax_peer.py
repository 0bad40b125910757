"""tokamax, the peer we measure against: its sm90 Mosaic GPU ragged dot (benchmarks only; moe_jax never imports it).

tokamax is optional. Where it is not installed (CI, CPU hosts) or there is no NVIDIA GPU, every call raises
NotImplementedError, which the benchmarks report as "n/a". On the GPU machine it travels as wheels
(``docs/design.md``, "Benchmarks", gives the commands).

What a user tuning it would sweep: tokamax's own sm90 autotuning space (``PallasMosaicGpuRaggedDot.
_get_sm90_autotuning_configs``) varies block_m in {16, 32, 64, 128}, block_k in {128, 256, 512}, num_stages in {2, 4},
persistent, grid_minor_dim in {M, N} and grid_tile_width in {1, 2, 4, 8}, with block_n fixed at 64 (one 128-byte
swizzle of bf16). The few configs below are the winners that recur in its shipped H100 autotuning cache
(``tokamax/data/autotuning/nvidia_h100_80gb_hbm3/pallas_mosaic_gpu_ragged_dot.json``), plus one wider-N tile from
outside that space. Without a cache hit for the shape, ``implementation="mosaic"`` uses its heuristic config
(block 64x64x128, 2 stages, not persistent).
"""

from collections.abc import Callable

import jax

try:
    import tokamax
    from absl import logging as absl_logging
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as _mosaic

    # tokamax warns once per call shape that its autotuning cache has no entry; the table says which config ran.
    absl_logging.set_verbosity(absl_logging.ERROR)
    _IMPORT_ERROR = ""
except ImportError as error:  # the peer is optional
    tokamax = None
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"

SWEEP_CONFIGS: tuple[dict, ...] = (
    dict(block_m=128, block_n=64, block_k=128, num_stages=4, persistent=True, grid_minor_dim="N", grid_tile_width=8),
    dict(block_m=128, block_n=64, block_k=128, num_stages=4, persistent=True, grid_minor_dim="N", grid_tile_width=4),
    dict(block_m=128, block_n=64, block_k=128, num_stages=2, persistent=False, grid_minor_dim="M", grid_tile_width=1),
    dict(block_m=128, block_n=128, block_k=64, num_stages=4, persistent=True, grid_minor_dim="N", grid_tile_width=4),
)


def version() -> str:
    """tokamax's version, or why it is absent."""
    return tokamax.__version__ if tokamax is not None else f"absent ({_IMPORT_ERROR})"


def unavailable_reason() -> str:
    """Why tokamax's Mosaic GPU ragged dot cannot run here ("" when it can)."""
    if tokamax is None:
        return "tokamax not installed"
    if jax.devices()[0].platform != "gpu":
        return "tokamax's Mosaic GPU ragged dot needs an NVIDIA GPU"
    return ""


def config_label(config: dict) -> str:
    """A short name for a sweep config, e.g. "128x64x128 s4 persistent N/8"."""
    schedule = "persistent" if config["persistent"] else "grid"
    return (
        f"{config['block_m']}x{config['block_n']}x{config['block_k']} s{config['num_stages']} {schedule} "
        f"{config['grid_minor_dim']}/{config['grid_tile_width']}"
    )


def ragged_dot(config: dict | None = None) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`` through tokamax's Mosaic GPU ragged dot.

    ``config=None`` is what a user gets from ``tokamax.ragged_dot(..., implementation="mosaic")``; otherwise one of
    ``SWEEP_CONFIGS``. Gradients go through tokamax's own vjp, whose dgrad/wgrad kernels use their default configs.
    """

    def call(lhs, rhs, group_sizes):
        if reason := unavailable_reason():
            raise NotImplementedError(reason)
        if config is None:
            return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="mosaic")
        minor = _mosaic.common.MatmulDimension[config["grid_minor_dim"]]
        op = _mosaic.PallasMosaicGpuRaggedDot(config=_mosaic.Config(split_k=1, **{**config, "grid_minor_dim": minor}))
        return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=(op,))

    return call
