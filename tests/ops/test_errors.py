"""Bad input fails at trace time with ValueError / TypeError naming the argument and what was expected."""

import jax
import jax.numpy as jnp
import pytest

import moe_jax
from moe_jax._core import backend as dispatch

T, D, F, E, K, M, N, G = 8, 16, 4, 6, 2, 10, 12, 3


def _ok():
    f32 = jnp.float32
    return dict(
        logits=jnp.ones((T, E), f32),
        x=jnp.ones((T, D), f32),
        router_kernel=jnp.ones((D, E), f32),
        w_gate_up=jnp.ones((E, D, 2 * F), f32),
        w_down=jnp.ones((E, F, D), f32),
        lhs=jnp.ones((M, D), f32),
        rhs=jnp.ones((G, D, N), f32),
        group_sizes=jnp.array([3, 3, 4], jnp.int32),
    )


def _route(**overrides):
    args = dict(logits=_ok()["logits"], top_k=K) | overrides
    return lambda: moe_jax.route(args.pop("logits"), args.pop("top_k"), **args)


def _gmm(**overrides):
    ok = _ok()
    args = dict(lhs=ok["lhs"], rhs=ok["rhs"], group_sizes=ok["group_sizes"]) | overrides
    return lambda: moe_jax.grouped_matmul(args.pop("lhs"), args.pop("rhs"), args.pop("group_sizes"), **args)


def _moe(**overrides):
    ok = _ok()
    args = dict(x=ok["x"], router_kernel=ok["router_kernel"], w_gate_up=ok["w_gate_up"], w_down=ok["w_down"])
    args |= dict(top_k=K) | overrides
    return lambda: moe_jax.moe_ffn(
        args.pop("x"), args.pop("router_kernel"), args.pop("w_gate_up"), args.pop("w_down"), **args
    )


routing = moe_jax.route(_ok()["logits"], K)

