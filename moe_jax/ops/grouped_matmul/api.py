"""``moe_jax.grouped_matmul``: a drop-in for ``jax.lax.ragged_dot`` with a gated-activation epilogue.

backend="pallas" runs the sm90 Mosaic GPU kernels (forward, dgrad, wgrad) behind a ``custom_vjp``; the GLU and the
row scale are applied by XLA after the GEMM (computed in f32) until the kernel epilogue fuses them.
"""

import functools

import jax
import jax.numpy as jnp

from moe_jax._core import checks, hardware
from moe_jax._core.backend import resolve_backend
from moe_jax.ops.grouped_matmul import reference, schedule, sm90, sm90_wgrad
from moe_jax.ops.grouped_matmul.config import get_config
from moe_jax.ops.grouped_matmul.reference import ACTIVATIONS

OUTPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
# Mosaic GPU tiles a whole operand in GMEM by its 128-byte swizzle width (64 bf16 elements) for TMA, so K and N must
# be multiples of it; M is padded to a multiple of 8 rows (the shared-memory tile height) when it is not one.
KERNEL_DIM_MULTIPLE = 64
KERNEL_ROW_MULTIPLE = 8


def kernel_unsupported(lhs, contraction: int, num_cols: int) -> str | None:
    """Why the Pallas kernels cannot run this call (None when they can)."""
    if jnp.dtype(lhs.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
        return f"lhs and rhs must be bfloat16 or float16 for backend='pallas', got {jnp.dtype(lhs.dtype).name}"
    for name, size in (("K", contraction), ("N", num_cols)):
        if size <= 0 or size % KERNEL_DIM_MULTIPLE:
            return f"{name} must be a positive multiple of {KERNEL_DIM_MULTIPLE} for backend='pallas', got {size}"
    return None


def check_grouped_matmul_args(
    lhs, rhs, group_sizes, *, activation, row_scale, preferred_element_type, transpose_rhs, backend="xla"
) -> tuple[int, int, int, int]:
    """Validates the arguments of ``grouped_matmul``; returns (M, K, N, G).

    With ``backend="pallas"`` the kernels' constraints are checked too (NotImplementedError naming the dimension).
    """
    num_rows, contraction = checks.check_rank("lhs", lhs, 2, "[M, K]")
    rhs_layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    num_groups, *rhs_dims = checks.check_rank("rhs", rhs, 3, rhs_layout)
    rhs_contraction, num_cols = reversed(rhs_dims) if transpose_rhs else rhs_dims
    if rhs_contraction != contraction:
        raise ValueError(
            f"rhs must have shape {rhs_layout} with K={contraction} (from lhs [M, K]), got shape {rhs.shape}"
        )
    checks.check_rank("group_sizes", group_sizes, 1, "[G]")
    checks.check_int32("group_sizes", group_sizes)
    checks.check_dim("group_sizes", group_sizes.shape[0], num_groups, "length (G, rhs.shape[0])")
    checks.check_float("lhs", lhs)
    checks.check_float("rhs", rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if activation is not None:
        checks.check_choice("activation", activation, (None, *ACTIVATIONS))
        if num_cols % 2:
            raise ValueError(
                f"rhs: with activation={activation!r} N holds [gate | up] and must be even, got {num_cols}"
            )
    if row_scale is not None:
        checks.check_rank("row_scale", row_scale, 1, "[M]")
        checks.check_dim("row_scale", row_scale.shape[0], num_rows, "length (M, lhs.shape[0])")
        checks.check_float("row_scale", row_scale)
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) not in map(jnp.dtype, OUTPUT_DTYPES):
        raise TypeError(
            f"preferred_element_type must be one of float32, bfloat16, float16 or None, got {preferred_element_type}"
        )
    if backend == "pallas" and (reason := kernel_unsupported(lhs, contraction, num_cols)):
        raise NotImplementedError(f"grouped_matmul: {reason}; use backend='xla' (or 'auto', which falls back to it)")
    return num_rows, contraction, num_cols, num_groups


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str | None = None,
    row_scale: jax.Array | None = None,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """Ragged grouped matmul: rows ``[offset_g, offset_g + group_sizes[g])`` of ``lhs`` multiply ``rhs[g]``.

    Args:
      lhs: [M, K] rows sorted by group.
      rhs: [G, K, N] weights, or [G, N, K] (K-major) with ``transpose_rhs=True``; same dtype as lhs.
      group_sizes: [G] int32 rows per group; rows at or past ``sum(group_sizes)`` give zeros.
      activation: None, or "swiglu" / "geglu" / "gpt_oss": N holds ``[gate | up]`` (F = N/2 each) and the result is
        ``act(gate) * up`` of shape [M, F] (see DESIGN §3 for gpt_oss's clamp).
      row_scale: optional [M] float multiplying each output row (routing weights folded into the down projection).
      preferred_element_type: output dtype (default: lhs.dtype); accumulation is always f32.
      transpose_rhs: rhs is laid out [G, N, K].
      backend: "auto", "xla" or "pallas". "pallas" (the default on an H100/H200 under "auto") needs bf16/f16 inputs
        and K, N multiples of 64; "auto" falls back to "xla" where those do not hold.

    Returns:
      [M, N], or [M, N/2] with an activation.
    """
    check_grouped_matmul_args(
        lhs,
        rhs,
        group_sizes,
        activation=activation,
        row_scale=row_scale,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
        backend=backend,
    )
    contraction = lhs.shape[1]
    num_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    supported = kernel_unsupported(lhs, contraction, num_cols) is None
    if resolve_backend(backend, op="grouped_matmul", has_kernel=supported) == "xla":
        return reference.grouped_matmul(
            lhs,
            rhs,
            group_sizes.astype(jnp.int32),
            activation=activation,
            row_scale=row_scale,
            preferred_element_type=preferred_element_type,
            transpose_rhs=transpose_rhs,
        )
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    epilogue = activation is not None or row_scale is not None
    # The XLA epilogue (until the kernel fuses it) works on the f32 GEMM result, as the reference does.
    out = _pallas_grouped_matmul(
        lhs, rhs, group_sizes.astype(jnp.int32), jnp.float32 if epilogue else out_dtype, transpose_rhs
    )
    if activation is not None:
        gate, up = jnp.split(out, 2, axis=-1)
        out = reference.gated_activation(gate, up, activation)
    if row_scale is not None:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return out.astype(out_dtype)


# ------------------------------------------------------------------------------------------- Pallas path + custom_vjp


def _padded_rows(x: jax.Array) -> jax.Array:
    """x with its rows padded to a multiple of KERNEL_ROW_MULTIPLE (a copy only when M is not one already)."""
    extra = -x.shape[0] % KERNEL_ROW_MULTIPLE
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


def run_rows_kernel(kind, x, w, group_sizes, *, w_transposed, out_dtype, config=None):
    """fwd / dgrad kernel: out[M, C] = x[M, R] · w[g] per group (w [G, R, C], or [G, C, R] when ``w_transposed``).

    ``config=None`` takes config.get_config's choice for the op's (G, M, K, N); the tuning script passes its own.
    """
    m = x.shape[0]
    num_groups, *w_dims = w.shape
    r, c = reversed(w_dims) if w_transposed else w_dims
    # The table is keyed by the op's K, N (rhs [G, K, N]): dgrad's contraction R is the op's N.
    k, n = (c, r) if kind == "dgrad" else (r, c)
    if config is None:
        config = get_config(kind, m=m, k=k, n=n, g=num_groups, out_itemsize=jnp.dtype(out_dtype).itemsize)
    x = _padded_rows(x)
    tiles, num_tiles = schedule.row_tiles(group_sizes, x.shape[0], config.block_m)
    out = sm90.grouped_matmul_rows(
        x,
        w,
        tiles,
        num_tiles,
        w_transposed=w_transposed,
        out_dtype=out_dtype,
        config=config,
        num_sms=hardware.num_sms(),
        interpret=hardware.interpret_params(),
    )
    return out[:m]


def run_wgrad_kernel(x, y, group_sizes, *, out_dtype, config=None, transposed=False):
    """wgrad kernel: out[g] = x[rows of g]^T · y[rows of g] -> [G, P, Q] (the op's [G, K, N], or [G, N, K] when
    ``transposed``, which only matters for the config lookup)."""
    m, p, q = x.shape[0], x.shape[1], y.shape[1]
    k, n = (q, p) if transposed else (p, q)
    if config is None:
        itemsize = jnp.dtype(out_dtype).itemsize
        config = get_config("wgrad", m=m, k=k, n=n, g=group_sizes.shape[0], out_itemsize=itemsize)
    x, y = _padded_rows(x), _padded_rows(y)
    return sm90_wgrad.grouped_matmul_wgrad(
        x,
        y,
        schedule.wgrad_groups(group_sizes, x.shape[0]),
        out_dtype=out_dtype,
        config=config,
        num_sms=hardware.num_sms(),
        interpret=hardware.interpret_params(),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs):
    """lhs [M, K] · rhs[g] ([G, K, N], or [G, N, K] with ``transpose_rhs``) -> [M, N] in ``out_dtype``."""
    return run_rows_kernel("fwd", lhs, rhs, group_sizes, w_transposed=transpose_rhs, out_dtype=out_dtype)


def _pallas_fwd(lhs, rhs, group_sizes, out_dtype, transpose_rhs):
    return _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs), (lhs, rhs, group_sizes)


def _pallas_bwd(out_dtype, transpose_rhs, residuals, d_out):
    """d lhs = d_out · rhs[g]^T (the rows kernel reading rhs the other way round); d rhs = lhs_g^T · d_out_g."""
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)  # wgmma multiplies equal dtypes; accumulation stays f32
    d_lhs = run_rows_kernel("dgrad", d_out, rhs, group_sizes, w_transposed=not transpose_rhs, out_dtype=lhs.dtype)
    # [G, N, K] weights get their gradient in the same layout: d_out_g^T · lhs_g.
    x, y = (d_out, lhs) if transpose_rhs else (lhs, d_out)
    d_rhs = run_wgrad_kernel(x, y, group_sizes, out_dtype=rhs.dtype, transposed=transpose_rhs)
    return d_lhs, d_rhs, None


_pallas_grouped_matmul.defvjp(_pallas_fwd, _pallas_bwd)
