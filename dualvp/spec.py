"""The math of docs/design.md, written once, over an array namespace ``xp``.

Every function here is a pure function of arrays. ``xp`` is an array-API
namespace: ``numpy`` (2.x), ``jax.numpy``, or ``array_api_compat.torch``. The
backends run these functions themselves (the torch kernels compile them with
``torch.compile`` or run them eagerly over row chunks; JAX traces them under
``jit``): no backend restates a formula.

Structure: statistics of any column block ``[start, stop)`` of the vocabulary
(:func:`block_stats`), one associative merge (:func:`reduce_stats`: blocks of a
shard, shards of a group, vocab chunks of a fused LM-head op), then
:func:`finalize` into :class:`Combined`; the outputs (:func:`outputs`) and the
gradient of any column block (:func:`block_grad`) are functions of the
finalized statistics. The compute and accumulation dtypes are arguments, and
the temperature may be a 0-d array.

Notation (one row = one token position; shard ``r`` of ``W`` holds the columns
``[r*V_r, (r+1)*V_r)`` of the full vocabulary ``V = W*V_r``)::

    u   = z / tau                       scaled logits                [..., V_r]
    p   = softmax(u)                    over all V columns
    q   = softmax(u restricted to K + {y})   K: keep mask, y: target
    L   = log q_y                       log-prob of the target
    H   = -sum_v p_v log p_v            entropy (unmasked)

Block statistics (``STATS``, last axis of a ``[..., N_STATS]`` array).
Maxima are taken on the raw logits ``z`` and the temperature is applied after
the shift, ``d = (z - m) / tau``, which keeps full precision for large ``|z|``
and small ``tau``::

    m  = max z                 s  = sum exp(d)          t = sum exp(d) d
    mk = max over kept z       sk = sum over kept exp((z - mk) / tau)
    zy = z_y on the shard that owns y, else 0

Combine over shards (exact up to rounding, independent of shard order), with
``dm_r = (m_r - M) / tau``::

    M  = max_r m_r             S  = sum_r s_r e^dm_r
    Tm = sum_r e^dm_r (t_r + s_r dm_r)      c = Tm / S = E_p[u] - M / tau
    H  = log S - c             L  = (z_y - Mk) / tau - log Sk

Writing ``H`` in shifted logits avoids the cancellation of the textbook
``M + log S - sum p u`` (which loses ``|u| * eps`` of absolute precision).

Gradients for upstream ``gL, gH`` per row::

    dL/dz_v = (1[v = y] - q_v) / tau           (q_v = 0 for dropped v)
    dH/dz_v = p_v (c - d_v) / tau               (= p_v (E_p[u] - u_v) / tau)
    with d_v = (z_v - M) / tau

``-inf`` logits (banned tokens) are legal: every product that could be
``0 * inf`` is guarded with ``where``. A row holding NaN or ``+inf`` gives NaN
for that row only.

The fused LM-head op (hidden states ``h [T, H]``, the shard's weight rows
``W_r [V_r, H]``) is this same math over vocabulary blocks of the logits
``z_r = h W_r^T`` (the raw logits; the temperature is applied by the
functions above, exactly as for given logits). Block ``j`` (columns
``[j0, j1)`` of the shard) has ``z_rj = h W_rj^T``; its statistics are
:func:`block_stats` with ``start=j0``, all blocks of all shards merge with
:func:`reduce_stats`, and with ``G_rj`` = :func:`block_grad` of the block::

    dh   = sum_r sum_j G_rj W_rj        (a partial sum per rank: reduced over the group)
    dW_r = [G_rj^T h]_j                  (local and complete on each rank)

Token chunks split ``h`` (and ``G``) by rows the same way. Nothing here is
specific to the product: the backends form ``z_rj`` and the two products
with their matmul and run the functions of this module on each block.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

__all__ = [
    "STATS",
    "N_STATS",
    "KEPT_GAP",
    "Combined",
    "target_to_local",
    "block_stats",
    "block_sums",
    "stats_from_sums",
    "marked_rows",
    "redo_marked",
    "reduce_stats",
    "merge_stats",
    "finalize",
    "combine_stats",
    "outputs",
    "block_grad",
    "shard_stats",
    "grad_logits",
    "kept_columns",
    "columns_in_block",
    "gather_columns",
    "kept_pair",
    "with_kept_pair",
    "block_grad_base",
    "kept_grad",
    "set_at_columns",
    "ExtLayout",
    "row_temperature",
    "ext_block_stats",
    "ext_reduce_stats",
    "ExtCombined",
    "ext_finalize",
    "ext_outputs",
    "ext_block_grad",
    "ext_target_weights",
    "ext_q_coefficient",
]

#: ``block_stats(kept_shift="max")`` shifts the kept sum by the overall max,
#: so the sum is at least ``e^-gap`` with ``gap = (m - kept max) / tau``; rows
#: whose sum is below ``e^-KEPT_GAP`` (only rows with ``gap`` above this,
#: and every row with ``gap`` above ``KEPT_GAP + ln V``) get the marker
#: ``sk = NaN`` (recompute them with ``"kept"``). In the others, the float32
#: exponentials that underflow (each < 1.2e-38, and counted as 1.2e-38) change
#: the kept sum by < ``V * 1.2e-38 / e^-50`` = 6e-11 relative for V <= 1e6,
#: far below rounding.
KEPT_GAP = 50.0

#: Names of the block statistics, in the order of the last axis.
STATS = ("m", "s", "t", "mk", "sk", "zy")
N_STATS = len(STATS)


class Combined(NamedTuple):
    """Row statistics after the reduce, finalized; each of shape ``[...]``.

    ``M``: global max of the logits ``z``; ``log_s``: ``log S``; ``c``:
    ``E_p[u] - M / tau``; ``mk``, ``log_sk``: a shift (the max over the kept
    columns, or any value the kept sum was shifted by) and the log-sum of the
    kept columns' exponentials relative to it; ``zy``: the target's logit.
    ``M``, ``mk`` and ``zy`` are in logits units (the temperature is applied
    after shifting, for precision).
    """

    M: Any
    log_s: Any
    c: Any
    mk: Any
    log_sk: Any
    zy: Any


# --- small helpers (no math of the op) -------------------------------------------


def _finite_or_zero(xp, m):
    # A block (or row) whose columns are all -inf has max -inf; shifting by it
    # would give (-inf) - (-inf) = NaN. Shift by 0 instead: exp(-inf) = 0, so the
    # block contributes nothing. NaN and +inf stay as they are, so they poison
    # their own row, as documented.
    return xp.where(m == -xp.inf, 0.0, m)


def _over_tau(x, tau):
    # x / tau, where x is block-sized. The number 1 (not an array holding 1)
    # skips the division, exact either way: on an eager backend each op is a
    # pass over the block, and tau = 1 is the common case.
    return x if isinstance(tau, (int, float)) and tau == 1 else x / tau


def _shifted(xp, z, m, tau, *, products: bool = True):
    # d = (z - m) / tau per row. With ``products`` (the entropy's e^d d and
    # p (c - d) will be formed), -inf (a banned column) is clamped to the
    # dtype's lowest finite value: e^d is 0 there as before, and those
    # products are 0 rather than 0 * inf = NaN, with no compare and select
    # per element (c <= 0, so c - d cannot overflow). Without them e^-inf = 0
    # needs no clamp (one chunk-sized op fewer on an eager backend; the same
    # values). NaN stays NaN. (finfo's own scalar, not a Python float: NumPy
    # 1.x's value-based casting promotes float32 to float64 for a float of
    # that magnitude.)
    d = _over_tau(z - _finite_or_zero(xp, m)[..., None], tau)
    return xp.clip(d, xp.finfo(d.dtype).min, None) if products else d


def _entropy_terms(xp, e, d, how: str):
    # [..., n]: e d per column with 0 where e = e^d is 0, which is exactly
    # where d = -inf (a banned column, or a (z - m) / tau that overflowed) or
    # underflows. "clamp": d was clamped by _shifted, so e d is finite.
    # "select": d is not clamped, and the select turns 0 * -inf = NaN into 0.
    # The same values either way (a zero's sign aside); a NaN e gives NaN with
    # "clamp", 0 with "select", and its row's s is NaN all the same
    # (docs/decisions.md, "Spec: entropy terms, clamp or select").
    if how == "clamp":
        return e * d
    return xp.where(e > 0, e * d, 0.0)


# Python scalars (weakly typed: they take the array's dtype) rather than
# zeros_like / ones_like / full_like in ``where``: an eager backend then
# allocates and fills no constant [..., n] array, and a compiler sees the same.


def _astype(xp, x, dtype):
    # The array API's astype; NumPy before 2.0 (which this package supports:
    # RL stacks still pin numpy<2) has only the method.
    f = getattr(xp, "astype", None)
    return f(x, dtype) if f is not None else x.astype(dtype)


def _tau(xp, temperature, dtype):
    # A Python number stays a (weakly typed) scalar; an array (0-d) is cast to
    # the compute dtype so that it never promotes float32 work to float64
    # (NumPy 2 treats 0-d arrays as strongly typed). Passing the temperature
    # as a 0-d array lets a compiled kernel take it as an input: changing it
    # never recompiles.
    if isinstance(temperature, (int, float)):
        return temperature
    return _astype(xp, temperature, dtype)


def _sum(xp, x, acc_dtype, dtype):
    # Row sum, accumulated in ``acc_dtype`` (None: in x's dtype), returned in ``dtype``.
    if acc_dtype is None:
        return xp.sum(x, axis=-1)
    return _astype(xp, xp.sum(x, axis=-1, dtype=acc_dtype), dtype)


def _cast(xp, z, dtype):
    return z if dtype is None or z.dtype == dtype else _astype(xp, z, dtype)


def _in_block(xp, z, local, owns, start):
    # [...]: the target's column within this block, and whether the block holds it.
    col = local - start
    inside = owns & (col >= 0) & (col < z.shape[-1])
    return xp.where(inside, col, xp.zeros_like(col)), inside


def _column_offsets(xp, z, local, owns, start):
    # [..., n] integers: each column's index minus the column of this block
    # that holds this row's target (-1 for rows whose target lies elsewhere,
    # which no column matches). ``getattr(..., "device")`` is None for traced
    # JAX arrays (device-free).
    col, inside = _in_block(xp, z, local, owns, start)
    dev = getattr(z, "device", None)
    kw = {} if dev is None else {"device": dev}
    cols = xp.arange(0, z.shape[-1], dtype=local.dtype, **kw)
    return cols - xp.where(inside, col, xp.full_like(col, -1))[..., None]


def _target_columns(xp, z, local, owns, start):
    # [..., n] bool: the column of this block that holds this row's target.
    return _column_offsets(xp, z, local, owns, start) == 0


def _target_indicator(xp, z, local, owns, start):
    # [..., n] in z's dtype: 1 at the target's column, else 0, as
    # max(1 - |offset|, 0) in integers: no compare in the loop (block_grad's
    # ``indicator``; docs/decisions.md, "Spec: target indicator, compare or arith").
    return _astype(xp, xp.clip(1 - xp.abs(_column_offsets(xp, z, local, owns, start)), 0, None), z.dtype)


def _target_logit(xp, z, local, owns, start):
    # [...]: z at the target's column if this block holds it, else 0; an O(T)
    # gather, not a compare-and-sum over the block.
    col, inside = _in_block(xp, z, local, owns, start)
    zy = xp.take_along_axis(z, col[..., None], axis=-1)[..., 0]
    return xp.where(inside, zy, 0.0)


def _reduce_max_sum(xp, m, s, axis, tau):
    """Merge ``(max, sum e^((z - max) / tau))`` pairs along ``axis``: ``(M, sum_r s_r e^((m_r - M) / tau))``."""
    M = xp.max(m, axis=axis, keepdims=True)
    return xp.squeeze(M, axis=axis), xp.sum(xp.exp((m - _finite_or_zero(xp, M)) / tau) * s, axis=axis)


def _kept_select(xp, keep, is_y):
    """``sel(a, b) = where(keep | is_y, a, b)``: the kept columns (the target, ``is_y``, is always kept).

    The masked stages take *one* exponential per element for two
    distributions: the kept columns get their argument shifted by the kept
    max (so that the kept sum cannot underflow when the kept logits lie far
    below the overall max), the others by the overall max, and a per-row
    factor converts where a stage needs both. The kept set is never formed
    as an ``[..., n]`` array, so no backend has to store it once several
    selects read it (docs/decisions.md, "Spec: one exponential for two
    distributions").
    """
    def sel(a, b):
        return xp.where(keep, a, xp.where(is_y, a, b))

    return sel


# --- the op ------------------------------------------------------------------------


def target_to_local(xp, target, shard_index: int, v_local: int, ignore_index: int):
    """Map global target ids to this shard.

    Args:
      target: ``[...]`` integer global token ids.
      shard_index: ``r``, this shard's position in the vocab split.
      v_local: ``V_r``, columns per shard.
      ignore_index: rows whose target equals it are ignored.

    Returns:
      ``(valid, owns, local)``, each ``[...]``: ``valid`` is ``target !=
      ignore_index``; ``owns`` says the target column lies on this shard (and
      the row is valid); ``local`` is the column within the shard where
      ``owns``, else 0.
    """
    lo = shard_index * v_local
    valid = target != ignore_index
    owns = valid & (target >= lo) & (target < lo + v_local)
    local = xp.where(owns, target - lo, xp.zeros_like(target))
    return valid, owns, local


def block_stats(
    xp,
    z,
    local,
    owns,
    keep=None,
    temperature=1.0,
    *,
    start: int = 0,
    dtype=None,
    acc_dtype=None,
    with_entropy: bool = True,
    kept_shift: str = "kept",
    entropy_terms: str = "clamp",
):
    """Statistics of one column block ``[start, start + n)`` of a vocab shard.

    A whole shard is the block ``start=0``; the blocks of a shard, the shards
    of a group and the vocab chunks of a fused LM-head op all merge with the
    one :func:`reduce_stats`.

    Maxima and the target logit are kept in *logits* units and the temperature
    is applied after the shift (``d = (z - m) / tau``): ``z - m`` is exact for
    the columns that matter, so the result does not lose ``|z / tau| * eps``
    of absolute precision the way ``z / tau - m / tau`` would.

    Args:
      z: ``[..., n]`` logits of the block (floating).
      local, owns: ``[...]`` from :func:`target_to_local` (``local`` is the
        target's column within the *shard*, not the block).
      keep: ``[..., n]`` bool keep mask of the block or ``None`` (all kept).
        The target column is always treated as kept.
      temperature: ``tau > 0``, a number or a 0-d array; the distribution is
        ``softmax(z / tau)``.
      start: the block's first column within the shard.
      dtype: compute dtype (``z`` is cast to it first); ``None``: ``z.dtype``.
      acc_dtype: dtype the row sums accumulate in; ``None``: the compute dtype.
      with_entropy: ``False`` skips ``t`` (returned as 0; a product, a guard
        and a row sum per element less) and, with a keep mask, ``s``
        (returned as 1; a row reduction less): the log-prob under a mask and
        its gradient read only the kept pair ``(mk, sk)``. Only the entropy
        and its gradient depend on ``t`` and, under a mask, ``s``: the
        log-prob and its gradient are exact either way, the entropy of such
        statistics is meaningless.
      kept_shift: the shift of the kept pair ``(mk, sk)`` (with a mask only).
        ``"kept"``: the kept max; ``sk = sum_kept e^((z - mk) / tau)``,
        exact at any distance between the kept and the overall max, but the
        kept max must be known before the exponentials, so the mask is read in
        both passes over the block. ``"max"``: the overall max, ``mk = m`` and
        ``sk = sum_kept e^d``: one exponential and one read of the mask per
        element (docs/decisions.md, "Spec: kept shift by the overall max").
        Every merge, output and gradient
        takes any such ``(shift, sum)`` pair, so both give the same results
        up to rounding; rows whose kept sum (shifted by ``m``) is below
        ``e^-KEPT_GAP``, where it could lose precision to underflow (their
        kept max lies more than :data:`KEPT_GAP` below ``m``, in units of
        ``tau``), get ``sk = NaN`` for the caller to recompute with
        ``"kept"`` (a row holding NaN is marked as well). The compute dtype
        must be float32 or wider (``e^-KEPT_GAP`` is normal in it).
      entropy_terms: how ``t``'s terms ``e^d d`` avoid ``0 * -inf`` on
        banned (``-inf``) columns: ``"clamp"`` clamps ``d`` to the lowest
        finite value first, ``"select"`` takes 0 where ``e^d = 0``. The same
        statistics either way, except ``t`` of a row holding NaN (NaN or
        finite; its ``s`` is NaN).
        NumPy warns of the masked ``0 * -inf`` with ``"select"``
        (``np.errstate(invalid="ignore")``).

    Returns:
      ``[..., N_STATS]`` array of ``(m, s, t, mk, sk, zy)`` in the compute
      dtype: ``m = max z``, ``s = sum e^d``, ``t = sum e^d d`` with
      ``d = (z - m) / tau``; ``mk, sk`` the same max and sum over kept
      columns (``kept_shift="max"``: shifted by ``m`` instead of the kept
      max); ``zy`` the target's logit if this block holds it, else 0.
    """
    if kept_shift not in ("kept", "max"):
        raise ValueError(f"kept_shift: expected 'kept' or 'max', got {kept_shift!r}")
    if entropy_terms not in ("clamp", "select"):
        raise ValueError(f"entropy_terms: expected 'clamp' or 'select', got {entropy_terms!r}")
    z = _cast(xp, z, dtype)
    if keep is None or kept_shift == "max":
        sums = block_sums(xp, z, keep, temperature, acc_dtype=acc_dtype, with_entropy=with_entropy,
                          entropy_terms=entropy_terms)
        return stats_from_sums(xp, sums, z, local, owns, keep, temperature, start=start, with_entropy=with_entropy)
    tau = _tau(xp, temperature, z.dtype)
    m = xp.max(z, axis=-1)
    d = _shifted(xp, z, m, tau, products=with_entropy and entropy_terms == "clamp")
    zy = _target_logit(xp, z, local, owns, start)
    # The element loops see the mask alone (no per-element compare with
    # the target's column): the target, which counts as kept even where
    # the mask drops it, is merged in per row below, as a one-column
    # block (an O(T) gather of the mask).
    mk = xp.max(xp.where(keep, z, -xp.inf), axis=-1)
    ek = xp.exp(xp.where(keep, _over_tau(z - _finite_or_zero(xp, mk)[..., None], tau), d))
    sk = _sum(xp, xp.where(keep, ek, 0.0), acc_dtype, z.dtype)
    # exp(d) on the kept columns is ek * e^((mk - m) / tau), a factor <= 1
    # (0 when nothing is kept or the kept set underflows against m).
    e = xp.where(keep, ek * xp.exp((mk - _finite_or_zero(xp, m))[..., None] / tau), ek) if with_entropy else None
    mk, sk = _merge_dropped_target(xp, keep, local, owns, start, zy, mk, sk, tau)
    # Under a mask without the entropy nothing reads s: 1 is a placeholder
    # that merges (and takes a log) like any sum.
    s = _sum(xp, e, acc_dtype, z.dtype) if with_entropy else xp.ones_like(sk)
    t = _sum(xp, _entropy_terms(xp, e, d, entropy_terms), acc_dtype, z.dtype) if with_entropy else xp.zeros_like(s)
    return xp.stack([m, s, t, mk, sk, zy], axis=-1)


def block_sums(xp, z, keep=None, temperature=1.0, *, dtype=None, acc_dtype=None, with_entropy: bool = True,
               entropy_terms: str = "clamp"):
    """The row reductions of :func:`block_stats` (``kept_shift="max"``, or no mask): ``(m, s, t, sk)``.

    The only part of the statistics that reads the ``[..., n]`` block; a
    backend may compute it with a kernel of its own and finish with
    :func:`stats_from_sums`. With ``d = (z - m) / tau`` (``m`` shifted by 0
    where it is ``-inf``) and ``e = e^d``::

        m = max z                          [...]
        s = sum e                          (0 under a mask without the entropy)
        t = sum e d, 0 where e = 0         (0 without the entropy)
        sk = sum_keep max(e, tiny)         (0 without a mask)

    ``tiny`` is the compute dtype's smallest normal number (see
    :func:`block_stats`'s ``kept_shift``). Arguments as in :func:`block_stats`;
    each result ``[...]`` in the compute dtype.
    """
    z = _cast(xp, z, dtype)
    tau = _tau(xp, temperature, z.dtype)
    m = xp.max(z, axis=-1)
    d = _shifted(xp, z, m, tau, products=with_entropy and entropy_terms == "clamp")
    e = xp.exp(d)
    zero = xp.zeros_like(m)
    s = _sum(xp, e, acc_dtype, z.dtype) if with_entropy or keep is None else zero
    t = _sum(xp, _entropy_terms(xp, e, d, entropy_terms), acc_dtype, z.dtype) if with_entropy else zero
    if keep is None:
        return m, s, t, zero
    # Each kept term is at least the dtype's smallest normal number, so that
    # sk = 0 says "nothing kept" without a kept max (one reduction and one
    # read of the mask fewer); the floor moves the sum by less than the
    # underflow that KEPT_GAP already bounds.
    return m, s, t, _sum(xp, xp.where(keep, xp.clip(e, xp.finfo(e.dtype).tiny, None), 0.0), acc_dtype, z.dtype)


def stats_from_sums(xp, sums, z, local, owns, keep=None, temperature=1.0, *, start: int = 0,
                    with_entropy: bool = True):
    """:func:`block_stats` (``kept_shift="max"``, or no mask) from :func:`block_sums`: ``[..., N_STATS]``.

    O(T) work: the target logit and, with a mask, the target's mask bit are
    gathered from ``z`` and ``keep`` (``z`` may be in the caller's dtype);
    the kept pair is shifted by the overall max, ``(mk, sk) = (m, sk)``, a
    valid (shift, sum) pair for every later merge and for the outputs, which
    do not depend on the shift. Rows whose kept sum is too small for
    :data:`KEPT_GAP`'s bound (``sk < e^-KEPT_GAP``; as ``e^-gap <= sk <= V
    e^-gap``, only rows whose kept max lies more than ``KEPT_GAP`` below
    ``m``, and all that lie more than ``KEPT_GAP + ln V`` below), and rows
    whose sums are NaN, get ``sk = NaN`` (:func:`marked_rows`).
    """
    m, s, t, sk = sums
    tau = _tau(xp, temperature, m.dtype)
    zy = _cast(xp, _target_logit(xp, z, local, owns, start), m.dtype)
    if keep is None:
        return xp.stack([m, s, t, m, s, zy], axis=-1)
    none_kept = sk == 0
    sk = xp.where((sk < math.exp(-KEPT_GAP)) & xp.logical_not(none_kept), xp.nan, sk)
    # No kept column in the block: the empty pair (-inf, 0), which a dropped
    # target merged in below replaces (shifted by m, the target's own term
    # could underflow against it).
    mk = xp.where(none_kept, -xp.inf, m)
    mk, sk = _merge_dropped_target(xp, keep, local, owns, start, zy, mk, sk, tau)
    # Under a mask without the entropy nothing reads s: 1 is a placeholder
    # that merges (and takes a log) like any sum.
    s = s if with_entropy else xp.ones_like(sk)
    return xp.stack([m, s, t, mk, sk, zy], axis=-1)


def _merge_dropped_target(xp, keep, local, owns, start, zy, mk, sk, tau):
    # The target counts as kept even where the mask drops it: merged into the
    # kept pair as a one-column block (an O(T) gather of the mask).
    col, inside = _in_block(xp, keep, local, owns, start)
    dropped_y = inside & xp.logical_not(xp.take_along_axis(keep, col[..., None], axis=-1)[..., 0])
    return _reduce_max_sum(xp, xp.stack([mk, xp.where(dropped_y, zy, -xp.inf)], axis=-1),
                           xp.stack([sk, xp.ones_like(sk)], axis=-1), -1, tau)


def marked_rows(xp, stats):
    """``[...]`` bool: the rows of ``block_stats(kept_shift="max")`` statistics to recompute with ``"kept"``.

    The marker is ``sk = NaN`` (a kept max more than :data:`KEPT_GAP` below
    the overall max, or a row holding NaN).
    """
    return xp.isnan(stats[..., STATS.index("sk")])


def redo_marked(xp, fast, kept):
    """``fast`` with the rows that it marks taken from ``kept``: ``[..., N_STATS]``.

    ``fast``: statistics from ``block_stats(kept_shift="max")``; ``kept``:
    the same block's statistics from ``kept_shift="kept"`` (needed only for
    the rows of :func:`marked_rows`; a backend may compute them for those
    rows alone, or skip them when no row is marked).
    """
    return xp.where(marked_rows(xp, fast)[..., None], kept, fast)


def reduce_stats(xp, stats, axis: int = 0, temperature=1.0):
    """Merge block statistics along ``axis``: associative, exact up to rounding.

    With ``dm_r = (m_r - M) / tau``::

        M  = max_r m_r              S  = sum_r s_r e^dm_r
        T  = sum_r e^dm_r (t_r + s_r dm_r)
        Mk = max_r mk_r             Sk = sum_r sk_r e^((mk_r - Mk) / tau)
        zy = sum_r zy_r

    The result has the layout of one block's statistics (relative to the
    merged maxima), so merges nest: blocks into shards into groups, in any
    order and grouping.

    Args:
      stats: ``[..., N_STATS]`` statistics with the blocks along ``axis``
        (e.g. ``[W, T, N_STATS]`` for ``axis=0``).
      temperature: the ``tau`` the statistics were made with.

    Returns:
      ``[..., N_STATS]`` with ``axis`` removed.
    """
    tau = _tau(xp, temperature, stats.dtype)
    m, s, t, mk, sk, zy = (stats[..., i] for i in range(N_STATS))
    ax = axis if axis >= 0 else axis + 1  # the stats axis is gone from the fields
    M = xp.max(m, axis=ax, keepdims=True)
    dm = (m - _finite_or_zero(xp, M)) / tau
    w = xp.exp(dm)
    S = xp.sum(w * s, axis=ax)
    # w == 0 exactly when the block is all -inf; then s == 0 and dm = -inf.
    shift = xp.where(w > 0, s * dm, xp.zeros_like(s))
    Tm = xp.sum(w * (t + shift), axis=ax)
    MK, SK = _reduce_max_sum(xp, mk, sk, ax, tau)
    return xp.stack([xp.squeeze(M, axis=ax), S, Tm, MK, SK, xp.sum(zy, axis=ax)], axis=-1)


def merge_stats(xp, a, b, temperature=1.0):
    """:func:`reduce_stats` of two blocks' ``[..., N_STATS]`` statistics."""
    return reduce_stats(xp, xp.stack([a, b], axis=0), axis=0, temperature=temperature)


