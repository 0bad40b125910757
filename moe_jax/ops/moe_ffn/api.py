"""``moe_jax.moe_ffn``: the whole routed-expert feed-forward layer, composed from the public ops."""

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax._core import checks
from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.grouped_matmul.glu import ACTIVATIONS
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, stored_array
from moe_jax.ops.grouped_matmul.reference_fp8 import QUANTIZATIONS
from moe_jax.ops.permute import api as permute_api
from moe_jax.ops.quant.reference import BlockScaled, QuantizedMaster
from moe_jax.ops.routing import api as routing_api
from moe_jax.ops.routing.api import Routing, RoutingOptions, apply_capacity, load_balancing_loss, router_logits, z_loss


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
    """Auxiliary outputs of one MoE layer.

    Attributes:
      load_balancing_loss: f32 scalar ``E * sum_e f_e * P_e``.
      z_loss: f32 scalar ``mean_t logsumexp(logits_t)^2``.
      expert_counts: [E] int32 assignments routed to each expert (before any capacity drop).
      received_rows: expert parallelism only (else None): [devices] int32, the routed rows each device computed.
      dropped_rows: expert parallelism only (else None): [devices] int32, the rows sent to each device past its
        receive buffer (``buffer_factor``), dropped.
      overflowed_rows: expert parallelism only (else None): [devices] int32, the rows each device received past its
        slots in the "slots" exchange, through its fallback exchange (zero when the fallback did not run).
    """

    load_balancing_loss: jax.Array
    z_loss: jax.Array
    expert_counts: jax.Array
    received_rows: jax.Array | None = None
    dropped_rows: jax.Array | None = None
    overflowed_rows: jax.Array | None = None


def check_moe_args(
    x,
    router_kernel,
    w_gate_up,
    w_down,
    *,
    top_k,
    activation,
    capacity_factor,
    routing: RoutingOptions,
    bias,
    quantization=None,
) -> int:
    """Checks one MoE layer call: the arrays' shapes and dtypes, the activation, the capacity, the routing options,
    bias and quantization (with which the expert weights may be ``BlockScaled``); returns E."""
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
    checks.check_choice("quantization", quantization, (None, *QUANTIZATIONS))
    weights = (("w_gate_up", stored_array(w_gate_up)), ("w_down", w_down))
    if quantization is None:
        for name, array in weights:
            if isinstance(array, (BlockScaled, QuantizedMaster)):
                kind = type(array).__name__
                raise TypeError(f"{name} is a {kind} (FP8): pass quantization= ({QUANTIZATIONS}) to match it")
    # BlockScaled weights (quantization only) have their blocks checked by grouped_matmul.
    high_precision = [(name, a) for name, a in weights if not isinstance(a, BlockScaled)]
    for name, array in (("x", x), ("router_kernel", router_kernel), *high_precision):
        checks.check_float(name, array)
    expert_dtypes = {name: jnp.dtype(a.dtype) for name, a in (("x", x), *high_precision)}
    if len(set(expert_dtypes.values())) > 1:
        found = ", ".join(f"{name} {dtype.name}" for name, dtype in expert_dtypes.items())
        raise TypeError(f"x, w_gate_up and w_down must share one compute dtype, got {found}")
    checks.check_choice("activation", activation, ACTIVATIONS)
    if capacity_factor is not None and checks.check_static_float("capacity_factor", capacity_factor) <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor}")
    routing.check(num_experts, top_k, bias)
    return num_experts


@dataclasses.dataclass(frozen=True)
class LayerBackends:
    """The implementations one MoE layer call runs, chosen once per call from the user's backend string.

    Attributes:
      route: ``route``'s ("pallas" or "xla").
      experts: ``routed_glu_mlp``'s ("pallas_gather", "pallas_sorted" or "xla").
      combine: ``combine``'s ("pallas" or "xla").
      quantization: the expert GEMMs' (None, "fp8_block" or "mxfp8"), which ``experts`` was chosen for.
    """

    route: str
    experts: str
    combine: str
    quantization: str | None = None

    @classmethod
    def select(cls, backend: str, x, w_gate_up, w_down, *, top_k: int, activation: str, routing, quantization=None):
        """What ``backend`` selects for a layer over tokens x [T, D] and the expert weights w_gate_up [E, D, 2F] /
        w_down [E, F, D] (high precision, or with ``quantization`` also BlockScaled)."""
        num_experts, d_ff = w_down.shape[:2]
        weights = glu_mlp_api.abstract_weights(w_gate_up, w_down)
        mlp_call = glu_mlp_api.MlpCall(jnp.dtype(x.dtype), x.shape[1], d_ff, activation, quantization, weights)
        return cls(
            route=routing_api.select(backend, num_experts, top_k, routing),
            experts=glu_mlp_api.select_routed(backend, mlp_call),
            combine=permute_api.select("combine", backend, x),
            quantization=quantization,
        )


