"""moe_jax: fused Mixture-of-Experts layers for JAX on NVIDIA Hopper.

The public surface (re-exports only): ``route``, ``grouped_matmul``, ``permute``, ``combine``, ``moe_ffn`` and the
Flax NNX modules in ``moe_jax.nn``.
"""

from moe_jax import nn
from moe_jax.ops.grouped_matmul.api import grouped_matmul
from moe_jax.ops.moe_ffn.api import MoEAux, moe_ffn
from moe_jax.ops.permute.api import combine, permute
from moe_jax.ops.routing.api import Routing, apply_capacity, load_balancing_loss, route, z_loss

__all__ = [
    "MoEAux",
    "Routing",
    "apply_capacity",
    "combine",
    "grouped_matmul",
    "load_balancing_loss",
    "moe_ffn",
    "nn",
    "permute",
    "route",
    "z_loss",
]