def finalize(xp, stats, temperature=1.0) -> Combined:
    """:class:`Combined` from fully reduced ``[..., N_STATS]`` statistics.

    ``log_s = log S``, ``c = T / S`` (``= E_p[u] - M / tau``), ``log_sk = log Sk``.
    """
    m, s, t, mk, sk, zy = (stats[..., i] for i in range(N_STATS))
    return Combined(M=m, log_s=xp.log(s), c=t / s, mk=mk, log_sk=xp.log(sk), zy=zy)


def combine_stats(xp, stats, axis: int = 0, temperature=1.0) -> Combined:
    """``finalize(reduce_stats(stats, axis))``: the cross-shard combine."""
    return finalize(xp, reduce_stats(xp, stats, axis=axis, temperature=temperature), temperature)


def outputs(xp, comb: Combined, valid, temperature=1.0):
    """Log-prob and entropy from combined statistics.

    ``L = (z_y - Mk) / tau - log Sk`` (0 on rows that are not ``valid``) and
    ``H = log S - c``; both ``[...]``.
    """
    tau = _tau(xp, temperature, comb.zy.dtype)
    logprob = xp.where(valid, (comb.zy - comb.mk) / tau - comb.log_sk, xp.zeros_like(comb.zy))
    entropy = comb.log_s - comb.c
    return logprob, entropy


