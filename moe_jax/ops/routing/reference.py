"""Pure-JAX routing: scores, (group-limited) top-k selection, weights, counts and the expert-sorted permutation.

This is the unfused baseline, the CPU path and the oracle for the gating kernel. Glossary: T tokens, E experts,
k experts per token; an *assignment* is one (token, slot) pair, flat index ``t * k + j``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from moe_jax._core.checks import accumulation_dtype
from moe_jax.ops.permute.reference import inverse_permutation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where every token goes, and with what weight.

    Attributes:
      weights: [T, k] f32 — the selected (unbiased) scores, renormalised if asked, times ``scale``.
      experts: [T, k] int32 — selected expert ids, in descending (biased) score order, ties to the lower id.
      group_sizes: [E] int32 — assignments per expert (``sum == T * k``).
      sort_indices: [T * k] int32 — the assignments sorted by expert, stably (by token, then slot, within an
        expert): position ``p`` of the expert-sorted rows holds assignment ``sort_indices[p]``.
      probs: [T, E] f32 — the unbiased scores normalised to sum 1 per token (softmax probabilities, or sigmoid scores
        divided by their sum); what the load-balancing loss averages.
      selected_scores: [T, k] f32 — the unbiased scores of the selected experts, before renormalisation and scale:
        the routing score by which a capacity limit drops assignments (comparable across tokens, unlike weights).
      positions: [T, k] int32 — the expert-sorted row of each assignment, the inverse of ``sort_indices``
        (``sort_indices[positions[t, j]] == t * k + j``); ``permute`` and ``combine`` take it to skip inverting
        ``sort_indices`` themselves.
      mean_probs: [E] f32 — ``probs`` averaged over the T tokens: the load-balancing loss's P.
      logsumexp: [T] f32 — each token's ``logsumexp`` of its logits: what the z-loss squares and averages.
    """

    weights: jax.Array
    experts: jax.Array
    group_sizes: jax.Array
    sort_indices: jax.Array
    probs: jax.Array
    selected_scores: jax.Array
    positions: jax.Array
    mean_probs: jax.Array
    logsumexp: jax.Array

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]

    @property
    def sorted_weights(self) -> jax.Array:
        """[T * k] f32: the routing weight of each expert-sorted row."""
        return self.weights.reshape(-1)[self.sort_indices]


def scores(logits: jax.Array, score: str) -> jax.Array:
    """[T, E] f32 scores (f64 for f64 logits): softmax over experts or elementwise sigmoid."""
    logits = logits.astype(accumulation_dtype(logits.dtype))
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def token_logsumexp(logits: jax.Array) -> jax.Array:
    """[T] logsumexp of each token's [T, E] logits, in f32 (f64 for f64 logits): what the z-loss squares."""
    return jax.nn.logsumexp(logits.astype(accumulation_dtype(logits.dtype)), axis=-1)


def _nan_to_minus_inf(selection: jax.Array) -> jax.Array:
    """NaN never wins a selection: it ranks with -inf (ties to the lower index), so every expert id stays in range."""
    return jnp.where(jnp.isnan(selection), -jnp.inf, selection)


