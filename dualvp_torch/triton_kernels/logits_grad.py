"""Backward kernel of the logits op: the gradient of the shard, one row per program.

Implements :func:`dualvp.spec.target_to_local` and :func:`dualvp.spec.block_grad`
(``indicator="compare"``) of each ``[1, BLOCK_V]`` tile of a row, from the
residuals that the merge (or the statistics) kernel wrote (``res [5, T]`` =
``M, log S, c, Mk, log Sk``, ``spec.Combined``)::

    g_v = (gL (1[v = y] - q_v) + gH p_v (c - d_v)) / tau,   d_v = (z_v - M) / tau

with ``p = e^(d - log S)`` the softmax, ``q`` the distribution over the kept
set (keep mask plus the target; ``q = p`` without a mask, 0 on dropped
columns), no log-prob term on rows whose target is ``ignore_index`` (a branch
uniform over the program), and the entropy term only when ``ENTROPY`` (the
entropy's gradient is needed). One exponential per element under a mask as
in the spec (kept columns shifted by the kept max, ``p = q e^((Mk - M) / tau)
Sk / S`` there). Program ``(r, j)`` owns row ``r``, columns ``[j BLOCK_V, (j +
1) BLOCK_V)``: the row's statistics and upstream gradients are scalars,
loaded once. ``1/tau`` and ``log2(e)/tau`` come rounded from the host (no
division here); exponentials are ``2^u`` with ``u = (z - M) log2(e) / tau``
(``logits_common.exp2``), ``d = u ln 2`` folded into the entropy term's
per-row factor. The target's column is an int32 compare. The tile is
computed in float32 (float64 for float64 input) and written in the output's
dtype, which may be the logits' own storage (``g_ptr = z_ptr``: each program
reads its elements before it writes them).
"""

import triton
import triton.language as tl

from .logits_common import exp2, ln2, log2e, keep_bits, select

__all__ = ["logits_grad_kernel", "logits_ext_grad_kernel", "EXT_COEF"]