def block_grad(
    xp,
    z,
    local,
    owns,
    keep,
    comb: Combined,
    valid,
    g_logprob,
    g_entropy,
    temperature=1.0,
    *,
    start: int = 0,
    dtype=None,
    indicator: str = "compare",
):
    """Gradient of ``sum(gL * L + gH * H)`` w.r.t. one column block of logits.

    Args:
      z: ``[..., n]`` logits of the block ``[start, start + n)`` of the shard.
      local, owns, valid: ``[...]`` from :func:`target_to_local`.
      keep: ``[..., n]`` bool or ``None``.
      comb: :class:`Combined` for these rows (over the whole vocabulary).
      g_logprob, g_entropy: ``[...]`` upstream gradients; ``g_entropy`` may be
        ``None`` (no entropy gradient). Rows that are not ``valid`` get no
        log-prob gradient.
      temperature: a number or a 0-d array.
      start: the block's first column within the shard.
      dtype: compute dtype (``z`` is cast to it first); ``None``: ``z.dtype``.
      indicator: how ``1[v=y]`` is formed: ``"compare"`` (a compare with
        the target's column, converted) or ``"arith"`` (``max(1 - |v - y|,
        0)`` in integers, no compare). The same gradient either way.

    Returns:
      ``[..., n]`` in the compute dtype:
      ``(gL (1[v=y] - q_v) + gH p_v (c - d_v)) / tau`` with
      ``d_v = (z_v - M) / tau``, ``p_v = e^(d_v - log S)`` and ``q_v`` the
      kept distribution (``q = p`` without a mask, 0 on dropped columns).
    """
    if indicator not in ("compare", "arith"):
        raise ValueError(f"indicator: expected 'compare' or 'arith', got {indicator!r}")
    z = _cast(xp, z, dtype)
    tau = _tau(xp, temperature, z.dtype)
    d = _shifted(xp, z, comb.M, tau, products=g_entropy is not None)
    # The offsets are formed again for "arith" under a mask rather than held,
    # so that no integer [..., n] array lives through the whole gradient.
    is_y = _target_columns(xp, z, local, owns, start) if keep is not None or indicator == "compare" else None
    if keep is None:
        p = q = xp.exp(d - comb.log_s[..., None])
    else:
        sel = _kept_select(xp, keep, is_y)
        ek = xp.exp(sel(_over_tau(z - _finite_or_zero(xp, comb.mk)[..., None], tau) - comb.log_sk[..., None],
                        d - comb.log_s[..., None]))
        # 0 on the dropped columns; NaN on every column of a row whose kept set
        # has no mass (log-prob -inf), as in the oracle (0 * -inf).
        q = sel(ek, (0.0 * comb.log_sk)[..., None])
        if g_entropy is not None:
            # p_v = q_v * P_p(kept set) on the kept columns, a factor <= 1; its
            # guard keeps a kept set of no mass (q = NaN there) out of p, and
            # lets a NaN factor (a row holding NaN) through.
            rho = xp.exp((comb.mk - _finite_or_zero(xp, comb.M)) / tau + comb.log_sk - comb.log_s)[..., None]
            p = sel(xp.where(rho == 0, 0.0, ek * rho), ek)
    # The 1 / tau is folded into the per-row coefficients (O(T) work): no
    # whole-block division after the sum, which a compiler may not fuse.
    gl = (xp.where(valid, g_logprob, xp.zeros_like(g_logprob)) / tau)[..., None]
    # Rows that are not valid get no log-prob term at all (not 0 * q, which is
    # NaN when their kept set is empty).
    one_y = _astype(xp, is_y, z.dtype) if indicator == "compare" else _target_indicator(xp, z, local, owns, start)
    g = xp.where(valid[..., None], gl * (one_y - q), 0.0)
    if g_entropy is not None:
        # A banned column contributes 0 (d is clamped: see _shifted); a NaN p
        # (a row holding NaN) propagates, as the policy says.
        dh = p * (comb.c[..., None] - d)
        g = g + (g_entropy / tau)[..., None] * dh
    return g