BAD_INPUTS = {
    # route
    "logits rank": (_route(logits=jnp.ones((T,))), ValueError, r"logits must have shape \[T, E\]"),
    "logits dtype": (_route(logits=jnp.ones((T, E), jnp.int32)), TypeError, "logits must have dtype"),
    "top_k zero": (_route(top_k=0), ValueError, r"top_k must be in \[1, E\]"),
    "top_k above E": (_route(top_k=E + 1), ValueError, r"top_k must be in \[1, E\]"),
    "top_k not int": (_route(top_k=2.0), TypeError, "top_k must be a Python int"),
    "score unknown": (_route(score="relu"), ValueError, "score must be one of"),
    "num_groups not dividing E": (_route(num_groups=4), ValueError, "num_groups must divide"),
    "top_groups above num_groups": (_route(num_groups=3, top_groups=4), ValueError, "top_groups must be in"),
    "top_k above eligible experts": (
        _route(num_groups=3, top_groups=1, top_k=3),
        ValueError,
        r"top_k must be in \[1, top_groups \* E / num_groups\]",
    ),
    "bias length": (_route(bias=jnp.zeros(E + 1)), ValueError, "bias: length"),
    "bias rank": (_route(bias=jnp.zeros((1, E))), ValueError, r"bias must have shape \[E\]"),
    "scale traced": (_route(scale=jnp.float32(2.0)), TypeError, "scale must be a Python float"),
    "renormalize traced": (_route(renormalize=jnp.asarray(True)), TypeError, "renormalize must be a Python bool"),
    "backend unknown": (_route(backend="cuda"), ValueError, "backend must be one of"),
    # grouped_matmul
    "lhs rank": (_gmm(lhs=jnp.ones((M, D, 1))), ValueError, r"lhs must have shape \[M, K\]"),
    "rhs rank": (_gmm(rhs=jnp.ones((D, N))), ValueError, r"rhs must have shape \[G, K, N\]"),
    "rhs K mismatch": (_gmm(rhs=jnp.ones((G, D + 1, N))), ValueError, r"rhs must have shape \[G, K, N\] with K=16"),
    "rhs K-major mismatch": (_gmm(transpose_rhs=True), ValueError, r"rhs must have shape \[G, N, K\] with K=16"),
    "group_sizes float": (_gmm(group_sizes=jnp.ones(G)), TypeError, "group_sizes must be an integer array"),
    "group_sizes length": (_gmm(group_sizes=jnp.ones(G + 1, jnp.int32)), ValueError, r"group_sizes: length \(G"),
    "group_sizes rank": (_gmm(group_sizes=jnp.ones((G, 1), jnp.int32)), ValueError, r"group_sizes must have shape"),
    "dtype mismatch": (_gmm(lhs=jnp.ones((M, D), jnp.bfloat16)), TypeError, "lhs and rhs must have the same dtype"),
    "integer lhs": (_gmm(lhs=jnp.ones((M, D), jnp.int8)), TypeError, "lhs must have dtype"),
    "activation unknown": (_gmm(activation="relu"), ValueError, "activation must be one of"),
    "odd N with GLU": (_gmm(rhs=jnp.ones((G, D, N + 1)), activation="swiglu"), ValueError, "must be even"),
    "packed block": (
        _gmm(rhs=moe_jax.PackedGateUp(jnp.ones((G, D, 128)), 32), activation="swiglu"),
        ValueError,
        r"rhs.block must be gate_up_block\(F\) = 64 for F = 64",
    ),
    "row_scale length": (_gmm(row_scale=jnp.ones(M + 1)), ValueError, r"row_scale: length \(M"),
    "output dtype": (_gmm(preferred_element_type=jnp.int32), TypeError, "preferred_element_type must be one of"),
    "gmm backend": (_gmm(backend="triton"), ValueError, "backend must be one of"),
    # moe_ffn
    "x rank": (_moe(x=jnp.ones((T,))), ValueError, r"x must have shape \[T, D\]"),
    "router D": (_moe(router_kernel=jnp.ones((D + 1, E))), ValueError, r"router_kernel: shape\[0\]"),
    "w_gate_up experts": (_moe(w_gate_up=jnp.ones((E + 1, D, 2 * F))), ValueError, r"w_gate_up must have shape"),
    "w_gate_up odd": (_moe(w_gate_up=jnp.ones((E, D, 2 * F + 1))), ValueError, r"w_gate_up must have shape"),
    "w_down shape": (_moe(w_down=jnp.ones((E, F + 1, D))), ValueError, r"w_down must have shape \[E, F, D\]"),
    "moe mixed dtypes": (_moe(w_down=jnp.ones((E, F, D), jnp.bfloat16)), TypeError, "must share one compute dtype"),
    "moe activation none": (_moe(activation=None), ValueError, "activation must be one of"),
    "capacity_factor negative": (_moe(capacity_factor=-1.0), ValueError, "capacity_factor must be > 0"),
    "moe top_k": (_moe(top_k=E + 1), ValueError, r"top_k must be in \[1, E\]"),
    # permute / combine
    "sort_indices length": (
        lambda: moe_jax.permute(_ok()["x"], routing.sort_indices[:-1], K),
        ValueError,
        r"sort_indices: length \(T \* top_k\)",
    ),
    "sort_indices dtype": (
        lambda: moe_jax.permute(_ok()["x"], routing.sort_indices.astype(jnp.float32), K),
        TypeError,
        "sort_indices must be an integer array",
    ),
    "combine weights shape": (
        lambda: moe_jax.combine(jnp.ones((T * K, D)), routing.sort_indices, K, jnp.ones((T, K + 1))),
        ValueError,
        r"weights must have shape \[T, k\]",
    ),
    "combine integer weights": (
        lambda: moe_jax.combine(jnp.ones((T * K, D)), routing.sort_indices, K, jnp.ones((T, K), jnp.int32)),
        TypeError,
        "weights must have dtype",
    ),
    "permute positions shape": (
        lambda: moe_jax.permute(_ok()["x"], routing.sort_indices, K, positions=routing.positions.T),
        ValueError,
        r"positions must have shape \[T, k\]",
    ),
    "combine float positions": (
        lambda: moe_jax.combine(
            jnp.ones((T * K, D)), routing.sort_indices, K, positions=routing.positions.astype(jnp.float32)
        ),
        TypeError,
        "positions must be an integer array",
    ),
    "capacity without a routing": (
        lambda: moe_jax.apply_capacity(None, 1.0),
        TypeError,
        "routing must be a Routing",
    ),
    "not an array": (lambda: moe_jax.route([[1.0, 2.0]], 1), TypeError, "logits must be an array"),
    "z_loss of a vector": (
        lambda: moe_jax.z_loss(jnp.ones(E)),
        ValueError,
        r"routing_or_logits must have shape \[T, E\] \(or a Routing\)",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_rejected_at_trace_time(name):
    call, error, message = BAD_INPUTS[name]
    with pytest.raises(error, match=message):
        # Under a trace: the check must fire on abstract values, before any computation.
        jax.eval_shape(call)


def test_pallas_backend_without_a_kernel_names_the_op_and_the_reason():
    table = (dispatch.Implementation("pallas", lambda call: f"K={call} is odd"), dispatch.XLA)
    with pytest.raises(NotImplementedError, match="some_op: K=3 is odd; use backend='xla'"):
        dispatch.select("some_op", "pallas", table, 3)
    assert dispatch.select("some_op", "auto", table, 3).name == "xla"
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.select("some_op", "triton", table, 3)


def test_pallas_backend_prefers_the_preferred_kernel_and_takes_another_when_none_is():
    table = (
        dispatch.Implementation("pallas_a", preferred=lambda call: call > 0),
        dispatch.Implementation("pallas_b", lambda call: "too large" if call > 5 else None, lambda call: call < 0),
        dispatch.XLA,
    )
    assert dispatch.select("op", "pallas", table, 1).name == "pallas_a"
    assert dispatch.select("op", "pallas", table, -3).name == "pallas_b"
    assert dispatch.select("op", "pallas", table, 0).name == "pallas_a"  # none prefers it: the first that can
    assert dispatch.select("op", "pallas_b", table, 1).name == "pallas_b"
    with pytest.raises(NotImplementedError, match="op: too large"):
        dispatch.select("op", "pallas_b", table, 9)
    kernel_host = dispatch.has_sm90_gpu()  # "auto" takes kernels on an sm90 GPU only
    assert dispatch.select("op", "auto", table, 1).name == ("pallas_a" if kernel_host else "xla")
