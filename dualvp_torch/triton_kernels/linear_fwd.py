"""Forward of the fused LM-head op: ``z = h W^T`` tile by tile on tensor cores, statistics in the epilogue.

Implements :func:`dualvp.spec.block_stats` (``kept_shift="kept"``, the
target always kept) of the logits block ``z = h_i W_j^T`` for every vocabulary
block ``j`` of a program's vocabulary split, merged over the split's blocks
with the combine of :func:`dualvp.spec.reduce_stats` (online, in registers).
The logits never leave the chip. Each program writes its rows' ``[BLOCK_T, 6]``
statistics ``(m, s, t, mk, sk, zy)`` to ``out[split, row]``;
:func:`linear_merge_splits_kernel` merges the splits row by row in index
order, and the host merges the ranks as the logits op does (one all-gather).

Grid: ``(cdiv(T, BLOCK_T), n_splits)``; split ``p`` covers the vocabulary
blocks ``[p * blocks_per_split, (p + 1) * blocks_per_split)`` of
``BLOCK_V`` columns. Columns at or past ``V`` (the last block's padding) get
``-inf`` logits, so they enter no sum and no maximum.

Precision: the tile product accumulates in float32 (``tl.dot``: 16-bit
operands on tensor cores; float32 operands in IEEE float32 or TF32,
``PRECISION``); all statistics are float32. ``UPCAST`` converts the loaded
operands to float32 before the product (exact): Triton's CPU interpreter
mis-computes ``tl.dot`` on bfloat16 operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .linear_tile import tile_logits

__all__ = ["linear_stats_kernel", "linear_merge_splits_kernel"]


@triton.jit
def _merge_run(m_run, s_run, t_run, m_b, s_b, t_b, inv_tau):
    # reduce_stats of two (max, sum e^d, sum e^d d) triples, d = (z - max) / tau.
    m_new = tl.maximum(m_run, m_b)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    da = (m_run - shift) * inv_tau
    db = (m_b - shift) * inv_tau
    wa = tl.exp(da)
    wb = tl.exp(db)
    # w == 0 exactly where the part is all -inf (its s is 0, its dm -inf): no 0 * inf.
    s_new = wa * s_run + wb * s_b
    t_new = wa * (t_run + tl.where(wa > 0, s_run * da, 0.0)) + wb * (t_b + tl.where(wb > 0, s_b * db, 0.0))
    return m_new, s_new, t_new


@triton.jit
def linear_stats_kernel(
    h_ptr, w_ptr, ycol_ptr, keep_ptr, out_ptr,
    T, V, H, blocks_per_split,
    stride_ht, stride_hk, stride_wv, stride_wk, stride_kt, stride_kv,
    inv_tau,
    HAS_KEEP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out [n_splits, T, 6]`` = block statistics of ``h [T, H] W [V, H]^T`` per vocabulary split.

    ``ycol [T]`` int64: the target's column in this shard where the shard
    owns it, else negative. ``keep [T, V]`` (uint8, any strides) when
    ``HAS_KEEP``. ``inv_tau = 1 / tau``.
    """
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # 64-bit offsets: T * V may pass 2^31
    row_ok = rows < T
    ycol = tl.load(ycol_ptr + rows, mask=row_ok, other=-1)

    neg_inf = float("-inf")
    m = tl.full((BLOCK_T,), neg_inf, tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    t = tl.zeros((BLOCK_T,), tl.float32)
    mk = tl.full((BLOCK_T,), neg_inf, tl.float32)
    sk = tl.zeros((BLOCK_T,), tl.float32)
    zy = tl.zeros((BLOCK_T,), tl.float32)
    zero = tl.zeros((BLOCK_T,), tl.float32)

    for b in range(blocks_per_split):
        j0 = (pid_s * blocks_per_split + b) * BLOCK_V
        cols = j0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < V
        acc = tile_logits(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_ht, stride_hk, stride_wv, stride_wk,
                          UPCAST, PRECISION, BLOCK_T, BLOCK_V, BLOCK_K)
        z = tl.where(col_ok[None, :], acc, neg_inf)  # padded columns: no mass
        is_y = cols[None, :] == ycol[:, None]

        # (m, s, t) of this block, shifted by its own max, then merged (spec.block_stats / reduce_stats)
        m_b = tl.max(z, axis=1)
        shift_b = tl.where(m_b == neg_inf, 0.0, m_b)
        d = (z - shift_b[:, None]) * inv_tau
        e = tl.exp(d)
        s_b = tl.sum(e, axis=1)
        t_b = tl.sum(tl.where(e > 0, e * d, 0.0), axis=1)
        m, s, t = _merge_run(m, s, t, m_b, s_b, t_b, inv_tau)
        zy += tl.sum(tl.where(is_y, z, 0.0), axis=1)

        if HAS_KEEP:
            kb = tl.load(keep_ptr + rows[:, None] * stride_kt + cols[None, :] * stride_kv,
                         mask=row_ok[:, None] & col_ok[None, :], other=0)
            kept = (kb != 0) | is_y
            zk = tl.where(kept, z, neg_inf)
            mk_b = tl.max(zk, axis=1)
            shk = tl.where(mk_b == neg_inf, 0.0, mk_b)
            sk_b = tl.sum(tl.exp((zk - shk[:, None]) * inv_tau), axis=1)
            mk, sk, _ = _merge_run(mk, sk, zero, mk_b, sk_b, zero, inv_tau)

    if not HAS_KEEP:
        mk = m
        sk = s
    base = out_ptr + (pid_s * T + rows) * 6
    tl.store(base + 0, m, mask=row_ok)
    tl.store(base + 1, s, mask=row_ok)
    tl.store(base + 2, t, mask=row_ok)
    tl.store(base + 3, mk, mask=row_ok)
    tl.store(base + 4, sk, mask=row_ok)
    tl.store(base + 5, zy, mask=row_ok)


@triton.jit
def linear_merge_splits_kernel(part_ptr, out_ptr, T, n_splits, inv_tau, BLOCK: tl.constexpr):
    """``out [T, 6]`` = the ``[n_splits, T, 6]`` statistics merged split after split (:func:`dualvp.spec.reduce_stats`).

    One program per ``BLOCK`` rows; each row merges its splits in index order
    with the combine of the forward's epilogue, so a row's statistics follow
    ``n_splits`` (chosen from ``V``) and never ``T`` (a torch reduction over the
    splits may split the sum between threads by the row count).
    """
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = rows < T
    neg_inf = float("-inf")
    m = tl.full((BLOCK,), neg_inf, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    t = tl.zeros((BLOCK,), tl.float32)
    mk = tl.full((BLOCK,), neg_inf, tl.float32)
    sk = tl.zeros((BLOCK,), tl.float32)
    zy = tl.zeros((BLOCK,), tl.float32)
    zero = tl.zeros((BLOCK,), tl.float32)
    for p in range(n_splits):
        base = part_ptr + (p * T + rows) * 6
        m_b = tl.load(base + 0, mask=ok, other=neg_inf)
        s_b = tl.load(base + 1, mask=ok, other=0.0)
        t_b = tl.load(base + 2, mask=ok, other=0.0)
        mk_b = tl.load(base + 3, mask=ok, other=neg_inf)
        sk_b = tl.load(base + 4, mask=ok, other=0.0)
        m, s, t = _merge_run(m, s, t, m_b, s_b, t_b, inv_tau)
        mk, sk, _ = _merge_run(mk, sk, zero, mk_b, sk_b, zero, inv_tau)
        zy += tl.load(base + 5, mask=ok, other=0.0)
    o = out_ptr + rows * 6
    tl.store(o + 0, m, mask=ok)
    tl.store(o + 1, s, mask=ok)
    tl.store(o + 2, t, mask=ok)
    tl.store(o + 3, mk, mask=ok)
    tl.store(o + 4, sk, mask=ok)
    tl.store(o + 5, zy, mask=ok)