def shard_stats(xp, z, local, owns, keep=None, temperature=1.0, **kw):
    """:func:`block_stats` of a whole shard (the block ``start=0``)."""
    return block_stats(xp, z, local, owns, keep, temperature, **kw)


def grad_logits(xp, z, local, owns, keep, comb: Combined, valid, g_logprob, g_entropy, temperature=1.0, **kw):
    """:func:`block_grad` of a whole shard (the block ``start=0``)."""
    return block_grad(xp, z, local, owns, keep, comb, valid, g_logprob, g_entropy, temperature, **kw)


# --- the kept set as token ids (keep_ids) -------------------------------------------
#
# ``keep_ids [..., K]``: the sampler's kept set as *global* token ids, padded
# with -1, the alternative to a ``[..., V_r]`` keep mask with the same
# semantics (the target is always kept, the entropy ignores the kept set).
# Nothing of size ``[..., V_r]`` is built from the ids: each shard takes the
# ids in its columns ``[r*V_r, (r+1)*V_r)``, gathers the logits there
# (``[..., K+1]`` with the target) and forms the kept pair ``(mk, sk)`` from
# them, in the form :func:`block_stats` gives it with ``kept_shift="kept"``;
# the unmasked statistics ``(m, s, t, zy)`` are those of the block without a
# mask. In the gradient, ``q`` is nonzero on the kept columns only, so the
# gradient is the unmasked one without its ``q`` term (:func:`block_grad_base`)
# everywhere but at the ``K + 1`` kept columns, whose values (:func:`kept_grad`,
# from the gathered logits) are written over it (:func:`set_at_columns`):
# O(T K) beyond the dense pass.
# Ids outside ``[0, V)`` (padding -1 or not) lie in no shard and are ignored;
# an id repeated in a row counts once.


