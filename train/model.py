"""Decoder-only byte-level transformer whose feed-forward layers are ``moe_jax.nn.MoE``.

Pre-norm blocks ``x + Attention(RMSNorm(x))`` then ``x + MoE(RMSNorm(x))``; causal attention with rotary positions
through ``jax.nn.dot_product_attention`` (plain XLA). Every parameter carries sharding names: the stacked expert
weights are sharded over the mesh's "expert" axis (``moe_jax.nn.moe.EXPERT_AXIS``), everything else is replicated.
Shapes: B batch, S sequence, D model, H heads, Dh head size, V vocabulary.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.nn import MoE
from train.configs import ModelConfig


def replicated_param(value: jax.Array) -> nnx.Param:
    """A parameter replicated over the mesh; placed eagerly when a mesh is set (as ``moe_jax.nn`` does)."""
    eager = not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(value, out_sharding=(None,) * value.ndim, eager_sharding=eager)


class RMSNorm(nnx.Module):
    def __init__(self, d_model: int, *, param_dtype):
        self.scale = replicated_param(jnp.ones((d_model,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D]; normalised in f32, returned in x's dtype."""
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (x32 * scale).astype(x.dtype)


def rotary(x: jax.Array, base: float) -> jax.Array:
    """Rotates [B, S, H, Dh] query/key pairs (first half, second half) by position-dependent angles."""
    seq_len, head_dim = x.shape[1], x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [S, Dh/2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h, dh = config.d_model, config.num_heads, config.head_dim
        dtype = config.params_dtype
        self.qkv = replicated_param(nnx.initializers.normal(d**-0.5)(rngs.params(), (d, 3, h, dh), dtype))
        # Residual-branch outputs start small so that deep stacks begin close to the identity.
        out_std = (h * dh) ** -0.5 / (2 * config.num_layers) ** 0.5
        self.out = replicated_param(nnx.initializers.normal(out_std)(rngs.params(), (h, dh, d), dtype))
        self.config = config

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, S, D] -> [B, S, D]."""
        q, k, v = jnp.unstack(jnp.einsum("bsd,dthe->tbshe", x, self.qkv[...].astype(x.dtype)), axis=0)
        q, k = rotary(q, self.config.rope_base), rotary(k, self.config.rope_base)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.einsum("bshe,hed->bsd", attended, self.out[...].astype(x.dtype))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, backend: str, expert_parallel: bool, dispatch: str, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm(config.d_model, param_dtype=config.params_dtype)
        self.attention = Attention(config, rngs=rngs)
        self.moe_norm = RMSNorm(config.d_model, param_dtype=config.params_dtype)
        self.moe = MoE(
            config.d_model,
            config.d_ff,
            config.num_experts,
            config.top_k,
            activation=config.activation,
            score=config.score,
            capacity_factor=config.capacity_factor,
            balance_bias=config.balance_bias,
            num_shared_experts=config.num_shared_experts,
            dtype=config.compute_dtype,
            param_dtype=config.params_dtype,
            backend=backend,
            expert_parallel=expert_parallel,
            dispatch=dispatch,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.moe_norm(x))


class Transformer(nnx.Module):
    """Byte-level MoE language model: ``__call__(tokens [B, S] int) -> logits [B, S, V] f32``.

    Each MoE layer sows its ``MoEAux`` (collect with ``nnx.capture(model, nnx.Intermediate)``; see ``layer_aux``).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        backend: str = "auto",
        expert_parallel: bool = False,
        dispatch: str = "auto",
        rngs: nnx.Rngs,
    ):
        dtype = config.params_dtype
        self.embed = replicated_param(
            nnx.initializers.normal(1.0)(rngs.params(), (config.vocab_size, config.d_model), dtype)
        )
        block = functools.partial(
            Block, config, backend=backend, expert_parallel=expert_parallel, dispatch=dispatch, rngs=rngs
        )
        self.blocks = nnx.List([block() for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.d_model, param_dtype=dtype)
        head_init = nnx.initializers.normal(config.d_model**-0.5)
        self.head = replicated_param(head_init(rngs.params(), (config.d_model, config.vocab_size), dtype))
        self.config = config

    def __call__(self, tokens: jax.Array) -> jax.Array:
        dtype = self.config.compute_dtype
        x = self.embed[...].astype(dtype)[tokens]
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        return jnp.einsum("bsd,dv->bsv", x, self.head[...].astype(dtype), preferred_element_type=jnp.float32)


def layer_aux(intermediates: nnx.State) -> list:
    """The ``MoEAux`` each block's MoE sowed, in layer order, from ``nnx.capture``'s intermediates."""
    by_layer = {}
    for path, value in nnx.to_flat_state(intermediates):
        if len(path) >= 4 and path[0] == "blocks" and path[-2:] == ("moe", "moe_aux"):
            (by_layer[path[1]],) = value.get_value()
    return [by_layer[i] for i in sorted(by_layer)]


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters: "total", and "active" per token (the k routed experts instead of all E; no embedding lookup)."""
    d, f, e, k, v = config.d_model, config.d_ff, config.num_experts, config.top_k, config.vocab_size
    attention = 4 * d * d
    expert = 3 * d * f
    shared = 3 * d * f * config.num_shared_experts
    per_layer_fixed = attention + d * e + shared + 2 * d
    total = config.num_layers * (per_layer_fixed + e * expert) + 2 * v * d + d
    active = config.num_layers * (per_layer_fixed + k * expert) + v * d
    return {"total": total, "active": active}
