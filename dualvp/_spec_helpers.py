"""Small helpers of :mod:`dualvp.spec`: guards, casts, column bookkeeping; no math of the op.

Every function takes the array namespace ``xp`` first, as the spec's do.
"""

from __future__ import annotations


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