@triton.jit
def logits_grad_kernel(
    z_ptr, stride_z, g_ptr, stride_g, y_ptr, keep_ptr, stride_k, res_ptr,
    gl_ptr, stride_gl, ge_ptr, stride_ge,
    T, V, v_lo, ignore_index,
    inv_tau_hi: tl.float32, inv_tau_lo: tl.float32, l2e_tau32: tl.float32,
    HAS_KEEP: tl.constexpr, ENTROPY: tl.constexpr, COMPILED: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_V: tl.constexpr, KEEP_VEC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_V
    cols = col0 + tl.arange(0, BLOCK_V)
    l2e = log2e(COMPUTE)
    if COMPUTE == tl.float64:  # float64 scalars arrive as float32 pairs hi + lo (see logits_stats)
        inv_tau = tl.cast(inv_tau_hi, tl.float64) + tl.cast(inv_tau_lo, tl.float64)
        l2e_tau = inv_tau * l2e
    else:
        inv_tau = inv_tau_hi  # 1/tau rounded once to float32
        l2e_tau = l2e_tau32
    ninf = float("-inf")
    # per row, once per program
    y = tl.load(y_ptr + row).to(tl.int64)
    valid = y != ignore_index
    local = y - v_lo
    local = tl.where(valid & (local >= 0) & (local < V), local, -1).to(tl.int32)
    has_y = (local >= col0) & (local < col0 + BLOCK_V)  # this program holds the target's column
    z_row = z_ptr + row * stride_z
    zy = tl.load(z_row + local, mask=has_y, other=0.0).to(COMPUTE)  # before any store (in place: g = z)
    M = tl.load(res_ptr + row).to(COMPUTE)
    ls2 = tl.load(res_ptr + T + row).to(COMPUTE) * l2e  # log S in base 2
    M_sh = tl.where(M == ninf, 0.0, M)
    gl = tl.load(gl_ptr + row * stride_gl).to(COMPUTE) * inv_tau
    if HAS_KEEP:
        mk = tl.load(res_ptr + 3 * T + row).to(COMPUTE)
        log_sk = tl.load(res_ptr + 4 * T + row).to(COMPUTE)
        mk_sh = tl.where(mk == ninf, 0.0, mk)
        lsk2 = log_sk * l2e
        if ENTROPY:
            rho = tl.exp2((mk_sh - M_sh) * l2e_tau + (lsk2 - ls2))  # p = q rho on the kept columns
    if ENTROPY:
        c2 = tl.load(res_ptr + 2 * T + row).to(COMPUTE) * l2e
        ge = tl.load(ge_ptr + row * stride_ge).to(COMPUTE) * (inv_tau * ln2(COMPUTE))

    # every column as if it were not the target; the target's own value is stored after (below)
    inb = cols < V
    z = tl.load(z_row + cols, mask=inb, other=0.0).to(COMPUTE)
    u = (z - M_sh) * l2e_tau  # d log2(e)
    if HAS_KEEP:
        # the mask's bytes in the logits' layout (KEEP_VEC per thread: the logits' 16-byte vector), as an int32
        # 0 / -1 per element and bitwise selects (logits_common.keep_bits, select)
        kcols = tl.max_contiguous(tl.multiple_of(cols, KEEP_VEC), KEEP_VEC)
        km = keep_bits(tl.load(keep_ptr + row * stride_k + kcols, mask=inb, other=0), COMPILED)
        # kept columns shifted by the kept max (their q), the others by the max (their p)
        shift = select(km, mk_sh, M_sh, COMPUTE, COMPILED)
        ek = exp2((z - shift) * l2e_tau - select(km, lsk2, ls2, COMPUTE, COMPILED), COMPILED)
        # 0 on the dropped columns; NaN on a row whose kept set has no mass (0 * -inf), as the oracle
        q = select(km, ek, 0.0 * log_sk, COMPUTE, COMPILED)
        if ENTROPY:
            p = select(km, tl.where(rho == 0, 0.0, ek * rho), ek, COMPUTE, COMPILED)
    else:
        p = exp2(u - ls2, COMPILED)
        q = p
    if valid:
        g = -gl * q
    else:
        g = tl.zeros([BLOCK_V], COMPUTE)
    if ENTROPY:
        # gH p (c - d) / tau = (gH ln2 / tau) p (c log2(e) - u); a banned column (p = 0, u = -inf) adds 0, not
        # 0 * inf: u is bounded below by -1e38 (NaN stays NaN)
        g += ge * (p * (c2 - tl.maximum(u, -1.0e38, propagate_nan=tl.PropagateNan.ALL)))
    g_row = g_ptr + row * stride_g
    tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=inb)
    if has_y:
        # the target's column: kept whatever the mask says, indicator 1; one scalar after the tile (a barrier
        # orders it after the tile's store of the same address), no per-element compare in the tile
        uy = (zy - M_sh) * l2e_tau
        if HAS_KEEP:
            qy = tl.exp2((zy - mk_sh) * l2e_tau - lsk2)
            if ENTROPY:
                py = tl.where(rho == 0, 0.0, qy * rho)
        else:
            qy = tl.exp2(uy - ls2)
            py = qy
        gy = gl * (1.0 - qy)
        if ENTROPY:
            gy += ge * tl.where(py == 0, 0.0, py * (c2 - uy))
        tl.debug_barrier()
        tl.store(g_row + local, gy.to(g_ptr.dtype.element_ty))


#: the rows of the extended gradient kernel's per-row coefficients ``coef [len, T]`` (compute dtype)
EXT_COEF = ("M", "log_s", "c", "sum_p2", "A", "GE", "GS", "Mk", "l2e_tau")


