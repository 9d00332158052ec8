"""Exact full-vocabulary KL divergence from vocab-sharded logits: the math, written once.

Framework-free, over an array namespace ``xp`` (``numpy``, ``jax.numpy``,
``array_api_compat.torch``), like :mod:`dualvp.spec`. The torch op
(:mod:`dualvp_torch.kl`) and the JAX op (:mod:`dualvp_jax.kl`) run these
functions; the float64 oracle (:mod:`dualvp.kl_reference`) is the textbook
formula on the gathered vocabulary and shares nothing with this module.

Notation (one row; logits ``a``, ``b`` over the full vocabulary, split into
the same ``W`` contiguous shards; ``tau > 0``)::

    p = softmax(a / tau)      q = softmax(b / tau)
    KL(p || q) = sum_v p_v (log p_v - log q_v)

``direction="forward"`` is ``KL(softmax(logits) || softmax(ref_logits))``
(``a = logits``, ``b = ref_logits``); ``"reverse"`` is ``KL(q || p)``: the same
function with the operands swapped (:func:`operands`), and the gradients
swapped back.

Block statistics (``KL_STATS``, last axis of ``[..., 5]``). Maxima are taken on
the raw logits and the temperature is applied after the shift; a block whose
maximum is ``-inf`` (all columns banned) is shifted by 0 instead, so nothing
computes ``-inf - -inf``::

    ma = max a     sa = sum e^da         da = (a - ma') / tau     ma' = ma, or 0 if ma = -inf
    mb = max b     sb = sum e^db         db = (b - mb') / tau
    t  = sum_v e^da_v (da_v - db_v)      (a term with e^da_v = 0 is 0, never 0 * inf)

Merge over blocks / shards (:func:`merge_stats`; exact up to rounding,
associative, independent of the order): with ``M = max_r m_r`` and the block
offsets ``alpha_r = (ma'_r - Ma') / tau``, ``beta_r = (mb'_r - Mb') / tau``::

    Sa = sum_r e^alpha_r sa_r            Sb = sum_r e^beta_r sb_r
    T  = sum_r e^alpha_r (t_r + sa_r (alpha_r - beta_r))

because the globally shifted ``dA_v = da_v + alpha_r`` and ``dB_v = db_v +
beta_r`` on block ``r``. A block with ``ma_r = -inf`` contributes 0 (its
``sa_r = t_r = 0``). Then (:func:`finalize`)::

    log p_v = dA_v - log Sa              log q_v = dB_v - log Sb
    KL      = T / Sa - log Sa + log Sb   (= E_p[dA - dB] - log Sa + log Sb)

All three terms are ``O(log V + |dA - dB|)`` on the columns that carry
probability, never ``O(|a| / tau)``: written in shifted logits, the sum loses
no precision to the size of the logits (the textbook ``sum p (a - b) / tau -
lse(a / tau) + lse(b / tau)`` would lose ``|a / tau| * eps``).

Gradients, for upstream ``g`` per row (:func:`block_grad`)::

    dKL/da_v = p_v (log p_v - log q_v - KL) / tau    (0 where p_v = 0)
    dKL/db_v = (q_v - p_v) / tau

Non-finite values: ``-inf`` logits are legal (banned tokens). A column with
``p_v = 0`` contributes 0 to the KL and to both gradients' ``p``-terms. A column
with ``p_v > 0`` and ``q_v = 0`` makes the KL ``+inf`` (the divergence is
infinite) and the row's ``a``-gradient non-finite (``inf - inf``). A row whose
``a`` or ``b`` are all ``-inf``, or hold NaN or ``+inf``, gives NaN. Rows
outside ``row_mask`` give KL 0 and zero gradients whatever they hold.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "KL_STATS", "N_KL_STATS", "DIRECTIONS", "KLCombined", "operands", "block_stats", "merge_stats", "finalize",
    "combine_stats", "outputs", "block_grad",
]

#: Names of the block statistics, in the order of the last axis.
KL_STATS = ("ma", "sa", "mb", "sb", "t")
N_KL_STATS = len(KL_STATS)
#: ``"forward"``: KL(p || q), p from ``logits``; ``"reverse"``: KL(q || p).
DIRECTIONS = ("forward", "reverse")


class KLCombined(NamedTuple):
    """Row statistics after the merge, finalized; each ``[...]``.

    ``ma``, ``mb``: the shifts of ``a`` and ``b`` (their global maxima, or 0
    where the maximum is ``-inf``), in logits units; ``log_sa``, ``log_sb``:
    the log-sums of the shifted exponentials; ``kl``: the divergence.
    """

    ma: Any
    log_sa: Any
    mb: Any
    log_sb: Any
    kl: Any


def operands(direction: str, logits, ref_logits):
    """``(a, b)``: the first and second argument of ``KL(softmax(a) || softmax(b))`` for ``direction``."""
    if direction == "forward":
        return logits, ref_logits
    if direction == "reverse":
        return ref_logits, logits
    raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")


def _safe_shift(xp, m):
    # -inf (an all-banned block or row) -> 0: the block's exponentials are then e^-inf = 0, never NaN
    return xp.where(m == -xp.inf, xp.zeros_like(m), m)


def _cast(xp, x, dtype):
    return x if dtype is None or x.dtype == dtype else xp.astype(x, dtype)


def _sum(xp, x, acc_dtype):
    # row sum accumulated in ``acc_dtype`` (None: in x's dtype), returned in x's dtype
    if acc_dtype is None or acc_dtype == x.dtype:
        return xp.sum(x, axis=-1)
    return xp.astype(xp.sum(x, axis=-1, dtype=acc_dtype), x.dtype)


def block_stats(xp, a, b, temperature=1.0, *, dtype=None, acc_dtype=None):
    """Statistics ``[..., 5]`` (:data:`KL_STATS`) of one column block of ``a`` and ``b`` (``[..., n]`` each).

    ``dtype``: the compute dtype (both are cast to it); ``None``: ``a.dtype``.
    ``acc_dtype``: the dtype the three row sums accumulate in (``None``: the
    compute dtype); a compiled kernel that sums a row sequentially passes
    float64, as the log-prob op's do (``dualvp.spec.block_stats``).
    A whole shard is one block; blocks of a shard and shards of a group merge
    with :func:`merge_stats`.
    """
    dtype = a.dtype if dtype is None else dtype
    a = _cast(xp, a, dtype)
    b = _cast(xp, b, dtype)
    ma = xp.max(a, axis=-1)
    mb = xp.max(b, axis=-1)
    da = (a - _safe_shift(xp, ma)[..., None]) / temperature
    db = (b - _safe_shift(xp, mb)[..., None]) / temperature
    ea = xp.exp(da)
    sa = _sum(xp, ea, acc_dtype)
    sb = _sum(xp, xp.exp(db), acc_dtype)
    # p_v = 0 contributes 0 (0 * (-inf - db) would be NaN); e^da > 0 with db = -inf gives +inf, as it must
    t = _sum(xp, xp.where(ea == 0, xp.zeros_like(ea), ea * (da - db)), acc_dtype)
    return xp.stack([ma, sa, mb, sb, t], axis=-1)


def merge_stats(xp, table, temperature=1.0, *, axis: int = 0):
    """Merge block statistics along ``axis`` (``[..., W, ..., 5]`` -> ``[..., 5]``), in the same representation.

    Associative and exact up to rounding: blocks of a shard, shards of a group,
    in any grouping. The merged ``t`` is relative to the merged shifts.
    """
    ma, sa, mb, sb, t = (table[..., i] for i in range(N_KL_STATS))
    Ma = xp.max(ma, axis=axis)
    Mb = xp.max(mb, axis=axis)
    alpha = (_safe_shift(xp, ma) - xp.expand_dims(_safe_shift(xp, Ma), axis=axis)) / temperature
    beta = (_safe_shift(xp, mb) - xp.expand_dims(_safe_shift(xp, Mb), axis=axis)) / temperature
    zero = xp.zeros_like(sa)
    # a block with max -inf has s = t = 0; its offset may be +large (shift 0 vs a negative global max): weight 0
    wa = xp.where(ma == -xp.inf, zero, xp.exp(alpha))
    wb = xp.where(mb == -xp.inf, zero, xp.exp(beta))
    Sa = xp.sum(wa * sa, axis=axis)
    Sb = xp.sum(wb * sb, axis=axis)
    # a block that carries no p-mass (weight or sum 0) contributes 0, even where its t is +inf
    carries = (wa != 0) & (sa != 0)
    T = xp.sum(xp.where(carries, wa * (t + sa * (alpha - beta)), zero), axis=axis)
    return xp.stack([Ma, Sa, Mb, Sb, T], axis=-1)


def finalize(xp, merged) -> KLCombined:
    """:class:`KLCombined` of merged statistics ``[..., 5]``."""
    Ma, Sa, Mb, Sb, T = (merged[..., i] for i in range(N_KL_STATS))
    log_sa = xp.log(Sa)
    log_sb = xp.log(Sb)
    kl = T / Sa - log_sa + log_sb
    return KLCombined(_safe_shift(xp, Ma), log_sa, _safe_shift(xp, Mb), log_sb, kl)


def combine_stats(xp, table, temperature=1.0) -> KLCombined:
    """The shards' statistics ``[W, ..., 5]`` (rank order) -> :class:`KLCombined`: the one-round combine."""
    return finalize(xp, merge_stats(xp, table, temperature, axis=0))


