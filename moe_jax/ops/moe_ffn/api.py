"""``moe_jax.moe_ffn``: the whole routed-expert feed-forward layer, composed from the public ops."""

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax._core import checks
from moe_jax.ops.glu_mlp.api import routed_glu_mlp, rows_in_groups
from moe_jax.ops.grouped_matmul.packing import PackedGateUp
from moe_jax.ops.grouped_matmul.reference import ACTIVATIONS
from moe_jax.ops.permute.api import combine
from moe_jax.ops.routing.api import (
    Routing,
    apply_capacity,
    check_routing_args,
    load_balancing_loss,
    route,
    router_logits,
    z_loss,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
    """Auxiliary outputs of one MoE layer.

    Attributes:
      load_balancing_loss: f32 scalar ``E * sum_e f_e * P_e``.
      z_loss: f32 scalar ``mean_t logsumexp(logits_t)^2``.
      expert_counts: [E] int32 assignments routed to each expert (before any capacity drop).
    """

    load_balancing_loss: jax.Array
    z_loss: jax.Array
    expert_counts: jax.Array


def check_moe_args(x, router_kernel, w_gate_up, w_down, *, top_k, activation, capacity_factor, routing_options) -> int:
    """Checks one MoE layer call: the arrays' shapes and dtypes, the activation, the capacity and the routing
    options (``moe_jax.route``'s keywords, as a dict); returns E."""
    _, d_model = checks.check_rank("x", x, 2, "[T, D]")
    router_d, num_experts = checks.check_rank("router_kernel", router_kernel, 2, "[D, E]")
    checks.check_dim("router_kernel", router_d, d_model, "shape[0] (D, from x [T, D])")
    if isinstance(w_gate_up, PackedGateUp) and w_gate_up.transposed:
        raise ValueError("w_gate_up must be [E, D, 2F]; got a transposed PackedGateUp ([E, 2F, D])")
    gate_up_shape = checks.check_rank("w_gate_up", w_gate_up, 3, "[E, D, 2F]")
    if gate_up_shape[:2] != (num_experts, d_model) or gate_up_shape[2] % 2:
        raise ValueError(f"w_gate_up must have shape [E, D, 2F] = [{num_experts}, {d_model}, 2F], got {gate_up_shape}")
    d_ff = gate_up_shape[2] // 2
    down_shape = checks.check_rank("w_down", w_down, 3, "[E, F, D]")
    if down_shape != (num_experts, d_ff, d_model):
        raise ValueError(f"w_down must have shape [E, F, D] = {(num_experts, d_ff, d_model)}, got {down_shape}")
    for name, array in (
        ("x", x),
        ("router_kernel", router_kernel),
        ("w_gate_up", w_gate_up),
        ("w_down", w_down),
    ):
        checks.check_float(name, array)
    expert_dtypes = {name: jnp.dtype(a.dtype) for name, a in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down))}
    if len(set(expert_dtypes.values())) > 1:
        found = ", ".join(f"{name} {dtype.name}" for name, dtype in expert_dtypes.items())
        raise TypeError(f"x, w_gate_up and w_down must share one compute dtype, got {found}")
    checks.check_choice("activation", activation, ACTIVATIONS)
    if capacity_factor is not None and checks.check_static_float("capacity_factor", capacity_factor) <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor}")
    check_routing_args(num_experts, top_k, **routing_options)
    return num_experts


