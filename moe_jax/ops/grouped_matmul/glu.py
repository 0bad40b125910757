"""The gated activations (GLUs): the one definition, value and hand-derived gradient.

Written with the operations Mosaic GPU lowers on register arrays (exp, tanh, min/max, select, arithmetic), so the
same functions serve the XLA reference and the kernels' epilogues (passed to them as plain functions: a kernel holds
no activation policy). The tests hold them to an independent NumPy float64 oracle and ``glu_grad`` to ``jax.vjp`` of
that oracle's JAX form.

    swiglu   h = g s(g) u                          d_g = d_h u s(g) (1 + g (1 - s(g)))     d_u = d_h g s(g)
    geglu    h = gelu_tanh(g) u                    d_g = d_h u gelu_tanh'(g)               d_u = d_h gelu_tanh(g)
    gpt_oss  g' = min(g, 7), u' = clip(u, -7, 7)   h = (u' + 1) g' s(1.702 g')

with s the logistic sigmoid. At a clamp bound the derivative is 1/2, as jax.numpy differentiates min/max at a tie.

The backward works from the pre-activation the forward kept in the input dtype (bf16). gpt_oss's derivative jumps at
its clamp bounds, and plain rounding moves values within half a bf16 step of +-7 (0.016) onto or across a bound:
with a tenth of the pre-activations beyond the clamp that flips enough gradients for a 2e-2 relative error in d x.
``kept_pre_activation`` therefore rounds every value to the nearest representable one *on its own side* of each
bound, so the backward's clamp masks are exactly those of the f32 forward.
"""

import math

import jax
import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "geglu", "gpt_oss")

# GPT-OSS clamps the gate from above and the up projection on both sides, and uses a sharpened sigmoid.
GPT_OSS_LIMIT = 7.0
GPT_OSS_ALPHA = 1.702
GELU_C = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


def _sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))


def _clamp_grad(x: jax.Array, d: jax.Array, low: float | None, high: float) -> jax.Array:
    """d * (derivative of clip(x, low, high)): d inside, d / 2 at a bound, 0 outside."""
    inside = x < high if low is None else (x > low) & (x < high)
    at_bound = x == high if low is None else (x == low) | (x == high)
    return jnp.where(inside, d, jnp.where(at_bound, 0.5 * d, 0.0))


def _step_at(value: float, dtype) -> float:
    """The spacing of ``dtype``'s representable numbers around ``value`` (a non-power-of-two)."""
    return 2.0 ** math.floor(math.log2(abs(value))) * float(jnp.finfo(dtype).eps)


def _keep_side(x: jax.Array, rounded: jax.Array, bound: float, step: float) -> jax.Array:
    """``rounded`` (x rounded), moved back to x's side of ``bound`` where rounding reached or crossed it."""
    rounded = jnp.where((x > bound) & (rounded <= bound), bound + step, rounded)
    return jnp.where((x < bound) & (rounded >= bound), bound - step, rounded)


def kept_pre_activation(gate: jax.Array, up: jax.Array, activation: str, dtype) -> tuple[jax.Array, jax.Array]:
    """(gate, up) f32 -> f32 values exactly representable in ``dtype``: what the backward keeps (see above)."""
    _check(activation)
    gate_rounded, up_rounded = gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32)
    if activation != "gpt_oss":
        return gate_rounded, up_rounded
    step = _step_at(GPT_OSS_LIMIT, dtype)
    gate_rounded = _keep_side(gate, gate_rounded, GPT_OSS_LIMIT, step)
    up_rounded = _keep_side(up, _keep_side(up, up_rounded, GPT_OSS_LIMIT, step), -GPT_OSS_LIMIT, step)
    return gate_rounded, up_rounded


def _check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def glu(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """h = act(gate) * up for arrays of one shape, computed in their dtype (call it with f32 or f64):
    swiglu ``silu(g) u``, geglu ``gelu_tanh(g) u`` (``jax.nn.gelu``'s default form), gpt_oss
    ``(u' + 1) g' sigmoid(1.702 g')`` with ``g' = min(g, 7)``, ``u' = clip(u, -7, 7)``."""
    _check(activation)
    if activation == "swiglu":
        return gate * _sigmoid(gate) * up
    if activation == "geglu":
        return 0.5 * gate * (1.0 + jnp.tanh(GELU_C * (gate + GELU_CUBIC * gate * gate * gate))) * up
    gate = jnp.minimum(gate, GPT_OSS_LIMIT)
    up = jnp.clip(up, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return (up + 1.0) * gate * _sigmoid(GPT_OSS_ALPHA * gate)


def glu_grad(gate: jax.Array, up: jax.Array, d_h: jax.Array, activation: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(h, d_gate, d_up) of h = glu(gate, up) for the cotangent d_h; f32 arrays of one shape."""
    _check(activation)
    if activation == "swiglu":
        sig = _sigmoid(gate)
        act = gate * sig
        return act * up, d_h * up * sig * (1.0 + gate * (1.0 - sig)), d_h * act
    if activation == "geglu":
        tanh = jnp.tanh(GELU_C * (gate + GELU_CUBIC * gate * gate * gate))
        act = 0.5 * gate * (1.0 + tanh)
        d_act = 0.5 * (1.0 + tanh) + 0.5 * gate * (1.0 - tanh * tanh) * GELU_C * (1.0 + 3.0 * GELU_CUBIC * gate * gate)
        return act * up, d_h * up * d_act, d_h * act
    clamped_gate = jnp.minimum(gate, GPT_OSS_LIMIT)
    clamped_up = jnp.clip(up, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    sig = _sigmoid(GPT_OSS_ALPHA * clamped_gate)
    act = clamped_gate * sig
    d_act = sig * (1.0 + GPT_OSS_ALPHA * clamped_gate * (1.0 - sig))
    d_gate = _clamp_grad(gate, d_h * (clamped_up + 1.0) * d_act, None, GPT_OSS_LIMIT)
    d_up = _clamp_grad(up, d_h * act, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return (clamped_up + 1.0) * act, d_gate, d_up