@triton.jit
def logits_ext_grad_kernel(
    z_ptr, stride_z, g_ptr, stride_g, keep_ptr, stride_k, coef_ptr, T, V,
    HAS_KEEP: tl.constexpr, ENTROPY: tl.constexpr, SUM_P2: tl.constexpr, COMPILED: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_V: tl.constexpr, KEEP_VEC: tl.constexpr,
):
    """:func:`dualvp.spec.ext_block_grad` with ``target_terms=False`` of a ``[1, BLOCK_V]`` tile (the extended op).

    Per row, from ``coef [9, T]`` (:data:`EXT_COEF`) that the host formed from
    ``spec.ext_finalize`` (O(T K) work: :mod:`dualvp_torch.extended`): ``M``,
    ``log S``, ``c``, ``sum_p2``, ``A``, ``GE = gH ln2 / tau``, ``GS = 2 gS /
    tau``, the shared kept max ``Mk`` (over the mask alone) and ``log2(e) /
    tau`` (one temperature per row, or the same for all). ``A`` is the q-term's row
    coefficient: ``sum_k gL_k / tau`` without a mask (``q^k = p``), ``sum_k
    gL_k e^((Mk - Mk_k) / tau - log Sk_k) / tau`` with one (on a kept column
    ``q^k_v = e^((z_v - Mk) / tau)`` times target k's factor)::

        g_v = -A p_v                      (no mask)
              -A e^((z_v - Mk) / tau)     (kept column; 0 on a dropped one)
              + GE p_v (c log2(e) - u_v)  (ENTROPY, u = (z - M) log2(e) / tau)
              + GS p_v (p_v - sum_p2)     (SUM_P2)

    One exponential per element under a mask (kept columns shifted by the
    kept max, ``p = e^((z - Mk) / tau) e^((Mk - M) / tau - log S)`` there), as
    in :func:`logits_grad_kernel`. The K targets' own terms (at most K columns
    per row) are not here: the host writes those columns' values over the
    tile afterwards (``spec.ext_block_grad`` on the gathered columns, one
    scatter), so the tile has no per-element compare with K targets.
    """
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_V
    cols = col0 + tl.arange(0, BLOCK_V)
    l2e = log2e(COMPUTE)
    ninf = float("-inf")
    cr = coef_ptr + row
    M = tl.load(cr).to(COMPUTE)
    ls2 = tl.load(cr + T).to(COMPUTE) * l2e  # log S in base 2
    A = tl.load(cr + 4 * T).to(COMPUTE)
    l2e_tau = tl.load(cr + 8 * T).to(COMPUTE)
    M_sh = tl.where(M == ninf, 0.0, M)
    if ENTROPY:
        c2 = tl.load(cr + 2 * T).to(COMPUTE) * l2e
        ge = tl.load(cr + 5 * T).to(COMPUTE)
    if SUM_P2:
        p2 = tl.load(cr + 3 * T).to(COMPUTE)
        gs = tl.load(cr + 6 * T).to(COMPUTE)

    inb = cols < V
    z_row = z_ptr + row * stride_z
    z = tl.load(z_row + cols, mask=inb, other=0.0).to(COMPUTE)
    u = (z - M_sh) * l2e_tau
    if HAS_KEEP:
        mk = tl.load(cr + 7 * T).to(COMPUTE)
        mk_sh = tl.where(mk == ninf, 0.0, mk)
        kcols = tl.max_contiguous(tl.multiple_of(cols, KEEP_VEC), KEEP_VEC)
        km = keep_bits(tl.load(keep_ptr + row * stride_k + kcols, mask=inb, other=0), COMPILED)
        # kept columns: e^((z - Mk) / tau) (<= 1); dropped: p
        ek = exp2((z - select(km, mk_sh, M_sh, COMPUTE, COMPILED)) * l2e_tau - select(km, 0.0, ls2, COMPUTE, COMPILED),
                  COMPILED)
        g = select(km, -A * ek, 0.0, COMPUTE, COMPILED)
        if ENTROPY or SUM_P2:
            rho = tl.exp2((mk_sh - M_sh) * l2e_tau - ls2)  # p = ek rho on the kept columns
            p = select(km, ek * rho, ek, COMPUTE, COMPILED)
    else:
        p = exp2(u - ls2, COMPILED)
        g = -A * p
    if ENTROPY:
        # a banned column (p = 0, u = -inf) adds 0, not 0 * inf (see logits_grad_kernel)
        g += ge * (p * (c2 - tl.maximum(u, -1.0e38, propagate_nan=tl.PropagateNan.ALL)))
    if SUM_P2:
        g += gs * (p * (p - p2))
    tl.store(g_ptr + row * stride_g + cols, g.to(g_ptr.dtype.element_ty), mask=inb)
