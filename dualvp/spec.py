"""The math of DESIGN.md, written once, over an array namespace ``xp``.

Every function here is a pure function of arrays. ``xp`` is an array-API
namespace: ``numpy`` (2.x), ``jax.numpy``, or ``array_api_compat.torch``. The
backends either call these functions directly or run optimised equivalents that
the tests hold against them.

Notation (one row = one token position; shard ``r`` of ``W`` holds the columns
``[r*V_r, (r+1)*V_r)`` of the full vocabulary ``V = W*V_r``)::

    u   = z / tau                       scaled logits                [..., V_r]
    p   = softmax(u)                    over all V columns
    q   = softmax(u restricted to K + {y})   K: keep mask, y: target
    L   = log q_y                       log-prob of the target
    H   = -sum_v p_v log p_v            entropy (unmasked)

Shard-local statistics (``STATS``, last axis of a ``[..., N_STATS]`` array).
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
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "STATS",
    "N_STATS",
    "Combined",
    "target_to_local",
    "shard_stats",
    "combine_stats",
    "outputs",
    "grad_logits",
]

#: Names of the per-shard statistics, in the order of the last axis.
STATS = ("m", "s", "t", "mk", "sk", "zy")
N_STATS = len(STATS)


class Combined(NamedTuple):
    """Row statistics after the cross-shard combine, each of shape ``[...]``.

    ``M``: global max of the logits ``z``; ``log_s``: ``log S``; ``c``:
    ``E_p[u] - M / tau``; ``mk``, ``log_sk``: the same max / log-sum over the
    kept columns; ``zy``: the target's logit. ``M``, ``mk`` and ``zy`` are in
    logits units (the temperature is applied after shifting, for precision).
    """

    M: Any
    log_s: Any
    c: Any
    mk: Any
    log_sk: Any
    zy: Any


def _finite_or_zero(xp, m):
    # A shard (or row) whose columns are all -inf has max -inf; shifting by it
    # would give (-inf) - (-inf) = NaN. Shift by 0 instead: exp(-inf) = 0, so the
    # shard contributes nothing. NaN and +inf stay as they are, so they poison
    # their own row, as documented.
    return xp.where(m == -xp.inf, xp.zeros_like(m), m)


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


def _target_columns(xp, u, local, owns):
    # [..., V_r] bool: the column that holds this row's target, if on this shard.
    cols = xp.arange(u.shape[-1], dtype=local.dtype)
    return (cols == local[..., None]) & owns[..., None]


def shard_stats(xp, z, local, owns, keep=None, temperature: float = 1.0):
    """Shard-local statistics of one vocab shard.

    Maxima and the target logit are kept in *logits* units and the temperature
    is applied after the shift (``d = (z - m) / tau``): ``z - m`` is exact for
    the columns that matter, so the result does not lose ``|z / tau| * eps``
    of absolute precision the way ``z / tau - m / tau`` would.

    Args:
      z: ``[..., V_r]`` logits of this shard (floating).
      local, owns: ``[...]`` from :func:`target_to_local`.
      keep: ``[..., V_r]`` bool keep mask or ``None`` (all kept). The target
        column is always treated as kept.
      temperature: ``tau > 0``; the distribution is ``softmax(z / tau)``.

    Returns:
      ``[..., N_STATS]`` array of ``(m, s, t, mk, sk, zy)`` in ``z``'s dtype:
      ``m = max z``, ``s = sum e^d``, ``t = sum e^d d`` with
      ``d = (z - m) / tau``; ``mk, sk`` the same over kept columns; ``zy`` the
      target's logit on the owning shard, else 0.
    """
    m = xp.max(z, axis=-1)
    d = (z - _finite_or_zero(xp, m)[..., None]) / temperature
    e = xp.exp(d)
    s = xp.sum(e, axis=-1)
    t = xp.sum(xp.where(e > 0, e * d, xp.zeros_like(d)), axis=-1)
    is_y = _target_columns(xp, z, local, owns)
    zy = xp.sum(xp.where(is_y, z, xp.zeros_like(z)), axis=-1)
    if keep is None:
        mk, sk = m, s
    else:
        zk = xp.where(keep | is_y, z, xp.full_like(z, -xp.inf))
        mk = xp.max(zk, axis=-1)
        sk = xp.sum(xp.exp((zk - _finite_or_zero(xp, mk)[..., None]) / temperature), axis=-1)
    return xp.stack([m, s, t, mk, sk, zy], axis=-1)


def combine_stats(xp, stats, axis: int = 0, temperature: float = 1.0) -> Combined:
    """Exact cross-shard combine.

    Args:
      stats: per-shard statistics stacked along ``axis`` (the shard axis), e.g.
        ``[W, ..., N_STATS]`` for ``axis=0``.
      temperature: the ``tau`` the statistics were made with.

    Returns:
      :class:`Combined`, each field ``[...]``.
    """
    m, s, t, mk, sk, zy = (stats[..., i] for i in range(N_STATS))
    M = xp.max(m, axis=axis, keepdims=True)
    dm = (m - _finite_or_zero(xp, M)) / temperature
    w = xp.exp(dm)
    S = xp.sum(w * s, axis=axis)
    # w == 0 exactly when the shard is all -inf; then s == 0 and dm = -inf.
    shift = xp.where(w > 0, s * dm, xp.zeros_like(s))
    Tm = xp.sum(w * (t + shift), axis=axis)
    MK = xp.max(mk, axis=axis, keepdims=True)
    SK = xp.sum(xp.exp((mk - _finite_or_zero(xp, MK)) / temperature) * sk, axis=axis)
    return Combined(
        M=xp.squeeze(M, axis=axis),
        log_s=xp.log(S),
        c=Tm / S,
        mk=xp.squeeze(MK, axis=axis),
        log_sk=xp.log(SK),
        zy=xp.sum(zy, axis=axis),
    )


def outputs(xp, comb: Combined, valid, temperature: float = 1.0):
    """Log-prob and entropy from combined statistics.

    ``L = (z_y - Mk) / tau - log Sk`` (0 on rows that are not ``valid``) and
    ``H = log S - c``; both ``[...]``.
    """
    logprob = xp.where(valid, (comb.zy - comb.mk) / temperature - comb.log_sk, xp.zeros_like(comb.zy))
    entropy = comb.log_s - comb.c
    return logprob, entropy


def grad_logits(
    xp,
    z,
    local,
    owns,
    keep,
    comb: Combined,
    valid,
    g_logprob,
    g_entropy,
    temperature: float = 1.0,
):
    """Gradient of ``sum(gL * L + gH * H)`` with respect to this shard's logits.

    Args:
      z: ``[..., V_r]`` logits of this shard.
      local, owns, valid: ``[...]`` from :func:`target_to_local`.
      keep: ``[..., V_r]`` bool or ``None``.
      comb: :class:`Combined` for these rows.
      g_logprob, g_entropy: ``[...]`` upstream gradients; ``g_entropy`` may be
        ``None`` (no entropy gradient). Rows that are not ``valid`` get no
        log-prob gradient.

    Returns:
      ``[..., V_r]``: ``(gL (1[v=y] - q_v) + gH p_v (c - d_v)) / tau`` with
      ``d_v = (z_v - M) / tau``.
    """
    zero = xp.zeros_like(z)
    d = (z - _finite_or_zero(xp, comb.M)[..., None]) / temperature
    p = xp.exp(d - comb.log_s[..., None])
    is_y = _target_columns(xp, z, local, owns)
    if keep is None:
        q = p
    else:
        zk = xp.where(keep | is_y, z, xp.full_like(z, -xp.inf))
        q = xp.exp((zk - _finite_or_zero(xp, comb.mk)[..., None]) / temperature - comb.log_sk[..., None])
    gl = xp.where(valid, g_logprob, xp.zeros_like(g_logprob))[..., None]
    g = gl * (xp.where(is_y, xp.ones_like(z), zero) - q)
    if g_entropy is not None:
        dh = xp.where(p > 0, p * (comb.c[..., None] - d), zero)
        g = g + g_entropy[..., None] * dh
    return g / temperature
