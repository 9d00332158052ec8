"""Backward kernel of the logits op: the gradient of the shard over 2-D tiles.

Implements :func:`dualvp.spec.target_to_local` and :func:`dualvp.spec.block_grad`
(``indicator="compare"``) of each ``[BLOCK_T, BLOCK_V]`` tile, from the
residuals that the merge kernel wrote (``res [5, T]`` = ``M, log S, c, Mk,
log Sk``, ``spec.Combined``)::

    g_v = (gL (1[v = y] - q_v) + gH p_v (c - d_v)) / tau,   d_v = (z_v - M) / tau

with ``p = e^(d - log S)`` the softmax, ``q`` the distribution over the kept
set (keep mask plus the target; ``q = p`` without a mask, 0 on dropped
columns), no log-prob term on rows whose target is ``ignore_index``, and the
entropy term only when ``ENTROPY`` (the entropy's gradient is needed). One
exponential per element under a mask as in the spec (kept columns shifted by
the kept max, ``p = q e^((Mk - M) / tau) Sk / S`` there). Each row's
statistics and upstream gradients are loaded once per tile, not per element;
the tile is computed in float32 (float64 for float64 input) and written in
the output's dtype, which may be the logits' own storage (``g_ptr = z_ptr``:
each tile reads its elements before it writes them).
"""

import triton
import triton.language as tl

__all__ = ["logits_grad_kernel"]


@triton.jit
def logits_grad_kernel(
    z_ptr, stride_z, g_ptr, stride_g, y_ptr, keep_ptr, stride_k, res_ptr,
    gl_ptr, stride_gl, ge_ptr, stride_ge,
    T, V, v_lo, ignore_index, tau: tl.float64,
    HAS_KEEP: tl.constexpr, ENTROPY: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    inv_tau = (tl.full([], 1.0, tl.float64) / tau).to(COMPUTE)
    ninf = float("-inf")
    # per row, once per tile
    y = tl.load(y_ptr + rows64, mask=rmask, other=ignore_index).to(tl.int64)
    valid = y != ignore_index
    local = y - v_lo
    local = tl.where(valid & (local >= 0) & (local < V), local, -1)
    M = tl.load(res_ptr + rows64, mask=rmask, other=0.0).to(COMPUTE)
    log_s = tl.load(res_ptr + T + rows64, mask=rmask, other=0.0).to(COMPUTE)
    M_sh = tl.where(M == ninf, 0.0, M)
    gl = tl.load(gl_ptr + rows64 * stride_gl, mask=rmask, other=0.0).to(COMPUTE)
    gl = tl.where(valid, gl, 0.0) * inv_tau

    inb = rmask[:, None] & (cols[None, :] < V)
    offs = rows64[:, None] * stride_z + cols[None, :]
    z = tl.load(z_ptr + offs, mask=inb, other=0.0).to(COMPUTE)
    d = (z - M_sh[:, None]) * inv_tau
    is_y = cols[None, :] == local[:, None]
    if HAS_KEEP:
        mk = tl.load(res_ptr + 3 * T + rows64, mask=rmask, other=0.0).to(COMPUTE)
        log_sk = tl.load(res_ptr + 4 * T + rows64, mask=rmask, other=0.0).to(COMPUTE)
        mk_sh = tl.where(mk == ninf, 0.0, mk)
        kept = (tl.load(keep_ptr + rows64[:, None] * stride_k + cols[None, :], mask=inb, other=0) != 0) | is_y
        ek = tl.exp(tl.where(kept, (z - mk_sh[:, None]) * inv_tau - log_sk[:, None], d - log_s[:, None]))
        # 0 on the dropped columns; NaN on a row whose kept set has no mass (0 * -inf), as the oracle
        q = tl.where(kept, ek, (0.0 * log_sk)[:, None])
        if ENTROPY:
            rho = tl.exp((mk_sh - M_sh) * inv_tau + log_sk - log_s)
            p = tl.where(kept, tl.where(rho[:, None] == 0, 0.0, ek * rho[:, None]), ek)
    else:
        p = tl.exp(d - log_s[:, None])
        q = p
    g = tl.where(valid[:, None], gl[:, None] * (tl.where(is_y, 1.0, 0.0) - q), 0.0)
    if ENTROPY:
        c = tl.load(res_ptr + 2 * T + rows64, mask=rmask, other=0.0).to(COMPUTE)
        ge = tl.load(ge_ptr + rows64 * stride_ge, mask=rmask, other=0.0).to(COMPUTE) * inv_tau
        # a banned column (p = 0, d = -inf) adds 0, not 0 * inf; a NaN p propagates
        g += ge[:, None] * tl.where(p == 0, 0.0, p * (c[:, None] - d))
    tl.store(g_ptr + rows64[:, None] * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=inb)
