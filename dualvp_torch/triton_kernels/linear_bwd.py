"""Backward of the fused LM-head op: recompute the tile, form its gradient in registers, then ``dh`` and ``dW``.

Implements :func:`dualvp.spec.block_grad` of the logits block
``z = h_i W_j^T`` (recomputed as in :mod:`.linear_fwd`) from the combined
statistics (:class:`dualvp.spec.Combined`: ``M, log_s, c, mk, log_sk``), and
the two products of the spec's fused-op section::

    dh_i += G_ij W_j        (summed over the vocabulary blocks j)
    dW_j += G_ij^T h_i      (summed over the row blocks i)

Grid: ``(cdiv(T, BLOCK_T), cdiv(V, BLOCK_V))``, one program per tile.
``STORE_G`` (the default, ``Tuning.triton_linear_backward == "gemm"``): the
tile's ``G`` is written to a chunk buffer instead and the host multiplies it
on cuBLAS; what follows describes the in-kernel products (``"atomic"``). ``G``
is float32 in registers; for the products it is rounded to the operand dtype
(``SPLIT_G=False``) or split into a high and a low part of that dtype
(``G = G_hi + G_lo`` up to ~16 significant bits, two products each), so that
16-bit operands run on tensor cores; every product accumulates in float32 and
is added with ``tl.atomic_add`` into float32 ``dh [T, H]`` and ``dW [V, H]``
buffers, which the host rounds once to the input dtype. The adds are relaxed
(``sem="relaxed"``: fire-and-forget reductions, no fence per add): nothing in
the kernel reads them back, and the kernel's end orders them before the host's
next use. ``SPLIT_G=False`` (``gradient_rounding="once"``): ``G`` rounded once,
as every peer does (8 T H V executed FLOP per credited 8 T H V); the split (this
path's ``"split"``, and the default ``"fixed"``, which it runs as the split) executes 12. Columns at or past
``V`` and rows at or past ``T`` get ``G = 0``. Float32 operands multiply in
IEEE float32 or TF32 (``PRECISION``); ``UPCAST`` converts 16-bit operands to
float32 after loading (the CPU interpreter mis-computes ``tl.dot`` on
bfloat16), ``G`` still rounded (or split) through the input dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .linear_tile import dot, tile_logits

__all__ = ["linear_fix_dw_kernel", "linear_grad_kernel"]


@triton.jit
def linear_grad_kernel(
    h_ptr, w_ptr, ycol_ptr, keep_ptr,
    M_ptr, log_s_ptr, c_ptr, mk_ptr, log_sk_ptr, gl_ptr, ge_ptr,
    dh_ptr, dw_ptr, g_hi_ptr, g_lo_ptr, stride_g, fix_ptr,
    T, V, H, col0,
    stride_ht, stride_hk, stride_wv, stride_wk, stride_kt, stride_kv,
    inv_tau,
    HAS_KEEP: tl.constexpr, HAS_ENT_GRAD: tl.constexpr, NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
    SPLIT_G: tl.constexpr, STORE_G: tl.constexpr, FIX_G: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr,
):
    """Add this tile's ``G W_j`` to ``dh [T, H]`` and ``G^T h_i`` to ``dW [V, H]`` (float32, contiguous).

    With ``STORE_G`` it writes the tile's ``G`` in the operand dtype instead
    (``G_hi``, and ``G_lo`` with ``SPLIT_G``) into ``g_hi``/``g_lo [T, V]``
    (row stride ``stride_g``, chunk-local columns) and multiplies nothing:
    the host forms ``dh += G W`` and ``dW = G^T h`` with cuBLAS (the
    Liger/verl backward; no product atomics). ``FIX_G`` (with ``STORE_G``,
    ``G`` rounded once): ``fix [3, T]`` int64 also receives, per row, shard
    columns and their rounding residuals ``G - rnd(G)`` (float32 bits),
    packed ``column << 32 | bits``: slot 0 the target's (a store), slots 1
    and 2 the lowest and the highest column with ``p_v > 1/3`` (the unmasked
    distribution) other than the target, at most two per row since ``p``
    sums to 1, possibly in two tiles: a relaxed ``tl.atomic_min`` into slot
    1 (the host's ``INT64_MAX`` where none) and ``tl.atomic_max`` into slot 2
    (the host's ``-1``) of each tile's lowest / highest candidate (the
    column in the high bits orders them: the same entries in any tile
    order; one candidate lands in both). The host adds them back as rank-1
    terms (:func:`linear_fix_dw_kernel`; :func:`dualvp_torch.linear_triton._unpack`).

    ``w``, ``keep`` and ``dW`` start at the shard's column ``col0`` (a
    vocabulary chunk of ``V`` columns: its float32 ``dW`` buffer is
    ``V * H``); ``ycol`` holds columns of the whole shard.

    ``ycol [T]`` int64: the target's column in this shard where the shard
    owns it, ``-1`` for a valid row whose target lies elsewhere, ``-2`` for
    an ignored row. ``gl``, ``ge`` (when ``HAS_ENT_GRAD``), ``M`` ...
    ``log_sk``: ``[T]`` float32 (``c`` only with ``HAS_ENT_GRAD``).
    """
    # Tile order: launch index -> (row block, column block) in groups of GROUP_T row blocks, column
    # blocks fastest within a group, so that the CTAs resident at one time share GROUP_T row blocks'
    # dh (kept in L2 across the group's column sweep) rather than all row blocks' (a full sweep of dh
    # through HBM per column block). GROUP_T >= cdiv(T, BLOCK_T): the launch order, row blocks fastest
    # (one column block's dW hot, dh swept).
    n_t = tl.num_programs(0)
    n_v = tl.num_programs(1)
    pid = tl.program_id(1) * n_t + tl.program_id(0)
    per_group = GROUP_T * n_v
    first_t = (pid // per_group) * GROUP_T
    group_rows = tl.minimum(n_t - first_t, GROUP_T)
    pid_t = first_t + (pid % per_group) % group_rows
    pid_v = (pid % per_group) // group_rows
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # 64-bit offsets: T * V may pass 2^31
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    row_ok = rows < T
    col_ok = cols < V
    ks = tl.arange(0, BLOCK_K)
    neg_inf = float("-inf")

    # the tile's logits, exactly as the forward formed them
    acc = tile_logits(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_ht, stride_hk, stride_wv, stride_wk,
                      UPCAST, PRECISION, BLOCK_T, BLOCK_V, BLOCK_K)
    z = tl.where(col_ok[None, :], acc, neg_inf)

    ycol = tl.load(ycol_ptr + rows, mask=row_ok, other=-2)
    valid = ycol >= -1
    is_y = (cols + col0)[None, :] == ycol[:, None]
    M = tl.load(M_ptr + rows, mask=row_ok, other=0.0)
    log_s = tl.load(log_s_ptr + rows, mask=row_ok, other=0.0)
    gl = tl.load(gl_ptr + rows, mask=row_ok, other=0.0)
    Ms = tl.where(M == neg_inf, 0.0, M)
    d = (z - Ms[:, None]) * inv_tau
    if HAS_ENT_GRAD:
        d = tl.maximum(d, -3.4028234663852886e38)  # banned columns: e^d = 0 and p (c - d) = 0, not NaN
    e_all = tl.exp(d - log_s[:, None])
    if HAS_KEEP:
        mk = tl.load(mk_ptr + rows, mask=row_ok, other=0.0)
        log_sk = tl.load(log_sk_ptr + rows, mask=row_ok, other=0.0)
        kb = tl.load(keep_ptr + rows[:, None] * stride_kt + cols[None, :] * stride_kv,
                     mask=row_ok[:, None] & col_ok[None, :], other=0)
        kept = (kb != 0) | is_y
        mks = tl.where(mk == neg_inf, 0.0, mk)
        ek = tl.exp(tl.where(kept, (z - mks[:, None]) * inv_tau - log_sk[:, None], d - log_s[:, None]))
        q = tl.where(kept, ek, (0.0 * log_sk)[:, None])
        if HAS_ENT_GRAD:
            rho = tl.exp((mk - Ms) * inv_tau + log_sk - log_s)[:, None]
            p = tl.where(kept, tl.where(rho == 0, 0.0, ek * rho), ek)
    else:
        q = e_all
        p = e_all
    one_y = tl.where(is_y, 1.0, 0.0)
    g = tl.where(valid[:, None], (tl.where(valid, gl, 0.0) * inv_tau)[:, None] * (one_y - q), 0.0)
    if HAS_ENT_GRAD:
        c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
        ge = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
        g += (ge * inv_tau)[:, None] * (p * (c[:, None] - d))
    g = tl.where(row_ok[:, None] & col_ok[None, :], g, 0.0)

    # G rounded (or split hi + lo) to the operand dtype
    odt = h_ptr.dtype.element_ty
    g_hi = g.to(odt)
    g_lo = (g - g_hi.to(tl.float32)).to(odt)
    if STORE_G:  # the products run outside (cuBLAS) on the stored chunk of G
        g_off = rows[:, None] * stride_g + cols[None, :]
        g_ok = row_ok[:, None] & col_ok[None, :]
        tl.store(g_hi_ptr + g_off, g_hi, mask=g_ok)
        if SPLIT_G:
            tl.store(g_lo_ptr + g_off, g_lo, mask=g_ok)
        if FIX_G:  # the rounding residuals at the target column and at the columns with p > 1/3, per row
            # packed (shard column << 32 | float32 bits of G - rnd(G)): one 64-bit value per slot, so a
            # reader never pairs one column with another column's residual. The column and the residual
            # reduced separately, over an int32 column tile (one [BLOCK_T, BLOCK_V] int64 tile of packed
            # values instead: 255 registers and a 104-byte stack with a keep mask, sm_90, Triton 3.6)
            res = g - g_hi.to(tl.float32)
            live = g_ok & valid[:, None]
            lcol = tl.arange(0, BLOCK_V)  # the tile's columns, int32
            # the target: one column per row, known from ycol; its residual the tile's one entry there
            first = col0 + pid_v * BLOCK_V
            has_y = row_ok & (ycol >= first) & (ycol < first + BLOCK_V) & (ycol < col0 + V)
            res_y = tl.sum(tl.where(live & is_y, res, 0.0), axis=1)
            at_y = (ycol << 32) | res_y.to(tl.uint32, bitcast=True).to(tl.int64)
            tl.store(fix_ptr + rows, at_y, mask=has_y)
            # p_v > 1/3, not the target: at most two columns per row (p sums to 1), in one tile or two. No
            # tile knows the other's, so slot 1 takes the row's lowest candidate column (atomic min of the
            # packed values: the column in the high bits) and slot 2 its highest (atomic max): the same
            # entries in any tile order; one candidate lands in both slots (the host drops slot 2 then)
            is_c = live & (e_all > 1 / 3) & (~is_y)
            c_lo = tl.min(tl.where(is_c, lcol[None, :], BLOCK_V), axis=1)
            c_hi = tl.max(tl.where(is_c, lcol[None, :], -1), axis=1)
            res_lo = tl.sum(tl.where(is_c & (lcol[None, :] == c_lo[:, None]), res, 0.0), axis=1)
            res_hi = tl.sum(tl.where(is_c & (lcol[None, :] == c_hi[:, None]), res, 0.0), axis=1)
            some = row_ok & (c_hi >= 0)
            lo = ((first + c_lo.to(tl.int64)) << 32) | res_lo.to(tl.uint32, bitcast=True).to(tl.int64)
            hi = ((first + c_hi.to(tl.int64)) << 32) | res_hi.to(tl.uint32, bitcast=True).to(tl.int64)
            tl.atomic_min(fix_ptr + T + rows, lo, mask=some, sem="relaxed")
            tl.atomic_max(fix_ptr + 2 * T + rows, hi, mask=some, sem="relaxed")
    else:  # (no early return: Triton's code generator would compile the statements after it too)
        # the products in the kernel: float32 accumulation, added to dh and dW
        if UPCAST:
            g_hi = g_hi.to(tl.float32)
            g_lo = g_lo.to(tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < H
            if NEED_DH:
                wb = tl.load(w_ptr + cols[:, None] * stride_wv + kk[None, :] * stride_wk,
                             mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:
                    wb = wb.to(tl.float32)
                part = dot(g_hi, wb, tl.zeros((BLOCK_T, BLOCK_K), tl.float32), PRECISION)
                if SPLIT_G:
                    part = dot(g_lo, wb, part, PRECISION)
                tl.atomic_add(dh_ptr + rows[:, None] * H + kk[None, :], part,
                              mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
            if NEED_DW:
                hb = tl.load(h_ptr + rows[:, None] * stride_ht + kk[None, :] * stride_hk,
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:
                    hb = hb.to(tl.float32)
                part = dot(tl.trans(g_hi), hb, tl.zeros((BLOCK_V, BLOCK_K), tl.float32), PRECISION)
                if SPLIT_G:
                    part = dot(tl.trans(g_lo), hb, part, PRECISION)
                tl.atomic_add(dw_ptr + cols[:, None] * H + kk[None, :], part,
                              mask=col_ok[:, None] & k_ok[None, :], sem="relaxed")


@triton.jit
def linear_fix_dw_kernel(acc_ptr, h_ptr, rows_ptr, res_ptr, bounds_ptr, H, stride_a, stride_ht, stride_hk,
                         BLOCK_H: tl.constexpr):
    """``acc[c] += sum_e res[e] h[rows[e]]`` over the entries ``e in [bounds[c], bounds[c + 1])``, in entry order.

    The rank-1 residual terms of ``dW`` (``dW[c] += d_t h_t``, spec fused-op
    section with ``G = rnd(G) + d``) added into a vocabulary chunk's float32
    ``dW`` block ``acc [chunk, H]`` before its one rounding: grid ``(chunk,
    cdiv(H, BLOCK_H))``; the entries sorted by column (row order within a
    column), so the sums run in one order on every run (no atomics).
    """
    c = tl.program_id(0)
    kk = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k_ok = kk < H
    lo = tl.load(bounds_ptr + c)
    hi = tl.load(bounds_ptr + c + 1)
    if hi > lo:
        a = tl.load(acc_ptr + c * stride_a + kk, mask=k_ok, other=0.0)
        for e in range(lo, hi):
            t = tl.load(rows_ptr + e).to(tl.int64)  # (int32 rows: T * H may pass 2^31)
            d = tl.load(res_ptr + e)
            a += d * tl.load(h_ptr + t * stride_ht + kk * stride_hk, mask=k_ok, other=0.0).to(tl.float32)
        tl.store(acc_ptr + c * stride_a + kk, a, mask=k_ok)
