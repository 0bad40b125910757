"""``moe_jax.route``: router logits -> top-k selection, weights and the expert-sorted permutation."""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax._core import backend as dispatch
from moe_jax._core import checks
from moe_jax.ops.routing import config as routing_config
from moe_jax.ops.routing import reference, sm90_vjp
from moe_jax.ops.routing.reference import Routing

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RoutingOptions:
    """How a router turns scores into a top-k selection and weights (everything but ``top_k`` and ``bias``).

    Attributes:
      score: "softmax" (over experts) or "sigmoid" (per expert).
      renormalize: divide the selected scores by their sum.
      num_groups: split E into this many contiguous groups (DeepSeek-V3 group-limited routing); 1 turns it off.
      top_groups: only the best ``top_groups`` groups (a group scores the sum of its two best biased scores) are
        eligible.
      scale: multiplies the final weights.

    Every function that routes takes these as ``routing=RoutingOptions(...)`` or as keywords of the same names.
    """

    score: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    top_groups: int = 1
    scale: float = 1.0

    def __post_init__(self):
        checks.check_choice("score", self.score, SCORES)
        checks.check_static_bool("renormalize", self.renormalize)
        checks.check_positive_int("num_groups", self.num_groups)
        checks.check_positive_int("top_groups", self.top_groups, upper=self.num_groups, upper_name="num_groups")
        checks.check_static_float("scale", self.scale)

    @classmethod
    def of(cls, routing: "RoutingOptions | None", keywords: dict) -> "RoutingOptions":
        """``routing`` (default: the defaults) with the fields named in ``keywords`` replaced; TypeError naming any
        keyword that is not a field."""
        if routing is not None and not isinstance(routing, RoutingOptions):
            raise TypeError(f"routing must be a RoutingOptions, got {type(routing).__name__}")
        fields = {field.name for field in dataclasses.fields(cls)}
        if unknown := sorted(set(keywords) - fields):
            raise TypeError(f"unexpected keyword argument(s) {unknown}; the routing keywords are {sorted(fields)}")
        return dataclasses.replace(routing or cls(), **keywords)

    def check(self, num_experts: int, top_k, bias=None) -> None:
        """Checks the options, ``top_k`` and ``bias`` [E] against E = ``num_experts``."""
        checks.check_positive_int("num_groups", self.num_groups, upper=num_experts, upper_name="E")
        if num_experts % self.num_groups:
            raise ValueError(f"num_groups must divide the number of experts E={num_experts}, got {self.num_groups}")
        eligible = self.top_groups * (num_experts // self.num_groups)
        checks.check_positive_int(
            "top_k",
            top_k,
            upper=eligible,
            upper_name="E" if eligible == num_experts else "top_groups * E / num_groups",
        )
        if bias is not None:
            checks.check_rank("bias", bias, 1, "[E]")
            checks.check_dim("bias", bias.shape[0], num_experts, "length (E, the number of experts)")
            checks.check_float("bias", bias)


@dataclasses.dataclass(frozen=True)
class _RouteCall:
    """What the routing implementations decide on."""

    num_experts: int
    top_k: int
    num_groups: int


def _kernel_unsupported(call: _RouteCall) -> str | None:
    if routing_config.supports(call.num_experts):
        return None
    return f"the gating kernel takes up to {routing_config.MAX_EXPERTS} experts, got E={call.num_experts}"


def _kernel_preferred(call: _RouteCall) -> bool:
    return routing_config.prefers_kernel(call.num_experts, call.top_k, call.num_groups)


# The gating kernel takes any T and every option; it pads E, up to MAX_EXPERTS. "auto" takes it where it measured
# faster than XLA's route.
IMPLEMENTATIONS = (dispatch.Implementation("pallas", _kernel_unsupported, _kernel_preferred), dispatch.XLA)


def select(backend: str, num_experts: int, top_k: int, routing: RoutingOptions) -> str:
    """The implementation ("pallas" or "xla") of ``route`` that ``backend`` selects."""
    call = _RouteCall(num_experts, top_k, routing.num_groups)
    return dispatch.select(f"route (E={num_experts})", backend, IMPLEMENTATIONS, call).name


def route(
    logits: jax.Array,
    top_k: int,
    *,
    routing: RoutingOptions | None = None,
    bias: jax.Array | None = None,
    backend: str = "auto",
    **routing_keywords,
) -> Routing:
    """Routes T tokens over E experts.

    Args:
      logits: [T, E] router logits (any float dtype; scores are computed in f32).
      top_k: experts per token, in [1, E] (in [1, top_groups * E / num_groups] with group-limited routing).
      routing: a ``RoutingOptions`` (score, renormalize, num_groups, top_groups, scale); its fields may also be
        passed as keywords (``route(logits, 8, score="sigmoid")``), which override it.
      bias: [E] f32, added to the scores for *selection only* (aux-loss-free balancing); never changes the weights.
      backend: "auto", "xla" or "pallas".

    Returns:
      ``Routing`` with weights [T, k] f32, experts [T, k] int32 (descending score, ties to the lower id),
      group_sizes [E] int32, sort_indices [T*k] int32 (stable expert-sorted permutation), probs [T, E] f32,
      selected_scores [T, k] f32 (the selected unbiased scores, by which a capacity limit drops), positions [T, k]
      int32 (the inverse of sort_indices), and for the aux losses mean_probs [E] f32 and logsumexp [T] f32.

    Non-finite logits have a defined result on every backend: a NaN selection score (``score + bias``, or a group's
    score from ``inf + (-inf)``) ranks as -inf, so it never beats a number and ties with -inf go to the lower id;
    expert ids are always in [0, E). Scores follow ``jax.nn``: a softmax row holding NaN or +inf, or only -inf, is
    all NaN (so that token takes experts 0..k-1 with NaN weights); a sigmoid score is per expert (NaN stays NaN and
    is never chosen over a number). Weights of a selected NaN score are NaN.
    """
    routing = RoutingOptions.of(routing, routing_keywords)
    _, num_experts = checks.check_rank("logits", logits, 2, "[T, E]")
    checks.check_float("logits", logits)
    routing.check(num_experts, top_k, bias)
    return route_with(select(backend, num_experts, top_k, routing), logits, top_k, routing, bias)


def route_with(implementation: str, logits, top_k: int, routing: RoutingOptions, bias) -> Routing:
    """``route`` by the implementation ``select`` chose, on checked arguments."""
    route_impl = sm90_vjp.route if implementation == "pallas" else reference.route
    return route_impl(logits, top_k, bias=bias, **dataclasses.asdict(routing))


def router_logits(x: jax.Array, router_kernel: jax.Array) -> jax.Array:
    """[T, E] logits ``x @ router_kernel`` of [T, D] tokens and a [D, E] kernel, in f32 (f64 for f64 inputs)."""
    dtype = checks.accumulation_dtype(jnp.promote_types(x.dtype, router_kernel.dtype))
    # The operands multiply as they are, accumulating in f32: the logits of converting both first (a product of two
    # 16-bit floats is exact in f32), without an f32 copy of x, which the backward would otherwise keep (4 bytes per
    # element of x: at DeepSeek-V3's layer on an H200 the conversion took 0.17 ms and the f32 matmul 0.20 ms).
    return lax.dot_general(x, router_kernel, (((1,), (0,)), ((), ())), preferred_element_type=dtype)


def apply_capacity(routing: Routing, capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """Caps every expert at ``ceil(capacity_factor * T * k / E)`` rows, dropping its lowest-score assignments.

    Returns (group_sizes [E] int32, sort_indices [T*k] int32): kept rows sorted by expert (stable), dropped rows last,
    past ``sum(group_sizes)`` — exactly what ``grouped_matmul`` and ``combine`` consume.
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing (what moe_jax.route returns), got {type(routing).__name__}")
    capacity_factor = checks.check_static_float("capacity_factor", capacity_factor)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor}")
    num_tokens, top_k = routing.experts.shape
    num_experts = routing.group_sizes.shape[0]
    capacity = reference.expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    return reference.apply_capacity(routing, capacity)


def balancing_bias_update(bias: jax.Array, expert_counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing step: ``bias_e += rate * sign(mean(counts) - counts_e)`` on [E] arrays."""
    (num_experts,) = checks.check_rank("bias", bias, 1, "[E]")
    checks.check_rank("expert_counts", expert_counts, 1, "[E]")
    checks.check_dim("expert_counts", expert_counts.shape[0], num_experts, "length (E, from bias)")
    return reference.balancing_bias_update(bias, expert_counts, checks.check_static_float("rate", rate))


def load_balancing_loss(routing: Routing) -> jax.Array:
    """f32 scalar ``E * sum_e f_e * P_e`` (f_e: share of the T*k assignments to e; P_e: mean normalised score,
    ``routing.mean_probs``)."""
    return reference.load_balancing_loss(routing)


def z_loss(routing_or_logits: Routing | jax.Array) -> jax.Array:
    """f32 scalar ``mean_t logsumexp(logits_t)^2``, from a ``Routing`` or from [T, E] router logits.

    From a ``Routing`` it averages ``routing.logsumexp``, which the gating kernel computes while it reads the logits
    (no pass over [T, E] of its own); from logits it computes the logsumexps in XLA. Both are differentiable with
    respect to the logits.
    """
    if isinstance(routing_or_logits, Routing):
        return reference.z_loss_from(routing_or_logits.logsumexp)
    checks.check_rank("routing_or_logits", routing_or_logits, 2, "[T, E] (or a Routing)")
    return reference.z_loss(jnp.asarray(routing_or_logits))