def outputs(xp, comb: KLCombined, row_mask=None):
    """The KL per row ``[...]``: ``comb.kl``, 0 on rows outside ``row_mask`` (``None``: every row)."""
    if row_mask is None:
        return comb.kl
    return xp.where(row_mask, comb.kl, xp.zeros_like(comb.kl))


def block_grad(xp, a, b, comb: KLCombined, grad, temperature=1.0, *, row_mask=None, dtype=None,
               want_a: bool = True, want_b: bool = True):
    """``(dKL/da, dKL/db)`` of one column block (``[..., n]`` each, in ``dtype``), times upstream ``grad [...]``.

    ``want_a`` / ``want_b``: ``False`` returns ``None`` for that gradient (and
    skips its work). Rows outside ``row_mask`` get zeros (their statistics may
    be NaN: selected, not multiplied).
    """
    dtype = a.dtype if dtype is None else dtype
    a = _cast(xp, a, dtype)
    b = _cast(xp, b, dtype)
    g = _cast(xp, grad, dtype)
    if row_mask is not None:
        g = xp.where(row_mask, g, xp.zeros_like(g))
    g = (g / temperature)[..., None]
    log_p = (a - comb.ma[..., None]) / temperature - comb.log_sa[..., None]
    p = xp.exp(log_p)
    zero = xp.zeros_like(p)
    ga = gb = None
    if want_a:
        log_q = (b - comb.mb[..., None]) / temperature - comb.log_sb[..., None]
        ga = xp.where(p == 0, zero, p * (log_p - log_q - comb.kl[..., None])) * g
    if want_b:
        q = xp.exp((b - comb.mb[..., None]) / temperature - comb.log_sb[..., None])
        gb = (q - p) * g
    if row_mask is not None:
        keep = row_mask[..., None]
        ga = None if ga is None else xp.where(keep, ga, zero)
        gb = None if gb is None else xp.where(keep, gb, zero)
    return ga, gb
