"""Decoder-only byte-level transformer whose feed-forward layers are ``moe_jax.nn.MoE``.

Pre-norm blocks ``x + Attention(RMSNorm(x))`` then ``x + MoE(RMSNorm(x))``; causal attention with rotary positions
through ``jax.nn.dot_product_attention`` (cuDNN's fused kernel or plain XLA, ``attention_implementation``). Every
parameter carries sharding names: the stacked expert weights are sharded over the mesh's "expert" axis
(``moe_jax.nn.moe.EXPERT_AXIS``), everything else is replicated.

With ``ModelConfig.scan_layers`` the L identical blocks are one ``Block`` whose parameters carry a leading layer
axis [L, ...] (made by ``nnx.vmap``), applied by ``jax.lax.scan``: the step traces, lowers and compiles one block
(its Mosaic GPU kernels included) instead of L copies; ``ModelConfig.unroll_layers`` unrolls that scan (lowered
once still, compiled L times, and no loop's stacked buffers). Without it, ``blocks`` is a list of L blocks.
Shapes: B batch, S sequence, D model, H heads, Dh head size, V vocabulary, L layers, E experts.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.nn import MoE
from moe_jax.ops.moe_ffn.api import MoEAux
from moe_jax.ops.routing.api import balancing_bias_update
from train.configs import ModelConfig

# The compute dtypes cuDNN's fused attention takes, and its largest head size.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 128


def replicated_param(value: jax.Array) -> nnx.Param:
    """A parameter replicated over the mesh; placed eagerly when a mesh is set (as ``moe_jax.nn`` does)."""
    eager = not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(value, out_sharding=(None,) * value.ndim, eager_sharding=eager)


def attention_implementation(config: ModelConfig, platform: str) -> str:
    """The ``jax.nn.dot_product_attention`` implementation the model runs on ``platform`` ("gpu", "cpu", ...).

    "auto" takes cuDNN where its fused kernel applies (a GPU, bf16/f16, head sizes a multiple of 8 up to 128) and XLA
    elsewhere; "cudnn" where it does not apply is a ValueError naming what is missing.
    """
    fits = (
        platform == "gpu"
        and config.compute_dtype in CUDNN_DTYPES
        and config.head_dim % 8 == 0
        and config.head_dim <= CUDNN_MAX_HEAD_DIM
    )
    if config.attention == "auto":
        return "cudnn" if fits else "xla"
    if config.attention == "cudnn" and not fits:
        raise ValueError(
            f"ModelConfig.attention='cudnn' needs a GPU, a bf16/f16 dtype and a head size that is a multiple of 8 up "
            f"to {CUDNN_MAX_HEAD_DIM}; got platform {platform!r}, dtype {config.dtype}, head size {config.head_dim}"
        )
    return config.attention


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
    def __init__(self, config: ModelConfig, *, implementation: str, rngs: nnx.Rngs):
        d, h, dh = config.d_model, config.num_heads, config.head_dim
        dtype = config.params_dtype
        self.qkv = replicated_param(nnx.initializers.normal(d**-0.5)(rngs.params(), (d, 3, h, dh), dtype))
        # Residual-branch outputs start small so that deep stacks begin close to the identity.
        out_std = (h * dh) ** -0.5 / (2 * config.num_layers) ** 0.5
        self.out = replicated_param(nnx.initializers.normal(out_std)(rngs.params(), (h, dh, d), dtype))
        self.config = config
        self.implementation = implementation

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, S, D] -> [B, S, D]."""
        # One projection each: q, k and v come out [B, S, H, Dh] as attention takes them. Projected together
        # ("bsd,dthe->tbshe") they need a transpose forward and a stack and a transpose backward.
        w_qkv = self.qkv[...].astype(x.dtype)
        q, k, v = (jnp.einsum("bsd,dhe->bshe", x, w_qkv[:, t]) for t in range(3))
        q, k = rotary(q, self.config.rope_base), rotary(k, self.config.rope_base)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
        return jnp.einsum("bshe,hed->bsd", attended, self.out[...].astype(x.dtype))


def moe_with_aux(moe: MoE, x: jax.Array) -> tuple[jax.Array, MoEAux]:
    """``moe(x)`` and the ``MoEAux`` it sowed, returned rather than stored (so that it can leave a scan or remat)."""
    y, intermediates = nnx.capture(moe, nnx.Intermediate)(x)
    (aux,) = intermediates["moe_aux"].get_value()
    return y, aux


# remat "moe": the MoE sublayer keeps its input and its dot_generals without batch dimensions, the router logits and
# the shared expert's two dense products (the routed experts' matmuls are Mosaic GPU kernels or ragged_dot), and
# recomputes the gating, permutation and routed experts' GLU in the backward.
_moe_with_aux_remat = nnx.remat(
    moe_with_aux, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable, graph=False
)


