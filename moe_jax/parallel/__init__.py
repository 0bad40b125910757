"""Expert parallelism under ``jax.shard_map``: ``moe_ffn_expert_parallel``."""

from moe_jax.parallel.expert_parallel import moe_ffn_expert_parallel

__all__ = ["moe_ffn_expert_parallel"]