def _concat(xp, arrays, axis=-1):
    # The array API's concat; NumPy before 2.0 has only concatenate.
    f = getattr(xp, "concat", None) or xp.concatenate
    return f(arrays, axis=axis)


def kept_columns(xp, keep_ids, target, shard_index, v_local: int, ignore_index: int):
    """This shard's columns of each row's kept set: ``(cols, use)``, each ``[..., K+1]``.

    The kept set of a row is its ids ``keep_ids [..., K]`` plus its target
    (unless the row is ignored); this shard's part is the ids in ``[lo, lo +
    v_local)``, ``lo = shard_index * v_local``, as columns within the shard.
    The candidates are sorted so that a repeated column is used once
    (``use`` is false on the repeats and on ids outside the shard; their
    ``cols`` are 0, a valid column to gather from). O(K log K) per row.

    Args:
      keep_ids: ``[..., K]`` integer global ids (padding -1; any id outside
        ``[0, W * v_local)`` lies in no shard and is ignored).
      target: ``[...]`` integer global ids, ``ignore_index`` for ignored rows.
      shard_index: ``r``, a Python int or a 0-d integer array.
    """
    lo = shard_index * v_local
    y = xp.where(target != ignore_index, target, xp.full_like(target, -1))
    cand = _concat(xp, [y[..., None], _astype(xp, keep_ids, target.dtype)], axis=-1)
    inside = (cand >= lo) & (cand < lo + v_local)
    # Outside the shard: v_local, which sorts after every column.
    key = xp.sort(xp.where(inside, cand - lo, xp.full_like(cand, v_local)), axis=-1)
    prev = _concat(xp, [xp.full_like(key[..., :1], -1), key[..., :-1]], axis=-1)
    use = (key < v_local) & (key != prev)
    return xp.where(use, key, xp.zeros_like(key)), use


def columns_in_block(xp, cols, use, start, n: int):
    """``(cols - start, use & in block)``: the kept columns of the block ``[start, start + n)`` of the shard.

    ``start`` may be a traced scalar; the columns outside the block are 0 and unused.
    """
    inside = use & (cols >= start) & (cols < start + n)
    return xp.where(inside, cols - start, xp.zeros_like(cols)), inside


def gather_columns(xp, z, cols, use, prev=None, dtype=None):
    """``[..., K+1]``: ``z`` at ``cols`` where ``use``, else ``prev`` (``None``: 0), in ``dtype``.

    ``prev`` carries the values of the kept columns of earlier blocks (the
    fused op gathers block by block).
    """
    zk = _cast(xp, xp.take_along_axis(z, cols, axis=-1), dtype)
    return xp.where(use, zk, xp.zeros_like(zk) if prev is None else prev)