class Block(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, backend: str, expert_parallel: bool, dispatch: str, attention: str, rngs: nnx.Rngs
    ):
        self.attention_norm = RMSNorm(config.d_model, param_dtype=config.params_dtype)
        self.attention = Attention(config, implementation=attention, rngs=rngs)
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
            quantization=config.quantization,
            expert_parallel=expert_parallel,
            dispatch=dispatch,
            rngs=rngs,
        )
        self.remat_moe = config.remat == "moe"

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux]:
        """x: [B, S, D] -> (x' [B, S, D], the MoE layer's ``MoEAux``).

        The sublayers trace under the name scopes "attention" and "moe", which ``train.profile_step`` reads."""
        with jax.named_scope("attention"):
            x = x + self.attention(self.attention_norm(x))
        moe = _moe_with_aux_remat if self.remat_moe else moe_with_aux
        with jax.named_scope("moe"):
            y, aux = moe(self.moe, self.moe_norm(x))
        return x + y, aux


def _block_call(block: Block, x: jax.Array) -> tuple[jax.Array, MoEAux]:
    return block(x)


# remat "full": a block keeps only its input; everything inside is recomputed in the backward.
_block_call_remat = nnx.remat(_block_call, policy=jax.checkpoint_policies.nothing_saveable, graph=False)


class Transformer(nnx.Module):
    """Byte-level MoE language model: ``__call__(tokens [B, S] int) -> logits [B, S, V] f32``.

    The forward sows the L layers' ``MoEAux``, stacked ([L] scalars, expert counts [L, E]), as ``nnx.Intermediate``
    "moe_aux" of the model (collect with ``nnx.capture(model, nnx.Intermediate)``; see ``layer_aux``).
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
        attention = attention_implementation(config, jax.devices()[0].platform)
        block = functools.partial(
            Block, config, backend=backend, expert_parallel=expert_parallel, dispatch=dispatch, attention=attention
        )
        if config.scan_layers:
            self.blocks = _stacked_blocks(block, config.num_layers, rngs)
        else:
            self.blocks = nnx.List([block(rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.d_model, param_dtype=dtype)
        head_init = nnx.initializers.normal(config.d_model**-0.5)
        self.head = replicated_param(head_init(rngs.params(), (config.d_model, config.vocab_size), dtype))
        self.config = config

    def __call__(self, tokens: jax.Array) -> jax.Array:
        dtype = self.config.compute_dtype
        # The lookup as a one-hot matmul: a gather's gradient is a scatter-add, whose atomics collide on the rows of
        # frequent bytes (on text, an eighth of a step's time on an H200); the matmul's is one small GEMM.
        one_hot = jax.nn.one_hot(tokens, self.config.vocab_size, dtype=dtype)
        x = jnp.einsum("bsv,vd->bsd", one_hot, self.embed[...].astype(dtype))
        call = _block_call_remat if self.config.remat == "full" else _block_call
        if self.config.scan_layers:
            graphdef, layers = nnx.split(self.blocks)

            def layer(x, layer_state):
                return call(nnx.merge(graphdef, layer_state), x)

            x, aux = jax.lax.scan(layer, x, layers, unroll=self.config.unroll_layers)
        else:
            auxes = []
            for block in self.blocks:
                x, block_aux = call(block, x)
                auxes.append(block_aux)
            aux = jax.tree.map(lambda *values: jnp.stack(values), *auxes)
        self.sow(nnx.Intermediate, "moe_aux", aux, capture_noop=True)
        x = self.final_norm(x)
        return jnp.einsum("bsd,dv->bsv", x, self.head[...].astype(dtype), preferred_element_type=jnp.float32)

    def update_balancing_biases(self, expert_counts: jax.Array, rate: float) -> None:
        """One aux-loss-free balancing step of every layer's router bias from expert_counts [L, E] (``MoEAux``)."""
        if self.config.scan_layers:
            bias = self.blocks.moe.router.bias  # [L, E], or None without balance_bias
            if bias is not None:
                bias[...] = jax.vmap(functools.partial(balancing_bias_update, rate=rate))(bias[...], expert_counts)
        else:
            for block, counts in zip(self.blocks, expert_counts, strict=True):
                block.moe.update_bias(counts, rate)


def _stacked_blocks(make_block, num_layers: int, rngs: nnx.Rngs) -> Block:
    """One ``Block`` whose parameters are ``num_layers`` independently initialised blocks' stacked on axis 0; the
    sharding names get a leading None (the layer axis is never split)."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(rngs):
        return make_block(rngs=rngs)

    return make(rngs)


def layer_aux(intermediates: nnx.State) -> MoEAux:
    """The L layers' ``MoEAux`` (leaves stacked on a leading [L] axis) from ``nnx.capture``'s intermediates."""
    (aux,) = intermediates["moe_aux"].get_value()
    return aux


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
