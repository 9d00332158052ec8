"""Kernels of the KL divergence op (:func:`dualvp_torch.kl_divergence`, ``impl="triton"``).

``kl_stats_kernel`` implements :func:`dualvp.kl_spec.block_stats` of a whole
shard row (the shard is one block: the statistics merge across ranks with
:func:`dualvp.kl_spec.merge_stats` on the host, as the other engines'), and
``kl_grad_kernel`` :func:`dualvp.kl_spec.block_grad` (times the upstream
gradient, rows outside ``row_mask`` zero), each gradient stored in its
operand's dtype.

Statistics: program ``r`` owns row ``r`` and walks its ``V_local`` columns in
blocks of ``BLOCK_V`` (a power of two the host picks from ``V_local`` alone,
never from ``T``: a row's bits do not depend on the other rows). Two passes
over the row: the maxima ``ma``, ``mb`` of the raw logits, then with those
shifts (0 where a maximum is ``-inf``, ``kl_spec._safe_shift``) the sums
``sa = sum e^da``, ``sb = sum e^db`` and ``t = sum e^da (da - db)`` (a term
with ``e^da = 0`` is 0), ``d = (x - shift) / tau``. The block sums are
float32 tree reductions (float64 for float64 input) accumulated across
blocks in float64, so a row of 1e5 columns loses no more than a block's
rounding. Two reads of the shard instead of one online pass with rescaled
sums: simpler, and the statistics stay exactly the spec's (one shift per
row). Columns past ``V_local`` load as ``-inf`` and add nothing.

Gradient: program ``(r, j)`` owns row ``r``, columns ``[j B, (j + 1) B)``;
it reads the row's ``(ma, log_sa, mb, log_sb, kl)`` (``res [5, T]``) and
writes ``p (log p - log q - KL) g / tau`` (0 where ``p = 0``) and / or
``(q - p) g / tau``. The temperature comes as a one-element tensor in the
compute dtype (a Python float argument would be float32 in a float64 run).
"""

import triton
import triton.language as tl

__all__ = ["kl_stats_kernel", "kl_grad_kernel"]


@triton.jit
def kl_stats_kernel(a_ptr, b_ptr, out_ptr, n_cols, stride_a, stride_b, tau_ptr,
                    BLOCK_V: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    a_row = a_ptr + row * stride_a
    b_row = b_ptr + row * stride_b
    ninf = float("-inf")
    offs = tl.arange(0, BLOCK_V)
    ma = tl.full((), ninf, COMPUTE)
    mb = tl.full((), ninf, COMPUTE)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        inside = cols < n_cols
        a = tl.load(a_row + cols, mask=inside, other=ninf).to(COMPUTE)
        b = tl.load(b_row + cols, mask=inside, other=ninf).to(COMPUTE)
        ma = tl.maximum(ma, tl.max(a, axis=0))
        mb = tl.maximum(mb, tl.max(b, axis=0))
    zero = tl.zeros((), COMPUTE)
    sha = tl.where(ma == ninf, zero, ma)
    shb = tl.where(mb == ninf, zero, mb)
    tau_c = tl.load(tau_ptr).to(COMPUTE)
    sa = tl.zeros((), tl.float64)
    sb = tl.zeros((), tl.float64)
    t = tl.zeros((), tl.float64)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offs
        inside = cols < n_cols
        a = tl.load(a_row + cols, mask=inside, other=ninf).to(COMPUTE)
        b = tl.load(b_row + cols, mask=inside, other=ninf).to(COMPUTE)
        da = (a - sha) / tau_c
        db = (b - shb) / tau_c
        ea = tl.exp(da)
        eb = tl.exp(db)
        term = tl.where(ea == 0, tl.zeros_like(ea), ea * (da - db))
        sa += tl.sum(ea, axis=0).to(tl.float64)
        sb += tl.sum(eb, axis=0).to(tl.float64)
        t += tl.sum(term, axis=0).to(tl.float64)
    out = out_ptr + row * 5
    dt = out_ptr.dtype.element_ty
    tl.store(out + 0, ma.to(dt))
    tl.store(out + 1, sa.to(dt))
    tl.store(out + 2, mb.to(dt))
    tl.store(out + 3, sb.to(dt))
    tl.store(out + 4, t.to(dt))


@triton.jit
def kl_grad_kernel(a_ptr, b_ptr, res_ptr, g_ptr, mask_ptr, ga_ptr, gb_ptr, n_rows, n_cols, stride_a, stride_b, tau_ptr,
                   BLOCK_V: tl.constexpr, COMPUTE: tl.constexpr, HAS_MASK: tl.constexpr, WANT_A: tl.constexpr,
                   WANT_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < n_cols
    ma = tl.load(res_ptr + row).to(COMPUTE)
    log_sa = tl.load(res_ptr + n_rows + row).to(COMPUTE)
    mb = tl.load(res_ptr + 2 * n_rows + row).to(COMPUTE)
    log_sb = tl.load(res_ptr + 3 * n_rows + row).to(COMPUTE)
    kl = tl.load(res_ptr + 4 * n_rows + row).to(COMPUTE)
    g = tl.load(g_ptr + row).to(COMPUTE)
    keep = True
    if HAS_MASK:
        keep = tl.load(mask_ptr + row) != 0
        g = tl.where(keep, g, tl.zeros_like(g))
    tau_c = tl.load(tau_ptr).to(COMPUTE)
    g = g / tau_c
    a = tl.load(a_ptr + row * stride_a + cols, mask=inside, other=0.0).to(COMPUTE)
    b = tl.load(b_ptr + row * stride_b + cols, mask=inside, other=0.0).to(COMPUTE)
    log_p = (a - ma) / tau_c - log_sa
    p = tl.exp(log_p)
    log_q = (b - mb) / tau_c - log_sb
    zero = tl.zeros_like(p)
    if WANT_A:
        ga = tl.where(p == 0, zero, p * (log_p - log_q - kl)) * g
        if HAS_MASK:
            ga = tl.where(keep, ga, zero)
        tl.store(ga_ptr + row * n_cols + cols, ga.to(ga_ptr.dtype.element_ty), mask=inside)
    if WANT_B:
        gb = (tl.exp(log_q) - p) * g
        if HAS_MASK:
            gb = tl.where(keep, gb, zero)
        tl.store(gb_ptr + row * n_cols + cols, gb.to(gb_ptr.dtype.element_ty), mask=inside)
