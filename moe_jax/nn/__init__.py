"""Flax NNX modules over the moe_jax ops."""

from moe_jax.nn.moe import MoE, Router, RouterBias, SharedExperts, update_balancing_biases

__all__ = ["MoE", "Router", "RouterBias", "SharedExperts", "update_balancing_biases"]
