"""Forward kernel of the logits op: the shard's row statistics in one pass.

Implements :func:`dualvp.spec.target_to_local`, :func:`dualvp.spec.block_stats`
(``kept_shift="kept"``, ``entropy_terms="select"``) of each column block and
:func:`dualvp.spec.reduce_stats` of the blocks of a row, online: one read of
the logits (and of the keep mask) per element.

Program ``i`` owns rows ``[i*BLOCK_T, (i+1)*BLOCK_T)`` and walks the shard's
``V_local`` columns in blocks of ``BLOCK_V``. Per row it carries the running
max ``m`` of the raw logits, ``s = sum e^d`` and ``t = sum e^d d`` with
``d = (z - m) / tau``, and the kept pair ``(mk, sk)`` over the keep mask and
the target's column (always kept), all relative to the running maxima. A new
block's maxima rescale the running sums (``reduce_stats`` of two blocks):
``s <- s e^dm + s_b``, ``t <- e^dm (t + s dm) + t_b`` with ``dm = (m - m') /
tau``. The block sums are float32 tree reductions; the running sums are
float64, converted once per block, never per element (float64 input:
float64 throughout). An all ``-inf`` block shifts by 0 and adds nothing; a
NaN or ``+inf`` makes its row's sums NaN (that row only).

Under a keep mask one exponential per element serves both distributions
(``spec._kept_select``): kept columns are shifted by the kept max, the others
by the overall max, and ``e^d`` of a kept column is ``e^dk * e^((mk - m) /
tau)``, a per-row factor.

Writes ``[T, 6]`` statistics ``(m, s, t, mk, sk, zy)`` (``spec.STATS``) in the
output's dtype, and adds the number of rows whose target is neither
``ignore_index`` nor in ``[0, vocab)`` to ``bad_ptr`` (an int32 device
counter that only ``validate=True`` reads).
"""

import triton
import triton.language as tl

__all__ = ["logits_stats_kernel"]


@triton.jit
def logits_stats_kernel(
    z_ptr, stride_z, y_ptr, keep_ptr, stride_k, out_ptr, bad_ptr,
    T, V, v_lo, vocab, ignore_index, tau: tl.float64,
    HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr, COMPUTE: tl.constexpr, ACC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    inv_tau = (tl.full([], 1.0, tl.float64) / tau).to(COMPUTE)  # tau: float64; one division per program
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    # spec.target_to_local, and the range check of validate=True
    y = tl.load(y_ptr + rows64, mask=rmask, other=ignore_index).to(tl.int64)
    valid = y != ignore_index
    bad = valid & ((y < 0) | (y >= vocab)) & rmask
    tl.atomic_add(bad_ptr + tl.zeros([BLOCK_T], tl.int32), tl.full([BLOCK_T], 1, tl.int32), mask=bad)
    local = y - v_lo
    owns = valid & (local >= 0) & (local < V) & rmask
    local = tl.where(owns, local, -1)  # -1: no column of this shard is the target

    z_row = z_ptr + rows64 * stride_z
    # zy: one gather per row, not a compare-and-sum over the row
    zy = tl.load(z_row + tl.where(owns, local, 0), mask=owns, other=0.0).to(COMPUTE)
    zy = tl.where(owns, zy, 0.0)

    ninf = float("-inf")
    m = tl.full([BLOCK_T], ninf, COMPUTE)
    s = tl.zeros([BLOCK_T], ACC)
    t = tl.zeros([BLOCK_T], ACC)
    mk = tl.full([BLOCK_T], ninf, COMPUTE)
    sk = tl.zeros([BLOCK_T], ACC)
    cols0 = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        inb = rmask[:, None] & (cols[None, :] < V)
        z = tl.load(z_row[:, None] + cols[None, :], mask=inb, other=ninf).to(COMPUTE)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_sh = tl.where(m_new == ninf, 0.0, m_new)  # spec._finite_or_zero
        d = (z - m_sh[:, None]) * inv_tau
        if HAS_KEEP:
            kept = (tl.load(keep_ptr + rows64[:, None] * stride_k + cols[None, :], mask=inb, other=0) != 0)
            kept = kept | (cols[None, :] == local[:, None])
            mk_new = tl.maximum(mk, tl.max(tl.where(kept, z, ninf), axis=1))
            mk_sh = tl.where(mk_new == ninf, 0.0, mk_new)
            ek = tl.exp(tl.where(kept, (z - mk_sh[:, None]) * inv_tau, d))
            bsk = tl.sum(tl.where(kept, ek, 0.0), axis=1)
            # the running kept sum, rescaled to the new kept max (0 stays 0, not 0 * inf; NaN stays NaN)
            ak = tl.exp(((mk - mk_sh) * inv_tau).to(ACC))
            sk = tl.where(sk == 0, 0.0, sk * ak) + bsk.to(ACC)
            mk = mk_new
            if WITH_ENTROPY:
                rk = tl.exp((mk_sh - m_sh) * inv_tau)  # <= 1: e^d of a kept column is ek * rk
                e = tl.where(kept, ek * rk[:, None], ek)
        else:
            e = tl.exp(d)
        if WITH_ENTROPY or not HAS_KEEP:
            dm = ((m - m_sh) * inv_tau).to(ACC)  # <= 0; -inf before the first finite block
            a = tl.exp(dm)
            s_old = s
            s = tl.where(s_old == 0, 0.0, s_old * a) + tl.sum(e, axis=1).to(ACC)
            if WITH_ENTROPY:
                # e d, 0 where e = 0 (a banned column: 0 * -inf)
                bt = tl.sum(tl.where(e > 0, e * d, 0.0), axis=1).to(ACC)
                t = tl.where(s_old == 0, 0.0, a * (t + s_old * dm)) + bt
        m = m_new
    if not HAS_KEEP:
        mk = m
        sk = s
    elif not WITH_ENTROPY:
        s = tl.full([BLOCK_T], 1.0, ACC)  # placeholder that merges like a sum (spec.block_stats)
    base = out_ptr + rows64 * 6
    dt = out_ptr.dtype.element_ty
    tl.store(base + 0, m.to(dt), mask=rmask)
    tl.store(base + 1, s.to(dt), mask=rmask)
    tl.store(base + 2, t.to(dt), mask=rmask)
    tl.store(base + 3, mk.to(dt), mask=rmask)
    tl.store(base + 4, sk.to(dt), mask=rmask)
    tl.store(base + 5, zy.to(dt), mask=rmask)