def _restrict_to_top_groups(selection: jax.Array, num_groups: int, top_groups: int) -> jax.Array:
    """Sets to -inf every expert outside the ``top_groups`` best of ``num_groups`` contiguous groups.

    A group's score is the sum of its two best selection scores (DeepSeek-V3), or its only score for groups of one.
    """
    num_tokens, num_experts = selection.shape
    grouped = selection.reshape(num_tokens, num_groups, num_experts // num_groups)
    best_in_group = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
    group_scores = _nan_to_minus_inf(best_in_group.sum(-1))  # NaN from inf + (-inf) biases
    _, chosen_groups = jax.lax.top_k(group_scores, top_groups)  # [T, top_groups]
    group_mask = jnp.zeros((num_tokens, num_groups), bool)
    group_mask = group_mask.at[jnp.arange(num_tokens)[:, None], chosen_groups].set(True)
    expert_mask = jnp.repeat(group_mask, num_experts // num_groups, axis=1)
    return jnp.where(expert_mask, selection, -jnp.inf)


def select_experts(
    expert_scores: jax.Array,
    top_k: int,
    *,
    num_groups: int = 1,
    top_groups: int = 1,
    bias: jax.Array | None = None,
) -> jax.Array:
    """[T, k] int32 expert ids: the best ``top_k`` of ``expert_scores + bias`` within the eligible groups."""
    selection = expert_scores if bias is None else expert_scores + bias.astype(expert_scores.dtype)[None, :]
    selection = _nan_to_minus_inf(selection)
    if num_groups > 1:
        selection = _restrict_to_top_groups(selection, num_groups, top_groups)
    return jax.lax.top_k(selection, top_k)[1].astype(jnp.int32)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Returns (group_sizes [E] int32, sort_indices [T * k] int32) for the [T, k] selection ``experts``."""
    flat = experts.reshape(-1)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    sort_indices = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return group_sizes, sort_indices


def weights_and_probs(
    expert_scores: jax.Array, experts: jax.Array, *, score: str, renormalize: bool, scale: float
) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k], probs [T, E]) from scores [T, E] and a fixed selection ``experts`` [T, k]: the selected
    scores (renormalised, scaled), and the scores normalised per token (what the load-balancing loss averages).

    The one definition of both: the Pallas backward differentiates this function for the kernel's selection.
    """
    weights = jnp.take_along_axis(expert_scores, experts, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    probs = expert_scores if score == "softmax" else expert_scores / expert_scores.sum(-1, keepdims=True)
    return weights * scale, probs


def route(
    logits: jax.Array,
    top_k: int,
    *,
    score: str = "softmax",
    renormalize: bool = True,
    num_groups: int = 1,
    top_groups: int = 1,
    bias: jax.Array | None = None,
    scale: float = 1.0,
) -> Routing:
    """Reference routing of [T, E] logits; see ``moe_jax.route`` for the contract."""
    logits = logits.astype(accumulation_dtype(logits.dtype))
    expert_scores = scores(logits, score)
    experts = select_experts(expert_scores, top_k, num_groups=num_groups, top_groups=top_groups, bias=bias)
    weights, probs = weights_and_probs(expert_scores, experts, score=score, renormalize=renormalize, scale=scale)
    selected_scores = jnp.take_along_axis(expert_scores, experts, axis=-1)
    group_sizes, sort_indices = sort_by_expert(experts, logits.shape[-1])
    positions = inverse_permutation(sort_indices).reshape(experts.shape)
    return Routing(
        weights=weights,
        experts=experts,
        group_sizes=group_sizes,
        sort_indices=sort_indices,
        probs=probs,
        selected_scores=jax.lax.stop_gradient(selected_scores),
        positions=positions,
        mean_probs=probs.mean(0),
        logsumexp=token_logsumexp(logits),
    )


def load_balancing_loss(routing: Routing) -> jax.Array:
    """f32 scalar ``E * sum_e f_e * P_e``: f_e the share of assignments to e, P_e the mean normalised score of e.

    Gradients flow through P only (f counts discrete choices).
    """
    assignment_share = routing.group_sizes.astype(routing.mean_probs.dtype) / routing.sort_indices.shape[0]
    return load_balancing_loss_from(assignment_share, routing.mean_probs)


def load_balancing_loss_from(assignment_share: jax.Array, mean_prob: jax.Array) -> jax.Array:
    """f32 scalar ``E * sum_e f_e * P_e`` from f [E] and P [E] (e.g. each averaged over a sharded batch first).

    Gradients flow through P only.
    """
    return assignment_share.shape[0] * jnp.sum(jax.lax.stop_gradient(assignment_share) * mean_prob)


def z_loss(logits: jax.Array) -> jax.Array:
    """f32 scalar ``mean_t logsumexp(logits_t)^2`` over [T, E] router logits."""
    return z_loss_from(token_logsumexp(logits))


def z_loss_from(logsumexp: jax.Array) -> jax.Array:
    """f32 scalar ``mean_t logsumexp_t^2`` of the tokens' [T] logsumexps (``Routing.logsumexp``)."""
    return jnp.mean(logsumexp**2)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert may take: ``ceil(capacity_factor * T * k / E)`` (at least 1)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def apply_capacity(routing: Routing, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Drops, per expert, the assignments beyond ``capacity`` with the lowest routing score (``selected_scores``;
    ties: the later assignment is dropped).

    Returns (group_sizes [E] int32, sort_indices [T*k] int32) in the layout ``grouped_matmul`` expects: the kept rows
    sorted by expert as in ``Routing`` (stable by token, then slot), then every dropped assignment after
    ``sum(group_sizes)``, where the grouped matmul writes zeros.
    """
    flat_experts = routing.experts.reshape(-1)
    flat_scores = routing.selected_scores.reshape(-1)
    num_assignments = flat_experts.shape[0]
    num_experts = routing.group_sizes.shape[0]
    flat_index = jnp.arange(num_assignments, dtype=jnp.int32)
    # Within each expert: by descending score, then by assignment index.
    by_score = jnp.lexsort((flat_index, -flat_scores, flat_experts))
    group_starts = jnp.cumsum(routing.group_sizes) - routing.group_sizes
    rank_sorted = jnp.arange(num_assignments) - group_starts[flat_experts[by_score]]
    rank = jnp.zeros_like(flat_index).at[by_score].set(rank_sorted.astype(jnp.int32))
    kept_experts = jnp.where(rank < capacity, flat_experts, num_experts)
    sort_indices = jnp.argsort(kept_experts, stable=True).astype(jnp.int32)
    return jnp.minimum(routing.group_sizes, capacity), sort_indices


def balancing_bias_update(bias: jax.Array, expert_counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower the over-loaded ones.

    ``bias_e += rate * sign(mean(counts) - counts_e)``; [E] f32 in, [E] f32 out.
    """
    counts = expert_counts.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(counts) - counts)