def moe_ffn(
    x: jax.Array,
    router_kernel: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    *,
    top_k: int,
    activation: str = "swiglu",
    score: str = "softmax",
    renormalize: bool = True,
    num_groups: int = 1,
    top_groups: int = 1,
    bias: jax.Array | None = None,
    scale: float = 1.0,
    capacity_factor: float | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, MoEAux]:
    """Routed-expert FFN: ``y_t = sum_j weight_tj * FFN_{e_tj}(x_t)``, ``FFN_e(x) = (act(x W_gate) * x W_up) W_down``.

    Args:
      x: [T, D] tokens.
      router_kernel: [D, E]; ``logits = x @ router_kernel`` in f32.
      w_gate_up: [E, D, 2F], the ``[gate | up]`` halves along the last axis, or a ``PackedGateUp`` of them
        (``pack_gate_up``; what the Pallas kernels read, so store weights packed: a plain array is packed per call).
      w_down: [E, F, D].
      top_k, score, renormalize, num_groups, top_groups, bias, scale: routing, as in ``moe_jax.route``.
      activation: "swiglu", "geglu" or "gpt_oss".
      capacity_factor: None (dropless) or > 0: each expert keeps at most ``ceil(cf * T * k / E)`` rows, dropping
        its lowest-score assignments (``Routing.selected_scores``, as ``apply_capacity``; a dropped assignment
        contributes zero).
      backend: "auto", "xla" or "pallas", for every op of the layer.

    Returns:
      (y [T, D] in x.dtype, MoEAux).
    """
    routing_options = dict(
        score=score, renormalize=renormalize, num_groups=num_groups, top_groups=top_groups, bias=bias, scale=scale
    )
    check_moe_args(
        x,
        router_kernel,
        w_gate_up,
        w_down,
        top_k=top_k,
        activation=activation,
        capacity_factor=capacity_factor,
        routing_options=routing_options,
    )
    routing = route_tokens(x, router_kernel, top_k=top_k, backend=backend, **routing_options)
    group_sizes, sort_indices = expert_rows(routing, capacity_factor)
    y = routed_experts(
        x,
        routing,
        group_sizes,
        sort_indices,
        w_gate_up,
        w_down,
        activation=activation,
        rows_past_sum=capacity_factor is not None,
        positions=routing.positions if capacity_factor is None else None,
        backend=backend,
    )
    aux = MoEAux(
        load_balancing_loss=load_balancing_loss(routing),
        z_loss=z_loss(routing),
        expert_counts=routing.group_sizes,
    )
    return y, aux


def route_tokens(x, router_kernel, *, top_k: int, backend: str, **routing_options) -> Routing:
    """The Routing of tokens x [T, D] under router_kernel [D, E] (logits in f32); options as in ``moe_jax.route``."""
    with jax.named_scope("router"):
        logits = router_logits(x, router_kernel)
        return route(logits, top_k, backend=backend, **routing_options)


def expert_rows(routing: Routing, capacity_factor: float | None) -> tuple[jax.Array, jax.Array]:
    """(group_sizes [E], sort_indices [T*k]) of the rows the experts compute: all of them, or what a capacity keeps."""
    if capacity_factor is None:
        return routing.group_sizes, routing.sort_indices
    return apply_capacity(routing, capacity_factor)


def routed_experts(
    x,
    routing,
    group_sizes,
    sort_indices,
    w_gate_up,
    w_down,
    *,
    activation,
    rows_past_sum: bool,
    positions=None,
    backend,
) -> jax.Array:
    """y [T, D] = the routing-weighted sum of each token's expert outputs, over the expert-sorted rows
    ``sort_indices`` [T*k] whose first ``sum(group_sizes)`` belong to the G experts of w_gate_up [G, D, 2F] /
    w_down [G, F, D] in order; rows past that sum contribute nothing. ``positions`` [T, k]: the inverse of
    ``sort_indices`` where the caller has it (``Routing.positions`` when every row is routed), else None.

    ``rows_past_sum``: whether there can be such rows (a capacity's drops, another device's experts). Then the
    kernels skip them and the combine does not read them. Without (every row routed), the kernels keep their zero
    tail, which is empty: two A/Bs of the whole layer measured the skipping program's forward + backward 2.5% (H100)
    and 5% (H200) slower there, with rounds alternating between two speeds (benchmarks/RESULTS.md, 2026-11-25).
    """
    with jax.named_scope("experts"):
        # The permute runs inside the gate_up kernel's loads where that pays (routed_glu_mlp). The routing weights
        # scale the down projection's rows (its epilogue), so the combine is a plain sum. Gathered by sort_indices,
        # which is apply_capacity's when it ran (so not Routing.sorted_weights).
        row_weights = routing.weights.reshape(-1)[sort_indices]
        out_rows = routed_glu_mlp(
            x,
            sort_indices,
            routing.top_k,
            w_gate_up,
            w_down,
            group_sizes,
            activation=activation,
            row_scale=row_weights,
            zero_tail=not rows_past_sum,
            positions=positions,
            backend=backend,
        )
    with jax.named_scope("combine"):
        num_rows = None
        if rows_past_sum:
            num_rows = rows_in_groups(group_sizes, sort_indices.shape[0])
        return combine(out_rows, sort_indices, routing.top_k, num_rows=num_rows, positions=positions, backend=backend)
