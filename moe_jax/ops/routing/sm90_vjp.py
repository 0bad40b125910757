"""``route`` on the sm90 gating kernel: padding, the end of the counting sort, and the backward as ``custom_vjp``.

Forward: the kernel (sm90.py) gates blocks of 64 tokens and returns per-block expert histograms and in-block ranks;
here an exclusive cumsum of the [T/64, E] histogram (tiny) gives every block's first row per expert, and
``position = first[block, expert] + rank`` is the stable expert-sorted row of each assignment (``Routing.positions``).
``sort_indices`` is its inverse: one XLA scatter of T * k int32, no argsort.

Where that is faster (``config.kernel_statistics``: softmax routers) the kernel also returns what the aux losses
average, so that they need no pass over [T, E] of their own: each token's logsumexp (``Routing.logsumexp``, the
z-loss's) and per-block column sums of probs, of which the mean over tokens (``Routing.mean_probs``, the
load-balancing loss's) is a sum over T / 64 rows here. Elsewhere XLA computes both from the logits and probs.

Backward: the selection is discrete, so the weights, probs and the kernel's statistics are smooth functions of the
logits once the experts are fixed; their vjp is the reference's arithmetic in XLA on [T, E] (a few element-wise
passes over T * E floats, small next to the forward's T * k-row traffic in permute/combine), restricted to the
outputs that received a cotangent. The bias gets no gradient, as in the reference.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from moe_jax._core.hardware import interpret_params
from moe_jax.ops.routing import config as routing_config
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
    statistics: bool  # the kernel computes the aux losses' statistics (``routing_config.kernel_statistics``)


def _smooth_outputs(logits, experts, options: _Options):
    """The reference's weights [T, k] and probs [T, E] for a fixed selection, and with ``options.statistics`` the
    logsumexp [T] and per-block column sums of probs [T_pad / 64, E]: what the backward differentiates."""
    logits = logits.astype(jnp.float32)
    weights, probs = reference.weights_and_probs(
        reference.scores(logits, options.score),
        experts,
        score=options.score,
        renormalize=options.renormalize,
        scale=options.scale,
    )
    if not options.statistics:
        return weights, probs
    num_tokens, num_experts = probs.shape
    padded = jnp.pad(probs, ((0, _padded_tokens(num_tokens) - num_tokens), (0, 0)))
    prob_sums = padded.reshape(-1, BLOCK_TOKENS, num_experts).sum(1)
    return weights, probs, reference.token_logsumexp(logits), prob_sums


def _padded_tokens(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_TOKENS) * BLOCK_TOKENS


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gate(logits: jax.Array, bias: jax.Array | None, options: _Options):
    """From the kernel: the smooth outputs (``_smooth_outputs``'s) and the selection (experts [T, k], ranks [T, k],
    counts [T_pad / 64, E])."""
    num_tokens, num_experts = logits.shape
    config = heuristic_config(num_experts, options.top_k, options.num_groups)
    pad = ((0, _padded_tokens(num_tokens) - num_tokens), (0, config.padded_experts - num_experts))
    x = jnp.pad(logits.astype(jnp.float32), pad, constant_values=-jnp.inf)
    if bias is not None:
        bias = jnp.pad(bias.astype(jnp.float32), pad[1])
    probs, experts, weights, ranks, counts, *statistics = sm90.gating(
        x,
        bias,
        num_tokens=num_tokens,
        num_experts=num_experts,
        config=config,
        interpret=interpret_params(),
        **dataclasses.asdict(options),
    )
    smooth = (weights[:num_tokens], probs[:num_tokens, :num_experts])
    if options.statistics:
        logsumexp, prob_sums = statistics
        smooth += (logsumexp[:num_tokens], prob_sums[:, :num_experts])
    return smooth, (experts[:num_tokens], ranks[:num_tokens], counts[:, :num_experts])


def _gate_fwd(logits, bias, options):
    # symbolic_zeros: the arguments come as CustomVJPPrimal (bias, when None, is an empty pytree).
    logits = logits.value
    outputs = _gate(logits, None if bias is None else bias.value, options)
    return outputs, (logits, outputs[1][0])


def _gate_bwd(options, residuals, cotangents):
    """The vjp of the smooth outputs that have a cotangent (a caller that reads neither the probs nor the statistics
    pays for none of them); the bias gets none, as in the reference."""
    logits, experts = residuals
    used = [i for i, cotangent in enumerate(cotangents[0]) if not isinstance(cotangent, SymbolicZero)]
    if not used:
        return jnp.zeros_like(logits), None
    _, vjp = jax.vjp(lambda x: [_smooth_outputs(x, experts, options)[i] for i in used], logits.astype(jnp.float32))
    (d_logits,) = vjp([cotangents[0][i] for i in used])
    return d_logits.astype(logits.dtype), None


_gate.defvjp(_gate_fwd, _gate_bwd, symbolic_zeros=True)


def _sort_by_expert(experts, ranks, counts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group_sizes [E], sort_indices [T * k], positions [T, k]) from the kernel's in-block ranks and per-block
    histograms (counts [T_pad / 64, E]).

    Written for what XLA makes of it on the GPU (docs/kernels/routing.md, "The counting sort's end in XLA"): the
    group sizes are the cumsum's last row, not a sum of their own, which XLA made the hero of the cumsum's fusion and
    ran on 2 CTAs; and the positions gather from the flattened [blocks * E] first rows, which XLA fuses with the clamp
    that a caller's positions get.
    """
    num_tokens, top_k = experts.shape
    num_experts = counts.shape[1]
    through_block = jnp.cumsum(counts, axis=0)
    group_sizes = through_block[-1]
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    block_firsts = group_starts[None, :] + through_block - counts  # [blocks, E]: first row per expert
    block = jnp.arange(num_tokens, dtype=jnp.int32) // BLOCK_TOKENS
    positions = block_firsts.reshape(-1)[block[:, None] * num_experts + experts] + ranks
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
    options = _Options(
        top_k, score, renormalize, num_groups, top_groups, float(scale), routing_config.kernel_statistics(score)
    )
    (weights, probs, *statistics), (experts, ranks, counts) = _gate(logits, bias, options)
    if statistics:
        logsumexp, prob_sums = statistics
        mean_probs = prob_sums.sum(0) / logits.shape[0]
    else:
        logsumexp = reference.token_logsumexp(logits.astype(jnp.float32))
        mean_probs = probs.mean(0)
    group_sizes, sort_indices, positions = _sort_by_expert(experts, ranks, counts)
    # Capacity drops by the unbiased selected score (a [T, k] gather; no gradient: the choice is discrete).
    if score == "softmax":
        selected_scores = jnp.take_along_axis(probs, experts, axis=-1)
    else:
        selected_scores = jax.nn.sigmoid(jnp.take_along_axis(logits.astype(jnp.float32), experts, axis=-1))
    return Routing(
        weights=weights,
        experts=experts,
        group_sizes=group_sizes,
        sort_indices=sort_indices,
        probs=probs,
        selected_scores=jax.lax.stop_gradient(selected_scores),
        positions=positions,
        mean_probs=mean_probs,
        logsumexp=logsumexp,
    )
