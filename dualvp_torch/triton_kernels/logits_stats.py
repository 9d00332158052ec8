"""Forward kernel of the logits op: a row's statistics over one column split, in one pass.

Implements :func:`dualvp.spec.target_to_local`, :func:`dualvp.spec.block_stats`
(``kept_shift="kept"``, ``entropy_terms="select"``) of each column block and
:func:`dualvp.spec.reduce_stats` of the blocks of a row, online: one read of
the logits (and of the keep mask) per element.

Program ``(r, j)`` owns row ``r`` and the columns ``[j C, (j + 1) C)`` of the
shard (``C = COLS_PER_SPLIT``, a multiple of ``BLOCK_V`` that the host picks
from ``V_local`` alone, never from ``T``: a row's results do not depend on the
other rows), walked in blocks of ``BLOCK_V``. It carries the running max ``m``
of the raw logits, ``s = sum e^d`` and ``t = sum e^d d`` with ``d = (z - m) /
tau``, and the kept pair ``(mk, sk)`` over the keep mask and the target's
column (always kept), all relative to the running maxima. A new block's maxima
rescale the running sums (``reduce_stats`` of two blocks): ``s <- s e^dm +
s_b``, ``t <- e^dm (t + s dm) + t_b`` with ``dm = (m - m') / tau``; the
factor is computed only when a maximum moves (a branch uniform over the
program: one row), as a float32 exponential converted to float64 under a
float32 compute dtype (``_rescale``: no float64 exponential in the loop).
Per block: one max reduction (two operands under a mask) and one sum
reduction of all the block's sums (multi-operand ``tl.reduce``, one set of
barriers). The block sums are float32 tree reductions; the
running sums float64, converted once per block, never per element (float64
input: float64 throughout). ``e^d`` is ``2^u`` with ``u = (z - m) log2(e) /
tau`` (``logits_common.exp2``); ``t`` accumulates ``e u`` and is converted to
``e d`` once per row (``ratio = (1 / tau) / (log2(e) / tau)``, exact for
the ``log2(e) / tau`` that the host rounded). An all ``-inf`` block shifts by 0 and
adds nothing; a NaN or ``+inf`` makes its row's sums NaN (that row only).

Under a keep mask one exponential per element serves both distributions
(``spec._kept_select``): kept columns are shifted by the kept max, the others
by the overall max, and ``e^d`` of a kept column is ``e^dk e^((mk - m) /
tau)``, a per-row factor. The target's column counts as kept without a
per-element compare: the split that owns it starts its kept pair at
``(zy, 1)`` when the mask drops it (one scalar load of the mask per row).

``FINALIZE`` (one rank, one split): writes ``logprob [T]``, ``entropy [T]``
and the residuals ``res [5, T]`` itself (``logits_common.store_outputs``, as
the merge kernel would). Otherwise writes ``[S, T, 6]`` statistics ``(m, s, t,
mk, sk, zy)`` (``spec.STATS``) in the output's dtype for the merge.
The extended op (:mod:`dualvp_torch.extended`, ``spec.ext_block_stats``)
runs this kernel with ``HAS_TARGET=False``: no target in the row statistics
(``zy = 0``, the kept pair over the mask alone; the host gathers the K
targets' logits), ``WITH_SUM_P2``: ``s2 = sum e^(2d)`` as a fourth (fifth
under a mask) operand of the block's sum reduction, rescaled by ``e^(2 dm)``
with ``s`` (written as column 6, ``N_OUT = 7``), and ``ROW_TAU``: ``1/tau``
loaded per row from ``tau_ptr`` and the base-2 scale formed from it as the
host forms the scalars. The base op passes ``HAS_TARGET=True``,
``WITH_SUM_P2=ROW_TAU=False``, ``N_OUT=6``: the code of the kernel without
the switches.

``HAS_COUNTER``: adds the number of rows whose target is neither
``ignore_index`` nor in ``[0, vocab)`` to ``bad_ptr`` (an int32 device counter
that only ``validate=True`` allocates and reads).
"""

import triton
import triton.language as tl

from .logits_common import device_fn, exp2, ln2, log2e, keep_bits, select, store_outputs

__all__ = ["logits_stats_kernel"]


