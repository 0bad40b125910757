"""``route`` on the sm90 gating kernel: padding, the end of the counting sort, and the backward as ``custom_vjp``.

Forward: the kernel (sm90.py) gates blocks of 64 tokens and returns per-block expert histograms and in-block ranks;
here an exclusive cumsum of the [T/64, E] histogram (tiny) gives every block's first row per expert, and
``position = first[block, expert] + rank`` is the stable expert-sorted row of each assignment (``Routing.positions``).
``sort_indices`` is its inverse: one XLA scatter of T * k int32, no argsort.

Backward: the selection is discrete, so the weights and probs are smooth functions of the logits once the experts
are fixed; their vjp is the reference's arithmetic in XLA on [T, E] (a few element-wise passes over T * E floats,
small next to the forward's T * k-row traffic in permute/combine). The bias gets no gradient, as in the reference.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax._core.hardware import interpret_params
from moe_jax.ops.routing import reference, sm90
from moe_jax.ops.routing.config import BLOCK_TOKENS, heuristic_config
from moe_jax.ops.routing.reference import Routing


@dataclasses.dataclass(frozen=True)
class _Options:
    """The static routing arguments (hashable: a ``nondiff_argnums`` of the custom_vjp)."""

    top_k: int
    score: str
    renormalize: bool
    num_groups: int
    top_groups: int
    scale: float


def _weights_and_probs(logits, experts, options: _Options):
    """The reference's weights [T, k] and probs [T, E] for a fixed selection: what the backward differentiates."""
    return reference.weights_and_probs(
        reference.scores(logits, options.score),
        experts,
        score=options.score,
        renormalize=options.renormalize,
        scale=options.scale,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gate(logits: jax.Array, bias: jax.Array | None, options: _Options):
    """(weights [T, k], probs [T, E], experts [T, k], ranks [T, k], counts [T_pad / 64, E]) from the kernel."""
    num_tokens, num_experts = logits.shape
    config = heuristic_config(num_experts, options.top_k, options.num_groups)
    padded_tokens = -(-num_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
    pad = ((0, padded_tokens - num_tokens), (0, config.padded_experts - num_experts))
    x = jnp.pad(logits.astype(jnp.float32), pad, constant_values=-jnp.inf)
    if bias is not None:
        bias = jnp.pad(bias.astype(jnp.float32), pad[1])
    probs, experts, weights, ranks, counts = sm90.gating(
        x,
        bias,
        num_tokens=num_tokens,
        num_experts=num_experts,
        config=config,
        interpret=interpret_params(),
        **dataclasses.asdict(options),
    )
    return (
        weights[:num_tokens],
        probs[:num_tokens, :num_experts],
        experts[:num_tokens],
        ranks[:num_tokens],
        counts[:, :num_experts],
    )


def _gate_fwd(logits, bias, options):
    outputs = _gate(logits, bias, options)
    return outputs, (logits, outputs[2])


def _gate_bwd(options, residuals, cotangents):
    logits, experts = residuals
    d_weights, d_probs = cotangents[:2]
    _, vjp = jax.vjp(lambda x: _weights_and_probs(x, experts, options), logits.astype(jnp.float32))
    (d_logits,) = vjp((d_weights, d_probs))
    return d_logits.astype(logits.dtype), None


_gate.defvjp(_gate_fwd, _gate_bwd)


def _sort_by_expert(experts, ranks, counts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group_sizes [E], sort_indices [T * k], positions [T, k]) from the kernel's in-block ranks and per-block
    histograms."""
    num_tokens, top_k = experts.shape
    group_sizes = counts.sum(0)
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    block_firsts = group_starts[None, :] + jnp.cumsum(counts, axis=0) - counts  # [blocks, E]: first row per expert
    block = jnp.arange(num_tokens, dtype=jnp.int32) // BLOCK_TOKENS
    positions = block_firsts[block[:, None], experts] + ranks
    num_rows = num_tokens * top_k
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    sort_indices = jnp.zeros((num_rows,), jnp.int32).at[positions.reshape(-1)].set(rows, unique_indices=True)
    return group_sizes, sort_indices, positions


def route(
    logits: jax.Array,
    top_k: int,
    *,
    score: str,
    renormalize: bool,
    num_groups: int,
    top_groups: int,
    bias: jax.Array | None,
    scale: float,
) -> Routing:
    """Kernel routing of [T, E] logits; see ``moe_jax.route`` for the contract."""
    options = _Options(top_k, score, renormalize, num_groups, top_groups, float(scale))
    weights, probs, experts, ranks, counts = _gate(logits, bias, options)
    group_sizes, sort_indices, positions = _sort_by_expert(experts, ranks, counts)
    # Capacity drops by the unbiased selected score (a [T, k] gather; no gradient: the choice is discrete).
    if score == "softmax":
        selected_scores = jnp.take_along_axis(probs, experts, axis=-1)
    else:
        selected_scores = jax.nn.sigmoid(jnp.take_along_axis(logits.astype(jnp.float32), experts, axis=-1))
    return Routing(
        weights, experts, group_sizes, sort_indices, probs, jax.lax.stop_gradient(selected_scores), positions
    )