def moe_ffn(
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
    backend: str = "auto",
    quantization: str | None = None,
    **routing_keywords,
) -> tuple[jax.Array, MoEAux]:
    """Routed-expert FFN: ``y_t = sum_j weight_tj * FFN_{e_tj}(x_t)``, ``FFN_e(x) = (act(x W_gate) * x W_up) W_down``.

    Args:
      x: [T, D] tokens.
      router_kernel: [D, E]; ``logits = x @ router_kernel`` in f32.
      w_gate_up: [E, D, 2F], the ``[gate | up]`` halves along the last axis, or a ``PackedGateUp`` of them
        (``pack_gate_up``; what the Pallas kernels read, so store weights packed: a plain array is packed per call).
      w_down: [E, F, D].
      top_k: experts per token.
      activation: "swiglu", "geglu" or "gpt_oss".
      routing: a ``RoutingOptions`` (score, renormalize, num_groups, top_groups, scale), as in ``moe_jax.route``;
        its fields may also be passed as keywords (``score="sigmoid"``), which override it.
      bias: optional [E] f32 selection bias (aux-loss-free balancing), as in ``moe_jax.route``.
      capacity_factor: None (dropless) or > 0: each expert keeps at most ``ceil(cf * T * k / E)`` rows, dropping
        its lowest-score assignments (``Routing.selected_scores``, as ``apply_capacity``; a dropped assignment
        contributes zero).
      backend: "auto", "xla" or "pallas", for every op of the layer (``LayerBackends``).
      quantization: None, "fp8_block" or "mxfp8": the expert GEMMs on block-scaled FP8 operands (``glu_mlp``'s);
        the router, the routing and the aux losses stay in high precision. The expert weights may then be
        ``BlockScaled`` (``quantize_weights``; inference: they get no gradient) or, with "fp8_block",
        ``QuantizedMaster`` (``quantize_master``: copies made once for a training step's micro-batches, the
        gradient reaching the master).

    Returns:
      (y [T, D] in x.dtype, MoEAux).
    """
    routing = RoutingOptions.of(routing, routing_keywords)
    check_moe_args(
        x,
        router_kernel,
        w_gate_up,
        w_down,
        top_k=top_k,
        activation=activation,
        capacity_factor=capacity_factor,
        routing=routing,
        bias=bias,
        quantization=quantization,
    )
    backends = LayerBackends.select(
        backend,
        x,
        w_gate_up,
        w_down,
        top_k=top_k,
        activation=activation,
        routing=routing,
        quantization=quantization,
    )
    routed = route_tokens(x, router_kernel, top_k, routing, bias, backends.route)
    group_sizes, sort_indices = expert_rows(routed, capacity_factor)
    y = routed_experts(
        x,
        routed,
        group_sizes,
        sort_indices,
        w_gate_up,
        w_down,
        activation=activation,
        zero_tail=capacity_factor is None,
        positions=routed.positions if capacity_factor is None else None,
        backends=backends,
    )
    aux = MoEAux(
        load_balancing_loss=load_balancing_loss(routed),
        z_loss=z_loss(routed),
        expert_counts=routed.group_sizes,
    )
    return y, aux


def route_tokens(x, router_kernel, top_k: int, routing: RoutingOptions, bias, implementation: str) -> Routing:
    """The Routing of tokens x [T, D] under router_kernel [D, E] (logits in f32), by ``route``'s ``implementation``."""
    with jax.named_scope("router"):
        logits = router_logits(x, router_kernel)
        return routing_api.route_with(implementation, logits, top_k, routing, bias)


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
    zero_tail: bool,
    positions=None,
    backends: LayerBackends,
) -> jax.Array:
    """y [T, D] = the routing-weighted sum of each token's expert outputs, over the expert-sorted rows
    ``sort_indices`` [T*k] whose first ``sum(group_sizes)`` belong to the G experts of w_gate_up [G, D, 2F] /
    w_down [G, F, D] in order; rows past that sum contribute nothing. ``positions`` [T, k]: the inverse of
    ``sort_indices`` where the caller has it (``Routing.positions`` when every row is routed), else None.

    ``zero_tail``: ``glu_mlp``'s. False where rows past the sum can exist (a capacity's drops, another device's
    experts): the kernels then skip them and the combine does not read them. True where every row is routed (the
    tail is empty): the kernels keep the plain schedule, which measured faster there than the skipping one.
    """
    with jax.named_scope("experts"):
        # The routing weights scale the down projection's rows (its epilogue), so the combine is a plain sum, which
        # routed_glu_mlp runs (on the FP8 kernels inside their VJP: the backward then takes the tokens' dy).
        # Gathered by sort_indices, which is apply_capacity's when it ran (so not Routing.sorted_weights).
        row_weights = routing.weights.reshape(-1)[sort_indices]
        return glu_mlp_api.routed_glu_mlp(
            x,
            sort_indices,
            routing.top_k,
            w_gate_up,
            w_down,
            group_sizes,
            activation=activation,
            row_scale=row_weights,
            zero_tail=zero_tail,
            positions=positions,
            backend=backends.experts,
            quantization=backends.quantization,
            combine=backends.combine,
        )