@device_fn
def _max2(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@device_fn
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@device_fn
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@device_fn
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@device_fn
def _rescale(x, COMPUTE: tl.constexpr, COMPILED: tl.constexpr, ACC: tl.constexpr):
    """``2^x`` in ``ACC`` for a rescale of the running sums (``x <= 0``, ``-inf`` before the first finite block).

    float32 compute: the float32 exponential (one ``ex2.approx.ftz``) converted, not a float64 one (some 50
    float64 instructions in the loop body): ``x`` is a float32 product already, whose rounding (``|x| 6e-8``
    relative in the factor) matches the exponential's own (about 2 ulp); a factor that flushes to 0 (below
    ``2^-126``) scales sums dwarfed by the new block's (it holds the new max: its sum is >= 1).
    """
    if COMPUTE == tl.float32:
        f = exp2(x, COMPILED).to(ACC)
    else:
        f = tl.exp2(x.to(ACC))
    return f


@device_fn
def _finite_below(u):
    # -inf (a banned column, e = 0) -> -1e38, so that e u = 0 rather than 0 * -inf; NaN stays NaN (max.NaN)
    return tl.maximum(u, -1.0e38, propagate_nan=tl.PropagateNan.ALL)


@device_fn
def _block(z_row, k_row, cols, c_hi, m, s, t, mk, sk, s2, l2e_tau,
           HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr, COMPILED: tl.constexpr, COMPUTE: tl.constexpr,
           ACC: tl.constexpr, KEEP_VEC: tl.constexpr, MASKED: tl.constexpr, WITH_SUM_P2: tl.constexpr):
    """One column block into the running state ``(m, s, t, mk, sk, s2)``; ``MASKED``: the split's last, partial
    block; ``WITH_SUM_P2`` (with ``WITH_ENTROPY``): ``s2 = sum e^(2d)`` too, as ``sum (e^d)^2``."""
    ninf = float("-inf")
    if MASKED:
        inb = cols < c_hi
        z = tl.load(z_row + cols, mask=inb, other=ninf).to(COMPUTE)
    else:  # a whole block: no predicate, no fill values
        z = tl.load(z_row + cols).to(COMPUTE)
    if HAS_KEEP:
        # the mask's bytes in the logits' layout (KEEP_VEC per thread), as an int32 0 / -1 per element and
        # bitwise selects (logits_common.keep_bits, select): no per-element predicate
        kcols = tl.max_contiguous(tl.multiple_of(cols, KEEP_VEC), KEEP_VEC)
        if MASKED:
            km = keep_bits(tl.load(k_row + kcols, mask=inb, other=0), COMPILED)
        else:
            km = keep_bits(tl.load(k_row + kcols), COMPILED)
        zk = select(km, z, ninf, COMPUTE, COMPILED)
        if COMPILED:  # one reduction of both maxima (one set of barriers)
            bm, bmk = tl.reduce((z, zk), 0, _max2)
        else:  # (the interpreter runs a combine function in Python per element: NumPy's max instead)
            bm, bmk = tl.max(z, axis=0), tl.max(zk, axis=0)
        mk_new = tl.maximum(mk, bmk)
        mk_sh = tl.where(mk_new == ninf, 0.0, mk_new)
    else:
        bm = tl.max(z, axis=0)
    m_new = tl.maximum(m, bm)
    m_sh = tl.where(m_new == ninf, 0.0, m_new)  # spec._finite_or_zero
    if HAS_KEEP:
        if WITH_ENTROPY:
            u = _finite_below((z - m_sh) * l2e_tau)
            ek = exp2((z - select(km, mk_sh, m_sh, COMPUTE, COMPILED)) * l2e_tau, COMPILED)
            rk = exp2((mk_sh - m_sh) * l2e_tau, COMPILED)  # <= 1: e^d of a kept column is ek * rk
            e = select(km, ek * rk, ek, COMPUTE, COMPILED)
            eks = select(km, ek, 0.0, COMPUTE, COMPILED)
            if WITH_SUM_P2:
                if COMPILED:
                    bs, bt, bsk, bs2 = tl.reduce((e, e * u, eks, e * e), 0, _add4)
                else:
                    bs, bt, bsk, bs2 = (tl.sum(e, axis=0), tl.sum(e * u, axis=0), tl.sum(eks, axis=0),
                                        tl.sum(e * e, axis=0))
            elif COMPILED:
                bs, bt, bsk = tl.reduce((e, e * u, eks), 0, _add3)
            else:
                bs, bt, bsk = tl.sum(e, axis=0), tl.sum(e * u, axis=0), tl.sum(eks, axis=0)
        else:  # only the kept columns count: the others' ek (any value, inf or NaN) is dropped by the select
            ek = exp2((z - mk_sh) * l2e_tau, COMPILED)
            bsk = tl.sum(select(km, ek, 0.0, COMPUTE, COMPILED), axis=0)
    else:
        u = _finite_below((z - m_sh) * l2e_tau)
        e = exp2(u, COMPILED)
        if WITH_SUM_P2:
            if COMPILED:
                bs, bt, bs2 = tl.reduce((e, e * u, e * e), 0, _add3)
            else:
                bs, bt, bs2 = tl.sum(e, axis=0), tl.sum(e * u, axis=0), tl.sum(e * e, axis=0)
        elif WITH_ENTROPY:
            if COMPILED:
                bs, bt = tl.reduce((e, e * u), 0, _add2)
            else:
                bs, bt = tl.sum(e, axis=0), tl.sum(e * u, axis=0)
        else:
            bs = tl.sum(e, axis=0)
    if HAS_KEEP:
        # the running kept sum, rescaled to the new kept max (0 stays 0, not 0 * inf; NaN stays NaN)
        if mk_new != mk:
            ak = _rescale((mk - mk_sh) * l2e_tau, COMPUTE, COMPILED, ACC)
            sk = tl.where(sk == 0, 0.0, sk * ak)
        sk += bsk.to(ACC)
        mk = mk_new
    if WITH_ENTROPY or not HAS_KEEP:
        if m_new != m:  # the running max moved: rescale (_rescale), else the factor is exactly 1
            dm32 = (m - m_sh) * l2e_tau  # <= 0; -inf before the first finite block
            a = _rescale(dm32, COMPUTE, COMPILED, ACC)
            dm = dm32.to(ACC)
            s_old = s
            s = tl.where(s_old == 0, 0.0, s_old * a)
            if WITH_ENTROPY:
                t = tl.where(s_old == 0, 0.0, a * (t + s_old * dm))
            if WITH_SUM_P2:
                s2 = tl.where(s2 == 0, 0.0, s2 * (a * a))
        s += bs.to(ACC)
        if WITH_ENTROPY:
            t += bt.to(ACC)
        if WITH_SUM_P2:
            s2 += bs2.to(ACC)
    m = m_new
    return m, s, t, mk, sk, s2


@triton.jit
def logits_stats_kernel(
    z_ptr, stride_z, y_ptr, keep_ptr, stride_k, out_ptr, bad_ptr, logprob_ptr, entropy_ptr, res_ptr, tau_ptr,
    T, V, v_lo, vocab, ignore_index, cols_per_split,
    inv_tau_hi: tl.float32, inv_tau_lo: tl.float32, l2e_tau32: tl.float32, ratio_hi: tl.float32, ratio_lo: tl.float32,
    HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr, HAS_COUNTER: tl.constexpr, FINALIZE: tl.constexpr,
    COMPILED: tl.constexpr, COMPUTE: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr, KEEP_VEC: tl.constexpr,
    HAS_TARGET: tl.constexpr, WITH_SUM_P2: tl.constexpr, ROW_TAU: tl.constexpr, N_OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c_lo = split * cols_per_split
    c_hi = tl.minimum(V, c_lo + cols_per_split)
    if HAS_TARGET:
        # spec.target_to_local, and the range check of validate=True
        y = tl.load(y_ptr + row).to(tl.int64)
        valid = y != ignore_index
        if HAS_COUNTER:
            if split == 0:
                tl.atomic_add(bad_ptr, 1, mask=valid & ((y < 0) | (y >= vocab)), sem="relaxed")
        local64 = y - v_lo
        owns = valid & (local64 >= c_lo) & (local64 < c_hi)  # this split holds the target's column
        local = tl.where(owns, local64, 0).to(tl.int32)
    # base-2 scale: u = (z - m) * l2e_tau, e^d = 2^u
    if ROW_TAU:
        # one temperature per row (compute dtype): the host's scalars below, formed per row in float64
        inv_tau = 1.0 / tl.load(tau_ptr + row).to(tl.float64)
        if COMPUTE == tl.float64:
            l2e_tau = inv_tau * log2e(tl.float64)
            ratio = ln2(tl.float64)
        else:
            l2e_tau = (inv_tau * log2e(tl.float64)).to(tl.float32)  # rounded once, as the host's l2e_tau32
            ratio = inv_tau / l2e_tau.to(tl.float64)
    else:
        # float64 scalars arrive as float32 pairs hi + lo (exact to ~1e-15; Triton's interpreter rounds any float
        # argument to float32)
        inv_tau = tl.cast(inv_tau_hi, tl.float64) + tl.cast(inv_tau_lo, tl.float64)
        if COMPUTE == tl.float64:
            l2e_tau = inv_tau * log2e(tl.float64)
            ratio = ln2(tl.float64)
        else:
            l2e_tau = l2e_tau32
            ratio = tl.cast(ratio_hi, tl.float64) + tl.cast(ratio_lo, tl.float64)

    z_row = z_ptr + row * stride_z
    if HAS_TARGET:
        # zy: one gather per row, not a compare-and-sum over the row
        zy = tl.load(z_row + local, mask=owns, other=0.0).to(COMPUTE)
        zy = tl.where(owns, zy, 0.0)
    else:  # the extended op's statistics (spec.ext_block_stats): no target in the row statistics, zy = 0
        zy = tl.zeros([], COMPUTE)

    ninf = float("-inf")
    m = tl.full([], ninf, COMPUTE)
    s = tl.zeros([], ACC)
    t = tl.zeros([], ACC)  # in base-2 units (sum e u) until the end
    mk = tl.full([], ninf, COMPUTE)
    sk = tl.zeros([], ACC)
    s2 = tl.zeros([], ACC)
    k_row = keep_ptr + row * stride_k
    if HAS_KEEP and HAS_TARGET:
        # the target is kept whatever the mask says: a dropped target starts the kept pair as (zy, e^0)
        # (a target at -inf adds nothing: e^-inf = 0, and an all -inf kept set keeps (-inf, 0))
        y_dropped = owns & (tl.load(k_row + local, mask=owns, other=1) == 0) & (zy != ninf)
        mk = tl.where(y_dropped, zy, mk)
        sk = tl.where(y_dropped, 1.0, sk).to(ACC)
    cols0 = tl.arange(0, BLOCK_V)
    c_full = c_lo + (c_hi - c_lo) // BLOCK_V * BLOCK_V
    for v0 in range(c_lo, c_full, BLOCK_V):
        m, s, t, mk, sk, s2 = _block(z_row, k_row, v0 + cols0, c_hi, m, s, t, mk, sk, s2, l2e_tau, HAS_KEEP,
                                     WITH_ENTROPY, COMPILED, COMPUTE, ACC, KEEP_VEC, False, WITH_SUM_P2)
    if c_full < c_hi:
        m, s, t, mk, sk, s2 = _block(z_row, k_row, c_full + cols0, c_hi, m, s, t, mk, sk, s2, l2e_tau, HAS_KEEP,
                                     WITH_ENTROPY, COMPILED, COMPUTE, ACC, KEEP_VEC, True, WITH_SUM_P2)
    t = t * ratio  # sum e u -> sum e d
    if not HAS_KEEP:
        mk = m
        sk = s
    elif not WITH_ENTROPY:
        s = tl.full([], 1.0, ACC)  # placeholder that merges like a sum (spec.block_stats)
    if FINALIZE:
        f64 = tl.float64
        store_outputs(logprob_ptr, entropy_ptr, res_ptr, row, T, row < T, m.to(f64), s.to(f64), t.to(f64),
                      mk.to(f64), sk.to(f64), zy.to(f64), valid, inv_tau)
    else:
        base = out_ptr + (split * T + row) * N_OUT
        dt = out_ptr.dtype.element_ty
        tl.store(base + 0, m.to(dt))
        tl.store(base + 1, s.to(dt))
        tl.store(base + 2, t.to(dt))
        tl.store(base + 3, mk.to(dt))
        tl.store(base + 4, sk.to(dt))
        tl.store(base + 5, zy.to(dt))
        if WITH_SUM_P2:  # (N_OUT = 7)
            tl.store(base + 6, s2.to(dt))
