"""The oracles the tests (and the benchmarks' correctness checks) compare against, and their error metric.

- A NumPy float64 oracle for every op (``route``, ``grouped_matmul``, ``moe_ffn``, capacity, aux losses), written from
  the ops' definitions with loops and plain NumPy, deliberately unlike the vectorised JAX reference, so that the two
  can only agree by both being right.
- ``GroupOracle`` / ``MLPGroupOracle``: exact f32 results for three groups of a grouped matmul or GLU MLP, for shapes
  where a full oracle is too slow or too large (the GPU tests and the benchmarks).
- ``random_group_sizes``: ragged routings with the edge cases named (empty groups, one hot group, rows past the sum).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------------------- metrics


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are zero)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    denominator = np.linalg.norm(expected)
    difference = np.linalg.norm(actual - expected)
    return float(difference / denominator) if denominator else float(difference)


def max_relative_error(actual, expected) -> float:
    """``max |actual - expected| / max |expected|`` in float64 (NumPy: no program compiled per shape or sharding)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


# ---------------------------------------------------------------------------------------------------------- routings


def random_group_sizes(rng: np.random.Generator, num_groups: int, num_rows: int, kind: str = "uniform") -> np.ndarray:
    """[G] int32 group sizes summing to at most ``num_rows``.

    kinds: "uniform" (each row picks a group uniformly), "empty" (about half the groups empty), "hot" (one group takes
    every row), "tail" (uniform over 3/4 of the rows: the rest lie past the sum), "zipf" (Zipf(1.2) over groups).
    """
    if kind == "hot":
        sizes = np.zeros(num_groups, np.int64)
        sizes[rng.integers(num_groups)] = num_rows
        return sizes.astype(np.int32)
    rows = num_rows * 3 // 4 if kind == "tail" else num_rows
    if kind == "empty":
        allowed = rng.permutation(num_groups)[: max(1, num_groups // 2)]
        choice = rng.choice(allowed, size=rows)
    elif kind == "zipf":
        weights = 1.0 / np.arange(1, num_groups + 1) ** 1.2
        choice = rng.choice(num_groups, size=rows, p=weights / weights.sum())
    elif kind in ("uniform", "tail"):
        choice = rng.integers(num_groups, size=rows)
    else:
        raise ValueError(f"kind must be uniform, empty, hot, tail or zipf, got {kind!r}")
    return np.bincount(choice, minlength=num_groups).astype(np.int32)


# ---------------------------------------------------------------------------------------------------------- routing


def scores(logits, score: str) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    if score == "softmax":
        shifted = np.exp(logits - logits.max(-1, keepdims=True))
        return shifted / shifted.sum(-1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-logits))


def _best_first(values: np.ndarray, count: int) -> list[int]:
    """Indices of the ``count`` largest values, larger first, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:count]


def route(logits, top_k, *, score="softmax", renormalize=True, num_groups=1, top_groups=1, bias=None, scale=1.0):
    """Returns dict(weights, experts, selected_scores [T,k], group_sizes [E], sort_indices [T*k], probs [T,E])."""
    expert_scores = scores(logits, score)
    num_tokens, num_experts = expert_scores.shape
    group_width = num_experts // num_groups
    experts = np.zeros((num_tokens, top_k), np.int64)
    weights = np.zeros((num_tokens, top_k))
    selected_scores = np.zeros((num_tokens, top_k))
    for t in range(num_tokens):
        selection = expert_scores[t] + (0.0 if bias is None else np.asarray(bias, np.float64))
        eligible = list(range(num_experts))
        if num_groups > 1:
            group_score = [
                sum(sorted(selection[g * group_width : (g + 1) * group_width], reverse=True)[:2])
                for g in range(num_groups)
            ]
            groups = _best_first(np.array(group_score), top_groups)
            eligible = [e for e in eligible if e // group_width in groups]
        chosen = sorted(eligible, key=lambda e: (-selection[e], e))[:top_k]
        experts[t] = chosen
        selected_scores[t] = weights[t] = expert_scores[t, chosen]
        if renormalize:
            weights[t] /= weights[t].sum()
        weights[t] *= scale
    flat = experts.reshape(-1)
    sort_indices = np.array(sorted(range(flat.size), key=lambda a: (flat[a], a)))
    probs = expert_scores / expert_scores.sum(-1, keepdims=True)
    return dict(
        weights=weights,
        experts=experts,
        selected_scores=selected_scores,
        group_sizes=np.bincount(flat, minlength=num_experts),
        sort_indices=sort_indices,
        probs=probs,
    )


def load_balancing_loss(probs, experts) -> float:
    num_tokens, num_experts = probs.shape
    share = np.bincount(np.asarray(experts).reshape(-1), minlength=num_experts) / np.asarray(experts).size
    return float(num_experts * np.sum(share * probs.mean(0)))


def z_loss(logits) -> float:
    logits = np.asarray(logits, np.float64)
    peak = logits.max(-1)
    log_normaliser = peak + np.log(np.exp(logits - peak[:, None]).sum(-1))
    return float(np.mean(log_normaliser**2))


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_keep(experts, selected_scores, capacity: int) -> np.ndarray:
    """[T, k] bool: an assignment is kept when fewer than ``capacity`` assignments to its expert outrank it.

    Assignment b outranks a (flat index ``t * k + j``) when its score is higher, or equal with b < a: so of tied
    scores across the cut the later assignment is dropped.
    """
    flat_experts = np.asarray(experts).reshape(-1)
    flat_scores = np.asarray(selected_scores, np.float64).reshape(-1)
    index = np.arange(flat_experts.size)
    keep = np.zeros(flat_experts.size, bool)
    for a in index:
        higher = (flat_scores > flat_scores[a]) | ((flat_scores == flat_scores[a]) & (index < a))
        keep[a] = np.sum(higher & (flat_experts == flat_experts[a])) < capacity
    return keep.reshape(np.shape(experts))


def buffer_keep(
    experts, selected_scores, *, num_devices: int, num_peers: int, experts_per_device: int, bound: int
) -> np.ndarray:
    """[T, k] bool: the assignments that expert parallelism's receive buffers keep.

    T tokens split evenly over ``num_devices`` devices in order; consecutive runs of P = ``num_peers`` devices form an
    expert axis, device i of a run owning experts [i * G, (i + 1) * G), G = ``experts_per_device``. Each device
    keeps the ``bound`` best-scored assignments sent to it from its run: by descending score, then by sender, then
    by the sender's expert-sorted order (expert, token, slot).
    """
    experts, selected_scores = np.asarray(experts), np.asarray(selected_scores)
    num_tokens, top_k = experts.shape
    tokens_per_device = num_tokens // num_devices
    keep = np.zeros(experts.shape, bool)
    for first_device in range(0, num_devices, num_peers):
        for receiver in range(num_peers):
            candidates = []
            for sender in range(num_peers):
                first_token = (first_device + sender) * tokens_per_device
                for t in range(first_token, first_token + tokens_per_device):
                    for j in range(top_k):
                        if experts[t, j] // experts_per_device == receiver:
                            candidates.append((-selected_scores[t, j], sender, experts[t, j], t, j))
            for *_, t, j in sorted(candidates)[:bound]:
                keep[t, j] = True
    return keep


def capacity_rows(experts, keep, num_experts: int) -> tuple[np.ndarray, np.ndarray, set[int]]:
    """(group_sizes [E], kept [sum(group_sizes)] assignment indices in expert-sorted order, the set of dropped
    assignments) of a [T, k] selection and its [T, k] ``keep``: per expert, its kept assignments by increasing index."""
    flat_experts = np.asarray(experts).reshape(-1)
    flat_keep = np.asarray(keep).reshape(-1)
    kept = [a for e in range(num_experts) for a in range(flat_experts.size) if flat_experts[a] == e and flat_keep[a]]
    group_sizes = np.array([np.sum((flat_experts == e) & flat_keep) for e in range(num_experts)])
    return group_sizes, np.array(kept, np.int64), {int(a) for a in np.flatnonzero(~flat_keep)}


def capacity_factor_splitting(experts, selected_scores, tied, num_experts: int) -> float:
    """A capacity factor whose cut runs through ``tied``: flat assignment indices (``t * k + j``) to one expert with
    bit-equal scores (e.g. the same slot of equal tokens). Its capacity keeps the first half of them and drops the
    rest, so which of tied assignments a capacity keeps shows in the output."""
    flat_experts = np.asarray(experts).reshape(-1)
    flat_scores = np.asarray(selected_scores).reshape(-1)
    expert, score = flat_experts[tied[0]], flat_scores[tied[0]]
    if len(tied) < 2 or np.any(flat_experts[tied] != expert) or np.any(flat_scores[tied] != score):
        raise ValueError(f"assignments {list(tied)} are not two or more exact ties at one expert")
    capacity = int(np.sum((flat_experts == expert) & (flat_scores > score))) + len(tied) // 2
    return (capacity - 0.5) * num_experts / flat_experts.size


# ---------------------------------------------------------------------------------------------------------- matmul


def _gated_activation(gate, up, activation: str, xp):
    """The GLUs with their constants written out, in the array module ``xp`` (numpy or jax.numpy)."""
    if activation == "swiglu":
        return gate / (1.0 + xp.exp(-gate)) * up
    if activation == "geglu":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1.0 + xp.tanh(inner)) * up
    if activation == "gpt_oss":
        gate = xp.minimum(gate, 7.0)
        up = xp.clip(up, -7.0, 7.0)
        return (up + 1.0) * gate / (1.0 + xp.exp(-1.702 * gate))
    raise ValueError(activation)


def gated_activation(gate, up, activation: str) -> np.ndarray:
    return _gated_activation(np.asarray(gate, np.float64), np.asarray(up, np.float64), activation, np)


def grouped_matmul(lhs, rhs, group_sizes, *, activation=None, row_scale=None, transpose_rhs=False) -> np.ndarray:
    """float64 loop over groups; rows past ``sum(group_sizes)`` are zero."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[g]
        start += size
    if activation is not None:
        half = out.shape[1] // 2
        out = gated_activation(out[:, :half], out[:, half:], activation)
    if row_scale is not None:
        out = out * np.asarray(row_scale, np.float64)[:, None]
    return out


def _layer_routing(
    x, router_kernel, top_k, capacity_factor, routing, keep_rule=None
) -> tuple[np.ndarray, dict, np.ndarray]:
    """(logits [T, E], ``route``'s dict, keep [T, k]) of one layer; logits token by token, so equal tokens get
    bit-equal logits (and so tie exactly, as they do in the layer). ``keep_rule(routed) -> [T, k] bool`` drops
    assignments (e.g. ``buffer_keep``'s) on top of a capacity."""
    router_kernel = np.asarray(router_kernel, np.float64)
    logits = np.stack([token @ router_kernel for token in x])
    routed = route(logits, top_k, **routing)
    num_tokens, num_experts = logits.shape
    keep = np.ones((num_tokens, top_k), bool)
    if capacity_factor is not None:
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        keep = capacity_keep(routed["experts"], routed["selected_scores"], capacity)
    if keep_rule is not None:
        keep = keep & keep_rule(routed)
    return logits, routed, keep


def _expert_tokens(routed, keep, expert) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, their weights): the tokens whose kept assignments go to ``expert`` (each token at most once)."""
    tokens, slots = np.nonzero((routed["experts"] == expert) & keep)
    return tokens, routed["weights"][tokens, slots]


def moe_ffn(
    x, router_kernel, w_gate_up, w_down, *, top_k, activation="swiglu", capacity_factor=None, keep_rule=None, **routing
):
    """Returns (y [T, D], dict(load_balancing_loss, z_loss, expert_counts, keep [T, k])): expert by expert over the
    tokens each one keeps, no permutation (``keep_rule``: as ``_layer_routing``'s)."""
    x = np.asarray(x, np.float64)
    logits, routed, keep = _layer_routing(x, router_kernel, top_k, capacity_factor, routing, keep_rule)
    w_gate_up = np.asarray(w_gate_up, np.float64)
    w_down = np.asarray(w_down, np.float64)
    half = w_gate_up.shape[2] // 2
    y = np.zeros_like(x)
    for e in range(logits.shape[1]):
        tokens, weights = _expert_tokens(routed, keep, e)
        gate_up = x[tokens] @ w_gate_up[e]
        hidden = gated_activation(gate_up[:, :half], gate_up[:, half:], activation)
        y[tokens] += weights[:, None] * (hidden @ w_down[e])
    aux = dict(
        load_balancing_loss=load_balancing_loss(routed["probs"], routed["experts"]),
        z_loss=z_loss(logits),
        expert_counts=routed["group_sizes"],
        keep=keep,
    )
    return y, aux


def _gated_activation_partials(gate, up, activation: str, step: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """(d h / d gate, d h / d up) elementwise, by central differences in float64 (error about 1e-10 relative)."""

    def difference(plus, minus):
        return (gated_activation(*plus, activation) - gated_activation(*minus, activation)) / (2 * step)

    return difference((gate + step, up), (gate - step, up)), difference((gate, up + step), (gate, up - step))


def moe_ffn_gradients(
    x,
    router_kernel,
    w_gate_up,
    w_down,
    cotangent,
    *,
    top_k,
    activation="swiglu",
    capacity_factor=None,
    keep_rule=None,
    load_balancing_weight=1.0,
    z_loss_weight=0.0,
    score="softmax",
    renormalize=True,
    scale=1.0,
    **routing,
) -> dict[str, np.ndarray]:
    """Gradients of ``sum(y * cotangent) + load_balancing_weight * lb + z_loss_weight * z`` of ``moe_ffn``: dict(x,
    router_kernel, w_gate_up [E, D, 2F] as [gate | up], w_down), float64.

    The chain rule written out expert by expert, the selection (experts, capacity drops, the load-balancing loss's
    shares f) held constant as autodiff holds a top-k: a dropped assignment contributes nothing. The GLU's partial
    derivatives by central differences of ``gated_activation``.
    """
    x, router_kernel, w_gate_up, w_down, cotangent = (
        np.asarray(a, np.float64) for a in (x, router_kernel, w_gate_up, w_down, cotangent)
    )
    logits, routed, keep = _layer_routing(
        x,
        router_kernel,
        top_k,
        capacity_factor,
        dict(score=score, renormalize=renormalize, scale=scale, **routing),
        keep_rule,
    )
    num_tokens, num_experts = logits.shape
    half = w_gate_up.shape[2] // 2
    d_x, d_w_gate_up, d_w_down = np.zeros_like(x), np.zeros_like(w_gate_up), np.zeros_like(w_down)
    d_weights = np.zeros(routed["weights"].shape)
    for e in range(num_experts):
        tokens, weights = _expert_tokens(routed, keep, e)
        gate_up = x[tokens] @ w_gate_up[e]
        gate, up = gate_up[:, :half], gate_up[:, half:]
        hidden = gated_activation(gate, up, activation)
        d_weights[(routed["experts"] == e) & keep] = np.sum(cotangent[tokens] * (hidden @ w_down[e]), -1)
        d_out = weights[:, None] * cotangent[tokens]
        d_w_down[e] = hidden.T @ d_out
        d_gate, d_up = _gated_activation_partials(gate, up, activation)
        d_hidden = d_out @ w_down[e].T
        d_gate_up = np.concatenate([d_hidden * d_gate, d_hidden * d_up], axis=1)
        d_w_gate_up[e] = x[tokens].T @ d_gate_up
        d_x[tokens] += d_gate_up @ w_gate_up[e].T
    # weights = scale * selected (/ sum(selected) with renormalize): back to the [T, E] scores.
    expert_scores = scores(logits, score)
    selected = np.take_along_axis(expert_scores, routed["experts"], axis=1)
    d_selected = scale * d_weights
    if renormalize:
        total = selected.sum(1, keepdims=True)
        d_selected = scale * (d_weights / total - np.sum(d_weights * selected, 1, keepdims=True) / total**2)
    d_scores = np.zeros_like(expert_scores)
    np.put_along_axis(d_scores, routed["experts"], d_selected, axis=1)  # a token's experts are distinct
    # load_balancing_loss = E * sum_e f_e * mean_t probs[t, e], probs the scores (divided by their sum for sigmoid).
    share = routed["group_sizes"] / (num_tokens * top_k)
    d_probs = np.broadcast_to(load_balancing_weight * num_experts * share / num_tokens, expert_scores.shape)
    if score == "softmax":
        d_scores += d_probs
        d_logits = expert_scores * (d_scores - np.sum(d_scores * expert_scores, 1, keepdims=True))
    else:
        total = expert_scores.sum(1, keepdims=True)
        d_scores += (d_probs - np.sum(d_probs * expert_scores / total, 1, keepdims=True)) / total
        d_logits = d_scores * expert_scores * (1.0 - expert_scores)
    # z_loss = mean_t logsumexp(logits_t)^2, and d logsumexp / d logits is the softmax.
    peak = logits.max(1, keepdims=True)
    log_normaliser = peak + np.log(np.sum(np.exp(logits - peak), 1, keepdims=True))
    d_logits += z_loss_weight * 2.0 * log_normaliser / num_tokens * scores(logits, "softmax")
    d_x += d_logits @ router_kernel.T
    return dict(x=d_x, router_kernel=x.T @ d_logits, w_gate_up=d_w_gate_up, w_down=d_w_down)


# ------------------------------------------------------------------------------------------- grouped matmul, at scale


def _probe_groups(group_sizes) -> tuple[list[int], dict[int, slice], int]:
    """The groups a group oracle checks (first and last non-empty, largest), their row slices, and sum(group_sizes):
    rows at or past it must come out zero."""
    sizes = np.asarray(group_sizes)
    nonempty = np.flatnonzero(sizes)
    if not nonempty.size:
        raise ValueError("group_sizes must have a non-empty group, got all zeros")
    ends = np.cumsum(sizes)
    groups = sorted({int(nonempty[0]), int(np.argmax(sizes)), int(nonempty[-1])})
    return groups, {g: slice(int(ends[g] - sizes[g]), int(ends[g])) for g in groups}, int(ends[-1])


class _ProbedGroupsOracle:
    """What the group oracles share: exact leaves ``expected[g]`` for the probed groups (``_probe_groups``) and the
    relative errors of an output against them, accumulated in float64 on the host."""

    # Leaves indexed by group ([G, ...] weight gradients) rather than sliced by the group's rows.
    per_group_leaves: tuple[int, ...] = ()

    def __init__(self, group_sizes, backward: bool):
        self.groups, self.rows, self.routed_rows = _probe_groups(group_sizes)
        self.backward = backward
        self.expected: dict[int, list[jax.Array]] = {}

    def _squared_norms(self, output) -> list[dict[int, tuple[float, float]]]:
        """Per leaf of ``output``: {group: (||actual - exact||^2, ||exact||^2)}."""
        leaves = output if self.backward else (output,)
        norms = []
        for leaf, array in enumerate(leaves):
            norms.append({})
            for g, rows in self.rows.items():
                actual = np.asarray(array[g] if leaf in self.per_group_leaves else array[rows], np.float64)
                expected = np.asarray(self.expected[g][leaf], np.float64)
                norms[-1][g] = (float(np.sum(np.square(actual - expected))), float(np.sum(np.square(expected))))
        return norms

    def errors(self, output) -> list[float]:
        """Per leaf of ``output``: ``||actual - exact|| / ||exact||`` over the probed groups together."""
        errors = []
        for leaf in self._squared_norms(output):
            diff, total = (sum(values) for values in zip(*leaf.values(), strict=True))
            errors.append(math.sqrt(diff / total))
        return errors

    def group_errors(self, output) -> list[dict[int, float]]:
        """Per leaf of ``output``: {group: ``||actual - exact|| / ||exact||``} for each probed group."""
        return [
            {g: math.sqrt(diff / total) for g, (diff, total) in leaf.items()} for leaf in self._squared_norms(output)
        ]


class GroupOracle(_ProbedGroupsOracle):
    """Exact f32 grouped-matmul results for three groups (first non-empty, largest, last non-empty) of one input.

    For shapes where a full oracle is too slow or too large (XLA's ragged_dot multiplies by every group): with x_g the
    rows of group g, out_g = lhs_g @ rhs[g]; with a cotangent ct also d_lhs_g = ct_g @ rhs[g]^T and
    d_rhs[g] = lhs_g^T @ ct_g. Computed with jax.numpy at HIGHEST precision on the default device, from the slices
    alone, so independent of every implementation it checks. Outputs: (out,) or (out, d_lhs, d_rhs); with an
    ``activation`` (forward only) out is the GLU [M, N/2] of the ``[gate | up]`` product.

    Args:
      lhs: [M, K]; rhs: [G, K, N]; group_sizes: [G] int, summing to at most M; ct: [M, N] or None (forward only);
      activation: None, or "swiglu" / "geglu" / "gpt_oss".
    """

    per_group_leaves = (2,)

    def __init__(self, lhs, rhs, group_sizes, ct=None, activation=None):
        if activation is not None and ct is not None:
            raise ValueError("GroupOracle: an activation is checked forward only (MLPGroupOracle has gradients)")
        super().__init__(group_sizes, backward=ct is not None)
        dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        for g, rows in self.rows.items():
            x, w = lhs[rows].astype(jnp.float32), rhs[g].astype(jnp.float32)
            out = dot(x, w)
            if activation is not None:
                out = _gated_activation(*jnp.split(out, 2, axis=1), activation, jnp)
            self.expected[g] = [out]
            if self.backward:
                dy = ct[rows].astype(jnp.float32)
                self.expected[g] += [dot(dy, w.T), dot(x.T, dy)]

    def describe(self) -> str:
        return f"f32 oracle, groups {self.groups}"


class MLPGroupOracle(_ProbedGroupsOracle):
    """Exact f32 GLU-MLP results for three groups (first non-empty, largest, last non-empty), as ``GroupOracle``.

    y_g = row_scale_g * (act(x_g W_gate[g]) * (x_g W_up[g])) W_down[g]; with a cotangent ct also its gradients
    (d x_g, d w_gate_up[g], d w_down[g], d row_scale_g) by jax.vjp of that f32 function at HIGHEST precision.
    Outputs: (y,) or (y, d_x, d_w_gate_up, d_w_down, d_row_scale).

    Args:
      x: [M, D]; w_gate_up: [G, D, 2F] as [gate | up] (unpack a packed one); w_down: [G, F, D]; group_sizes: [G];
      row_scale: [M]; activation: "swiglu", "geglu" or "gpt_oss"; ct: [M, D] or None (forward only).
    """

    per_group_leaves = (2, 3)

    def __init__(self, x, w_gate_up, w_down, group_sizes, row_scale, activation: str, ct=None):
        super().__init__(group_sizes, backward=ct is not None)
        mlp = functools.partial(_f32_glu_mlp, activation=activation)
        for g, rows in self.rows.items():
            args = [a.astype(jnp.float32) for a in (x[rows], w_gate_up[g], w_down[g], row_scale[rows])]
            if self.backward:
                y, pullback = jax.vjp(mlp, *args)
                self.expected[g] = [y, *pullback(ct[rows].astype(jnp.float32))]
            else:
                self.expected[g] = [mlp(*args)]

    def describe(self) -> str:
        return f"f32 MLP oracle, groups {self.groups}"


def _f32_glu_mlp(x, w_gate_up, w_down, row_scale, *, activation: str):
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    gate, up = jnp.split(dot(x, w_gate_up), 2, axis=1)
    return dot(_gated_activation(gate, up, activation, jnp), w_down) * row_scale[:, None]
