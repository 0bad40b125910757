"""``moe_ffn`` with the experts sharded over a mesh axis (expert parallelism), under ``jax.shard_map``.

Dispatch is an all-gather and the combine a reduce-scatter, both over the expert axis: each device gathers the tokens
of its expert-axis group, routes all of them (every device of the group computes the same routing), runs its own
E / P experts on the rows routed to them, combines those into a partial [T, D] and the reduce-scatter sums the
partials and hands each device back its own tokens. Per device that moves T * D * (P - 1) / P elements each way,
against T * k * D * (P - 1) / P for an all-to-all of the routed rows: no more for any k >= 1, and no ragged
exchange. The expert kernels see the whole group's T * k rows with only the local experts' at the front (a rotation
of the expert-sorted order); the rest lie past ``sum(group_sizes)``, where the expert kernels neither compute nor write
(``zero_tail=False``) and the combine does not read (``num_rows``), in the backward as in the forward. So a
device's kernels move about 1 / P of the group's rows, and their MMAs and weight reads are the local experts' only.
What every device still does for the whole group: the router matmul and the routing, and (backward) the combine's
transpose, which writes a gradient row, zero for another device's experts, for each of the T_group * k rows, and,
where the gather is fused into the gate_up kernel, the permuted copy of x that its weight gradient reads.
``python -m benchmarks --bench ep`` measures it against one device.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_jax.ops.grouped_matmul.packing import PackedGateUp
from moe_jax.ops.moe_ffn.api import LayerBackends, MoEAux, check_moe_args, expert_rows, route_tokens, routed_experts
from moe_jax.ops.routing.api import RoutingOptions, z_loss
from moe_jax.ops.routing.reference import load_balancing_loss_from


def local_expert_rows(group_sizes, sort_indices, first_expert, num_local_experts: int):
    """The rows of experts [first_expert, first_expert + num_local_experts) in front.

    Args:
      group_sizes: [E] int32 rows per expert; sort_indices: [T*k] int32 expert-sorted assignments (``Routing``).
      first_expert: int32 scalar (may be traced); num_local_experts: static.

    Returns:
      (local_sizes [num_local_experts] int32, local_indices [T*k] int32): ``sort_indices`` rotated so that the local
      experts' rows come first, in order; every other row lies past ``sum(local_sizes)``.
    """
    first_row = lax.dynamic_slice_in_dim(jnp.cumsum(group_sizes) - group_sizes, first_expert, 1)[0]
    local_sizes = lax.dynamic_slice_in_dim(group_sizes, first_expert, num_local_experts)
    return local_sizes, jnp.roll(sort_indices, -first_row)


def moe_ffn_expert_parallel(
    x: jax.Array,
    router_kernel: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    *,
    top_k: int,
    activation: str = "swiglu",
    routing: RoutingOptions | None = None,
    bias: jax.Array | None = None,
    capacity_factor: float | None = None,
    expert_axis: str = "expert",
    backend: str = "auto",
    **routing_keywords,
) -> tuple[jax.Array, MoEAux]:
    """``moe_jax.moe_ffn`` with the E experts split over the mesh axis ``expert_axis`` (P devices, E / P each).

    Call it under a mesh (``jax.set_mesh``); it runs as one ``jax.shard_map`` over all the mesh's axes. The tokens are
    split over every axis (the expert axis last, as a batch sharded over ``(data, expert)``), the expert weights
    over ``expert_axis``; the router and bias are replicated. Semantics, arguments and results are ``moe_ffn``'s on
    the whole batch, with one difference: with ``capacity_factor`` the capacity is per group of P devices along the
    expert axis, ``ceil(cf * T_group * k / E)`` rows per expert where T_group = T / (mesh size / P). The
    load-balancing and z losses and the expert counts are those of the whole batch. The reduce-scatter sums the
    devices' partial outputs in x's dtype.

    Args:
      x: [T, D], T a multiple of the mesh size; router_kernel [D, E]; w_gate_up [E, D, 2F] (or its
        ``PackedGateUp``); w_down [E, F, D]; E a multiple of P.
      expert_axis: the mesh axis the experts are split over; its size may be 1.
      top_k, activation, routing (or its fields as keywords), bias, capacity_factor, backend: as in
        ``moe_jax.moe_ffn``.

    Returns:
      (y [T, D] sharded like x, MoEAux replicated).
    """
    routing = RoutingOptions.of(routing, routing_keywords)
    num_experts = check_moe_args(
        x,
        router_kernel,
        w_gate_up,
        w_down,
        top_k=top_k,
        activation=activation,
        capacity_factor=capacity_factor,
        routing=routing,
        bias=bias,
    )
    mesh = jax.sharding.get_abstract_mesh()
    if expert_axis not in mesh.axis_names:
        raise ValueError(
            f"expert_axis={expert_axis!r} is not an axis of the current mesh {dict(mesh.shape)}: call "
            "moe_ffn_expert_parallel under jax.set_mesh(mesh) with a mesh that has it"
        )
    num_shards = mesh.shape[expert_axis]
    if num_experts % num_shards:
        raise ValueError(f"E={num_experts} experts must split evenly over the {num_shards} devices of {expert_axis!r}")
    data_axes = tuple(a for a in mesh.axis_names if a != expert_axis)  # across the expert-axis groups
    token_spec = P((*data_axes, expert_axis))
    if x.shape[0] % mesh.size:
        raise ValueError(f"x.shape[0] (T={x.shape[0]}) must be a multiple of the mesh size {mesh.size}")
    body = functools.partial(
        _expert_parallel_body,
        top_k=top_k,
        activation=activation,
        routing=routing,
        capacity_factor=capacity_factor,
        expert_axis=expert_axis,
        data_axes=data_axes,
        backends=LayerBackends.select(
            backend, x, num_experts, w_down.shape[1], top_k=top_k, activation=activation, routing=routing
        ),
    )
    in_specs = (token_spec, P(), P(expert_axis), P(expert_axis), P())
    operands = (x, router_kernel, w_gate_up, w_down, bias)
    if all(axis_type == AxisType.Explicit for axis_type in mesh.axis_types):
        # Under Explicit axes shard_map takes operands only as sharded as in_specs says: reshard them (a no-op where
        # they already are). Under Auto axes XLA inserts the same.
        operands = tuple(
            jax.tree.map(functools.partial(jax.sharding.reshard, out_shardings=spec), operand)
            for operand, spec in zip(operands, in_specs, strict=True)
        )
    # check_vma=False: the Mosaic GPU kernels' loop carries start from constants and so fail shard_map's
    # varying-axes check (jax 0.11.2); what is replicated here is so by the explicit collectives of the body.
    sharded = jax.shard_map(body, in_specs=in_specs, out_specs=(token_spec, P()), check_vma=False)
    return sharded(*operands)


def _expert_parallel_body(
    x,
    router_kernel,
    w_gate_up,
    w_down,
    bias,
    *,
    top_k,
    activation,
    routing,
    capacity_factor,
    expert_axis,
    data_axes,
    backends,
):
    """One device: x [T / mesh size, D] -> (its y rows, the batch's MoEAux); w_* hold its E / P experts."""
    group_x = lax.all_gather(x, expert_axis, tiled=True)  # the tokens of this device's expert-axis group
    routed = route_tokens(group_x, router_kernel, top_k, routing, bias, backends.route)
    group_sizes, sort_indices = expert_rows(routed, capacity_factor)
    num_local = w_down.shape[0]
    local_sizes, local_indices = local_expert_rows(
        group_sizes, sort_indices, lax.axis_index(expert_axis) * num_local, num_local
    )
    partial_y = routed_experts(
        group_x,
        routed,
        local_sizes,
        local_indices,
        w_gate_up,
        w_down,
        activation=activation,
        zero_tail=False,  # the other devices' experts' rows lie past the local sum
        backends=backends,
    )
    y = lax.psum_scatter(partial_y, expert_axis, tiled=True)

    # The losses of the whole batch: each expert-axis group's statistics summed or averaged over the groups (the
    # members of a group hold the same values; out_specs P() takes one).
    def over_groups(collective, value):
        return collective(value, data_axes) if data_axes else value

    counts = over_groups(lax.psum, routed.group_sizes)
    num_token_groups = math.prod(lax.axis_size(axis) for axis in data_axes)
    share = counts.astype(routed.mean_probs.dtype) / (routed.sort_indices.shape[0] * num_token_groups)
    aux = MoEAux(
        load_balancing_loss=load_balancing_loss_from(share, over_groups(lax.pmean, routed.mean_probs)),
        z_loss=over_groups(lax.pmean, z_loss(routed)),
        expert_counts=counts,
    )
    return y, aux