def _tree(xp, x, op, fill: float):
    # Row reduction of x [..., n] as a fixed pairwise tree of elementwise ops
    # (padded with ``fill`` to a power of two): the same bits for a row
    # whatever the other rows, where a library reduction may take another
    # path for some row counts.
    n = x.shape[-1]
    p = 1 << max(0, n - 1).bit_length()
    if p > n:
        x = _concat(xp, [x, xp.zeros_like(x[..., : p - n]) + fill], axis=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = op(x[..., :h], x[..., h:])
    return x[..., 0]


def kept_pair(xp, zk, use, temperature=1.0, *, tree: bool = False):
    """``(mk, sk)``, each ``[...]``: max and ``sum e^((z - mk) / tau)`` over the used columns of ``zk``.

    The kept pair of :func:`block_stats` (``kept_shift="kept"``) for the kept
    set given by ids: ``(-inf, 0)`` when no column is used. ``tree=True``
    reduces the ``K + 1`` columns in a fixed pairwise tree of elementwise
    ops instead of the library's row reductions (XLA:CPU reduces narrow rows
    along a path that depends on the row count).
    """
    tau = _tau(xp, temperature, zk.dtype)
    if tree:
        mk = _tree(xp, xp.where(use, zk, -xp.inf), xp.maximum, -math.inf)
    else:
        mk = xp.max(xp.where(use, zk, -xp.inf), axis=-1)
    ek = xp.where(use, xp.exp(_over_tau(zk - _finite_or_zero(xp, mk)[..., None], tau)), 0.0)
    return mk, (_tree(xp, ek, lambda a, b: a + b, 0.0) if tree else xp.sum(ek, axis=-1))


def with_kept_pair(xp, stats, mk, sk):
    """``stats [..., N_STATS]`` (unmasked, from :func:`block_stats` with ``keep=None``) with ``(mk, sk)`` replaced."""
    m, s, t, _, _, zy = (stats[..., i] for i in range(N_STATS))
    return xp.stack([m, s, t, _astype(xp, mk, m.dtype), _astype(xp, sk, m.dtype), zy], axis=-1)


def block_grad_base(xp, z, local, owns, comb: Combined, valid, g_logprob, g_entropy, temperature=1.0, *,
                    start: int = 0, dtype=None, indicator: str = "compare"):
    """:func:`block_grad` under a kept set given by ids, right on every column but the kept ones: ``[..., n]``.

    ``(gL 1[v=y] + gH p_v (c - d_v)) / tau``: the unmasked gradient without
    its ``q`` term, which is nonzero on the kept columns only; their values
    are :func:`kept_grad`, written over these with :func:`set_at_columns`
    (after any cast to the output dtype: one rounding per element). ``comb``
    holds the kept pair of the ids. A valid row whose kept set has no mass
    (``log_sk = -inf``: log-prob ``-inf``) or holds NaN is NaN on every
    column, as with a mask (and in the oracle, 0 * -inf). Arguments as in
    :func:`block_grad`.
    """
    if indicator not in ("compare", "arith"):
        raise ValueError(f"indicator: expected 'compare' or 'arith', got {indicator!r}")
    z = _cast(xp, z, dtype)
    tau = _tau(xp, temperature, z.dtype)
    one_y = (_astype(xp, _target_columns(xp, z, local, owns, start), z.dtype) if indicator == "compare"
             else _target_indicator(xp, z, local, owns, start))
    gl = (xp.where(valid, g_logprob, xp.zeros_like(g_logprob)) / tau)[..., None]
    # 0 * log_sk: 0 for a kept set of finite mass, NaN for none or NaN.
    g = xp.where(valid[..., None], gl * (one_y + (0.0 * comb.log_sk)[..., None]), 0.0)
    if g_entropy is not None:
        d = _shifted(xp, z, comb.M, tau, products=True)
        p = xp.exp(d - comb.log_s[..., None])
        g = g + (g_entropy / tau)[..., None] * (p * (comb.c[..., None] - d))
    return g


def kept_grad(xp, zk, cols, use, local, owns, comb: Combined, valid, g_logprob, g_entropy, temperature=1.0):
    """``[..., K+1]``: the gradient (:func:`block_grad`'s value) at the kept columns, 0 where not ``use``.

    ``zk``: the logits at the shard columns ``cols`` (:func:`gather_columns`,
    in the compute dtype); ``local``, ``owns``: the target's column as from
    :func:`target_to_local`; ``comb`` the combined statistics over all
    shards. Every used column is kept, so ``q_v = e^((z_v - Mk) / tau - log
    Sk)`` there: ``(gL (1[v=y] - q_v) + gH p_v (c - d_v)) / tau``.
    """
    tau = _tau(xp, temperature, zk.dtype)
    q = xp.exp(_over_tau(zk - _finite_or_zero(xp, comb.mk)[..., None], tau) - comb.log_sk[..., None])
    one_y = _astype(xp, use & owns[..., None] & (cols == local[..., None]), zk.dtype)
    gl = (xp.where(valid, g_logprob, xp.zeros_like(g_logprob)) / tau)[..., None]
    g = xp.where(valid[..., None], gl * (one_y - q), 0.0)
    if g_entropy is not None:
        d = _shifted(xp, zk, comb.M, tau, products=True)
        p = xp.exp(d - comb.log_s[..., None])
        g = g + (g_entropy / tau)[..., None] * (p * (comb.c[..., None] - d))
    return xp.where(use, g, 0.0)


def set_at_columns(xp, g, cols, vals, use):
    """``g [..., n]`` with ``vals [..., K]`` written at ``cols [..., K]`` where ``use`` (used columns are distinct).

    The one scatter of the spec; the array API has none, so it is done per
    array type: ``.at[].set(mode="drop")`` (JAX, functional; the unused
    entries point past the row; 16-bit floats as their uint16 bits),
    ``scatter_`` (torch, *in place*, returns ``g``; 16-bit floats as their
    int16 bits; each unused entry
    repeats its row's first used entry, or rewrites column 0 with its own
    value, so every write to a column writes one value), boolean indexing
    (NumPy, on a copy). ``vals`` is cast to ``g``'s dtype.
    """
    mod = type(g).__module__
    n = g.shape[-1]
    if mod.startswith("jax"):
        from jax import lax

        rows = xp.arange(math.prod(g.shape[:-1]))[:, None]
        c = xp.where(use, cols, n).reshape(rows.shape[0], cols.shape[-1])
        v = _astype(xp, vals, g.dtype).reshape(c.shape)
        if xp.finfo(g.dtype).bits == 16:
            # A set moves bits: done on uint16, because XLA:CPU scatters 16-bit
            # floats through a float32 copy of the whole operand.
            u16 = lax.bitcast_convert_type(g.reshape(-1, n), xp.uint16)
            g2 = lax.bitcast_convert_type(u16.at[rows, c].set(lax.bitcast_convert_type(v, xp.uint16), mode="drop"),
                                          g.dtype)
        else:
            g2 = g.reshape(-1, n).at[rows, c].set(v, mode="drop")
        return g2.reshape(g.shape)
    if mod.startswith("torch"):
        import torch

        cols, vals = cols.to(torch.int64), vals.to(g.dtype)
        # The row's first used entry (0 when none), and its column and value.
        first = torch.argmax(use.to(torch.int8), dim=-1, keepdim=True)
        any_used = use.any(-1, keepdim=True)
        c0 = torch.where(any_used, cols.gather(-1, first), torch.zeros_like(first))
        v0 = torch.where(any_used, vals.gather(-1, first), g.gather(-1, c0))
        idx, src = torch.where(use, cols, c0), torch.where(use, vals, v0)
        if g.element_size() == 2:
            # A set moves bits: on int16 views, because torch's CPU scatter
            # of 16-bit floats goes through a float32 copy of the whole tensor.
            g.view(torch.int16).scatter_(-1, idx, src.view(torch.int16))
            return g
        return g.scatter_(-1, idx, src)
    import numpy as np

    g2 = np.array(g, copy=True)
    u = np.asarray(use)
    lead = np.nonzero(u)
    g2[lead[:-1] + (np.asarray(cols)[u],)] = np.asarray(vals, g2.dtype)[u]
    return g2
# --- K targets per row, a per-row temperature, the sum of squared probabilities ---------
#
# The extended op shares the row statistics of the op above (computed with no
# target: ``owns`` all false, so no target is merged into the kept pair) and
# appends to them, in the same ``[..., width]`` array (so that one collective
# round still carries everything):
#
#     s2     = sum e^(2 d)                    (with_sum_p2)   merge: sum_r s2_r e^(2 dm_r)
#     zy_k   = z_(y_k) on its owner, else 0   (K columns)      merge: sum
#     dr_k   = 1 if y_k is dropped by the mask on its owner, else 0   (K columns, with a mask)
#
# and ``sum_v p_v^2 = S2 / S^2``. Target ``k``'s kept set is ``K + {y_k}``
# (each target is kept for its own log-prob): its kept pair is the shared
# pair ``(Mk, Sk)`` merged with ``(z_(y_k), 1)`` when ``y_k`` is dropped, an
# O(K) per-row step after the merge. Gradient::
#
#     dz_v = sum_k gL_k (1[v = y_k] - q^k_v) / tau + gH dH/dz_v
#
# where ``q^k`` is the distribution over target k's kept set (plus, when the
# caller differentiates ``sum_p2 = S2 / S^2``, ``gS 2 p_v (p_v - sum_p2) / tau``). On a kept
# column ``q^k_v = e^((z_v - Mk) / tau) * e^((Mk - Mk_k) / tau - log Sk_k)``,
# so ``sum_k gL_k q^k_v`` is the column's exponential times one per-row
# coefficient; a dropped target's own column adds ``-gL_k q^k_(y_k)``.
#
# The temperature may be a number, a 0-d array or an array ``[...]`` of the
# rows' shape (one ``tau`` per row; :func:`row_temperature`). It is treated as
# a constant: no gradient flows to it.


class ExtLayout(NamedTuple):
    """Columns of the extended statistics ``[..., width]``.

    ``k``: targets per row; ``has_mask``: a keep mask was given (the
    ``dr_k`` columns); ``with_sum_p2``: the ``s2`` column. Columns:
    ``[0, N_STATS)`` the statistics of :data:`STATS` (with ``zy = 0``), then
    ``s2`` (if ``with_sum_p2``), ``zy_1..zy_K``, ``dr_1..dr_K`` (if ``has_mask``).
    """

    k: int
    has_mask: bool
    with_sum_p2: bool

    @property
    def width(self) -> int:
        return N_STATS + int(self.with_sum_p2) + self.k * (2 if self.has_mask else 1)

    @property
    def zy(self) -> slice:
        a = N_STATS + int(self.with_sum_p2)
        return slice(a, a + self.k)

    @property
    def dropped(self) -> slice:
        a = N_STATS + int(self.with_sum_p2) + self.k
        return slice(a, a + self.k)


def _is_row_array(temperature) -> bool:
    return not isinstance(temperature, (int, float)) and len(getattr(temperature, "shape", ())) > 0


def row_temperature(xp, temperature, dtype=None):
    """``(row, col)``: the temperature for row-shaped ``[...]`` and for block-shaped ``[..., n]`` arrays.

    A number or a 0-d array is returned as it is (cast to ``dtype`` if an
    array) for both. An array ``[...]`` (one ``tau`` per row, the rows'
    shape) gives ``(tau, tau[..., None])``, with every entry that is not a
    finite number > 0 replaced by NaN: such a row's outputs and gradient are
    NaN (a backend raises instead when asked to validate).
    """
    if not _is_row_array(temperature):
        return (temperature, temperature) if dtype is None else (_tau(xp, temperature, dtype),) * 2
    t = temperature if dtype is None else _astype(xp, temperature, dtype)
    t = xp.where((t > 0) & (t < xp.inf), t, xp.nan)
    return t, t[..., None]


def _row_k(tau):
    # a row temperature [...] against [..., K] per-target arrays
    return tau[..., None] if _is_row_array(tau) else tau


def ext_block_stats(xp, z, local, owns, keep=None, temperature=1.0, *, start: int = 0, dtype=None, acc_dtype=None,
                    with_entropy: bool = True, with_sum_p2: bool = False, kept_shift: str = "kept",
                    entropy_terms: str = "clamp"):
    """Extended statistics of one column block: ``[..., ExtLayout(K, keep is not None, with_sum_p2).width]``.

    Args:
      z: ``[..., n]`` logits of the block ``[start, start + n)`` of the shard.
      local, owns: ``[..., K]`` from :func:`target_to_local` of a ``[..., K]``
        target (K targets per row).
      keep: ``[..., n]`` bool or ``None``.
      temperature: a number, a 0-d array or ``[...]`` (one per row; see
        :func:`row_temperature`).
      with_sum_p2: append ``s2 = sum e^(2 d)`` (for ``sum_v p_v^2``).
      Others as in :func:`block_stats` (``with_entropy=False`` is overridden
      when ``with_sum_p2``: ``s2`` needs ``s``).

    Returns:
      The :data:`STATS` of the block with no target (``zy = 0``; the kept pair
      over the mask alone), then ``s2``, ``zy_k`` and the dropped flags
      ``dr_k`` (1.0 or 0.0) as laid out by :class:`ExtLayout`.
    """
    z = _cast(xp, z, dtype)
    _, tc = row_temperature(xp, temperature, z.dtype if _is_row_array(temperature) else None)
    base = block_stats(xp, z, xp.zeros_like(local[..., 0]), xp.zeros_like(owns[..., 0]), keep, tc, start=start,
                       acc_dtype=acc_dtype, with_entropy=with_entropy or with_sum_p2, kept_shift=kept_shift,
                       entropy_terms=entropy_terms)
    cols = [base]
    if with_sum_p2:
        e2 = xp.exp(2.0 * _shifted(xp, z, base[..., 0], tc, products=False))
        cols.append(_sum(xp, e2, acc_dtype, z.dtype)[..., None])
    col, inside = _in_block(xp, z, local, owns, start)
    cols.append(xp.where(inside, xp.take_along_axis(z, col, axis=-1), 0.0))
    if keep is not None:
        dropped = inside & xp.logical_not(xp.take_along_axis(keep, col, axis=-1))
        cols.append(_astype(xp, dropped, z.dtype))
    return _concat(xp, cols)


def ext_reduce_stats(xp, stats, layout: ExtLayout, axis: int = 0, temperature=1.0):
    """Merge extended statistics along ``axis`` (:func:`reduce_stats` plus ``s2``, ``zy_k``, ``dr_k``).

    ``temperature`` as in :func:`ext_block_stats` (``[...]``: the rows'
    shape, without ``axis``). Associative, like :func:`reduce_stats`.
    """
    tr, _ = row_temperature(xp, temperature, stats.dtype if _is_row_array(temperature) else None)
    ax = axis if axis >= 0 else axis + 1  # the stats axis is gone from the fields
    cols = [reduce_stats(xp, stats[..., :N_STATS], axis=axis, temperature=tr)]
    if layout.with_sum_p2:
        m = stats[..., 0]
        M = xp.max(m, axis=ax, keepdims=True)
        w2 = xp.exp(2.0 * (m - _finite_or_zero(xp, M)) / tr)
        cols.append(xp.sum(w2 * stats[..., N_STATS], axis=ax)[..., None])
    cols.append(xp.sum(stats[..., N_STATS + int(layout.with_sum_p2):], axis=axis))
    return _concat(xp, cols)


class ExtCombined(NamedTuple):
    """Finalized extended statistics.

    ``comb``: the shared :class:`Combined` (its kept pair over the mask
    alone); ``zy``: ``[..., K]`` target logits; ``dropped``: ``[..., K]``
    bool or ``None`` (no mask); ``mk``, ``log_sk``: ``[..., K]`` each target's
    kept pair (the shared one merged with the target where dropped);
    ``sum_p2``: ``[...]`` ``sum_v p_v^2`` or ``None``.
    """

    comb: Combined
    zy: Any
    dropped: Any
    mk: Any
    log_sk: Any
    sum_p2: Any


def ext_finalize(xp, stats, layout: ExtLayout, temperature=1.0) -> ExtCombined:
    """:class:`ExtCombined` from fully reduced ``[..., layout.width]`` statistics."""
    tr, _ = row_temperature(xp, temperature, stats.dtype if _is_row_array(temperature) else None)
    comb = finalize(xp, stats[..., :N_STATS], tr)
    zy = stats[..., layout.zy]
    mk0 = comb.mk[..., None] + xp.zeros_like(zy)
    if layout.has_mask:
        dropped = stats[..., layout.dropped] > 0
        sk0 = stats[..., STATS.index("sk")][..., None]
        yk = xp.where(dropped, zy, -xp.inf)
        mk = xp.maximum(mk0, yk)
        shift = _finite_or_zero(xp, mk)
        tk = _row_k(tr)
        # sk0 e^((mk0 - mk) / tau) is 0 for an empty shared kept set (sk0 = 0, mk0 = -inf)
        sk = xp.where(sk0 > 0, sk0 * xp.exp((mk0 - shift) / tk), 0.0) + xp.exp((yk - shift) / tk)
        log_sk = xp.log(sk)
    else:
        dropped, mk, log_sk = None, mk0, comb.log_sk[..., None] + xp.zeros_like(zy)
    sum_p2 = None
    if layout.with_sum_p2:
        s = stats[..., STATS.index("s")]
        sum_p2 = stats[..., N_STATS] / (s * s)
    return ExtCombined(comb, zy, dropped, mk, log_sk, sum_p2)


def ext_outputs(xp, ec: ExtCombined, valid, temperature=1.0):
    """``(logprob [..., K], entropy [...], sum_p2 [...] or None)`` from :class:`ExtCombined`.

    ``L_k = (z_(y_k) - Mk_k) / tau - log Sk_k`` (0 where ``valid [..., K]`` is
    false), ``H = log S - c``, ``sum_p2 = S2 / S^2``.
    """
    tr, _ = row_temperature(xp, temperature, ec.zy.dtype if _is_row_array(temperature) else None)
    logprob = xp.where(valid, (ec.zy - ec.mk) / _row_k(tr) - ec.log_sk, 0.0)
    return logprob, ec.comb.log_s - ec.comb.c, ec.sum_p2


def ext_target_weights(xp, ec: ExtCombined, valid, g_logprob, temperature=1.0):
    """``[..., K]``: what :func:`ext_block_grad` adds at target k's column,
    ``gL_k (1 - [y_k dropped] q^k_(y_k)) / tau``.

    (0 for invalid targets.) A backend with a scatter may add these itself
    (a scatter-add of K values per row: repeated ids add up) and call
    :func:`ext_block_grad` with ``target_terms=False``, instead of K
    compares over the block.
    """
    tr, _ = row_temperature(xp, temperature, ec.zy.dtype if _is_row_array(temperature) else None)
    gl = xp.where(valid, g_logprob, 0.0) / _row_k(tr)
    if ec.dropped is None:
        return gl
    q_y = xp.exp((ec.zy - ec.mk) / _row_k(tr) - ec.log_sk)
    return xp.where(ec.dropped, gl * (1.0 - q_y), gl)


def ext_q_coefficient(xp, ec: ExtCombined, valid, g_logprob, temperature=1.0, *, masked: bool):
    """``[...]``: the row coefficient of the q-terms of :func:`ext_block_grad`, ``sum_k gL_k q^k_v / tau = A x_v``.

    Without a mask ``q^k = p`` for every k: ``A = sum_k gL_k / tau`` and
    ``x = p``. With one (``masked``), on a kept column ``q^k_v = e^((z_v -
    Mk) / tau) e^((Mk - Mk_k) / tau - log Sk_k)``: ``A = sum_k gL_k
    e^((Mk - Mk_k) / tau - log Sk_k) / tau`` and ``x_v = e^((z_v - Mk) /
    tau)`` (0 on dropped columns). Invalid targets, zero ``gL_k`` and (with a
    mask) targets with no kept mass are left out by the selects.
    """
    tr, _ = row_temperature(xp, temperature, ec.zy.dtype if _is_row_array(temperature) else None)
    gl = xp.where(valid, g_logprob, 0.0) / _row_k(tr)  # [..., K]
    if not masked:
        return xp.sum(gl, axis=-1)
    mk0 = _finite_or_zero(xp, ec.comb.mk)
    return xp.sum(xp.where(valid & (gl != 0), gl * xp.exp((mk0[..., None] - ec.mk) / _row_k(tr) - ec.log_sk), 0.0),
                  axis=-1)


def ext_block_grad(xp, z, local, owns, keep, ec: ExtCombined, valid, g_logprob, g_entropy, temperature=1.0, *,
                   start: int = 0, dtype=None, g_sum_p2=None, target_terms: bool = True):
    """Gradient of ``sum(sum_k gL_k L_k + gH H)`` w.r.t. one column block of logits.

    Args:
      z: ``[..., n]``; local, owns, valid: ``[..., K]``; keep: ``[..., n]`` or ``None``.
      ec: :class:`ExtCombined` of these rows.
      g_logprob: ``[..., K]``; g_entropy: ``[...]`` or ``None``.
      temperature: as in :func:`ext_block_stats`; a constant (no gradient).
      start, dtype: as in :func:`block_grad`.
      g_sum_p2: ``[...]`` upstream gradient of ``sum_p2`` or ``None``
        (needs ``ec.sum_p2``): adds ``gS 2 p_v (p_v - sum_p2) / tau``.
      target_terms: ``False`` leaves out the terms at the target columns
        (:func:`ext_target_weights`, for the caller to scatter-add).

    Returns:
      ``[..., n]`` in the compute dtype:
      ``(sum_k gL_k (1[v = y_k] - q^k_v) + gH p_v (c - d_v) + 2 gS p_v (p_v - S2)) / tau``.
    """
    z = _cast(xp, z, dtype)
    tr, tc = row_temperature(xp, temperature, z.dtype if _is_row_array(temperature) else None)
    comb = ec.comb
    d = _shifted(xp, z, comb.M, tc, products=g_entropy is not None)
    p = None
    a = ext_q_coefficient(xp, ec, valid, g_logprob, temperature, masked=keep is not None)
    if keep is None:
        p = xp.exp(d - comb.log_s[..., None])
        g = -a[..., None] * p
    else:
        eq = xp.exp(_over_tau(z - _finite_or_zero(xp, comb.mk)[..., None], tc))
        g = -xp.where(keep, eq * a[..., None], 0.0)
    if target_terms:
        # at target k's column: gL_k (1 - q^k_(y_k) if y_k is dropped, else 1) / tau
        coef = ext_target_weights(xp, ec, valid, g_logprob, temperature)
        for k in range(local.shape[-1]):
            is_y = _target_columns(xp, z, local[..., k], owns[..., k], start)
            g = g + xp.where(is_y, coef[..., k:k + 1], 0.0)
    if g_entropy is not None:
        if p is None:
            p = xp.exp(d - comb.log_s[..., None])
        g = g + (g_entropy / tr)[..., None] * (p * (comb.c[..., None] - d))
    if g_sum_p2 is not None:
        if p is None:
            p = xp.exp(d - comb.log_s[..., None])
        g = g + (2.0 * g_sum_p2 / tr)[..., None] * (p * (p - ec.sum_p2[..., None]))
    return g
