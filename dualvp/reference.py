"""The float64 NumPy oracle, over the full (unsharded) logits.

Built from textbook formulas, independently of :mod:`dualvp.spec`: a
max-shifted ``log_softmax``, ``softmax = exp(log_softmax)``, ``H = -sum p log
p``, and the closed-form gradients::

    dL/dz = (onehot(y) - q) / tau
    dH/dz = -p (log p + H) / tau          (equal to p (E_p[u] - u) / tau)

It is the judge for everything else: slow, allocating, and exact to float64
round-off. All options of the backends are supported: keep mask or keep ids
(the kept set as token ids, turned into a mask by :func:`mask_from_ids`; the
target is always kept; the entropy stays unmasked), temperature, ``ignore_index`` and any
leading batch dims.

The fused LM-head op (:func:`linear_logprob_entropy`, :func:`linear_logprob_entropy_grad`)
is judged the same way: the logits ``z = h W^T`` are formed in float64 from the
(already dtype-rounded) hidden states and the full weight, then the functions
above apply; its gradients are ``dh = G W`` and ``dW = G^T h`` with ``G`` the
float64 gradient of the logits.
"""

from __future__ import annotations

import numpy as np

__all__ = ["logprob_entropy", "logprob_entropy_grad", "sum_squared_probs", "sum_squared_probs_grad",
           "linear_logprob_entropy", "linear_logprob_entropy_grad", "mask_from_ids"]


def mask_from_ids(keep_ids, vocab_size: int) -> np.ndarray:
    """``[..., V]`` bool keep mask of the kept set given as ids ``keep_ids [..., K]``.

    Each id in ``[0, V)`` sets its column (a repeated id sets it once); any
    other id (the padding -1, or an out-of-range id the op was told not to
    validate) sets nothing. A loop over rows and ids, independent of the
    op's sort-and-gather.
    """
    ids = np.asarray(keep_ids)
    lead, k = ids.shape[:-1], ids.shape[-1]
    mask = np.zeros((int(np.prod(lead, dtype=np.int64)), int(vocab_size)), dtype=bool)
    for i, row in enumerate(ids.reshape(mask.shape[0], k)):
        for v in row.tolist():
            if 0 <= v < vocab_size:
                mask[i, v] = True
    return mask.reshape(lead + (int(vocab_size),))


def _mask_of(keep_mask, keep_ids, vocab_size: int):
    if keep_mask is not None and keep_ids is not None:
        raise ValueError("keep_ids: expected None when keep_mask is given (two forms of one kept set)")
    return keep_mask if keep_ids is None else mask_from_ids(keep_ids, vocab_size)


def _log_softmax(u: np.ndarray) -> np.ndarray:
    m = np.max(u, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return u - m - np.log(np.sum(np.exp(u - m), axis=-1, keepdims=True))


def _prepare(logits, target, keep_mask, temperature, ignore_index):
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(target).astype(np.int64)
    u = z / _tau_col(temperature)
    valid = y != ignore_index
    y_safe = np.where(valid, y, 0)
    onehot = np.arange(u.shape[-1]) == y_safe[..., None]
    onehot &= valid[..., None]
    logp = _log_softmax(u)
    if keep_mask is None:
        logq = logp
    else:
        kept = np.asarray(keep_mask, dtype=bool) | onehot
        with np.errstate(invalid="ignore"):
            logq = _log_softmax(np.where(kept, u, -np.inf))
    return u, valid, y_safe, onehot, logp, logq


def _tau_col(temperature):
    # A number, or one tau per row ``[...]`` (broadcast to the rows): as a column factor ``[..., 1]``.
    t = np.asarray(temperature, dtype=np.float64)
    return float(t) if t.ndim == 0 else t[..., None]


def _multi(logits, target) -> bool:
    # K targets per row: target [..., K] against logits [..., V].
    return np.ndim(target) == np.ndim(logits) and np.ndim(logits) > 0


def _entropy(logp: np.ndarray) -> np.ndarray:
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):
        # p == 0 (a banned column) contributes 0, not 0 * -inf; NaN propagates.
        return -np.sum(np.where(p == 0, 0.0, p * logp), axis=-1)


def logprob_entropy(
    logits,
    target,
    *,
    keep_mask=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    keep_ids=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Log-prob of the target and entropy, in float64.

    Args:
      logits: ``[..., V]`` full logits (any float dtype; computed in float64).
      target: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``;
        or ``[..., K]`` (``target.ndim == logits.ndim``): K targets per row,
        each with its own log-prob (and its own kept set ``keep_mask |
        onehot(target_k)``).
      keep_mask: ``[..., V]`` bool or ``None``. The log-prob is taken under the
        distribution renormalised over ``keep_mask | onehot(target)``.
      temperature: ``tau > 0``, a number or one per row (``[...]``, broadcast
        to the rows); the distribution is ``softmax(logits / tau)``.
      ignore_index: rows with this target get log-prob 0.
      keep_ids: ``[..., K]`` integer ids, the kept set as token ids (padding
        -1), or ``None``; the alternative to ``keep_mask``
        (:func:`mask_from_ids`).

    Returns:
      ``(logprob [...] or [..., K], entropy [...])`` float64.
    """
    keep_mask = _mask_of(keep_mask, keep_ids, np.shape(logits)[-1])
    if _multi(logits, target):
        t = _row_tau(logits, temperature)
        outs = [logprob_entropy(logits, np.asarray(target)[..., k], keep_mask=keep_mask, temperature=t,
                                ignore_index=ignore_index) for k in range(np.shape(target)[-1])]
        lead = np.shape(logits)[:-1]
        lp = np.stack([o[0] for o in outs], axis=-1) if outs else np.zeros(lead + (0,))
        return lp, (outs[0][1] if outs else logprob_entropy(logits, np.zeros(lead, np.int64), temperature=t)[1])
    u, valid, y, _, logp, logq = _prepare(logits, target, keep_mask, temperature, ignore_index)
    lp = np.take_along_axis(logq, y[..., None], axis=-1)[..., 0]
    return np.where(valid, lp, 0.0), _entropy(logp)


def _row_tau(logits, temperature):
    # a per-row temperature broadcast to the rows' shape (a number stays a number)
    t = np.asarray(temperature, dtype=np.float64)
    return float(t) if t.ndim == 0 else np.broadcast_to(t, np.shape(logits)[:-1])


def sum_squared_probs(logits, *, temperature=1.0) -> np.ndarray:
    """``sum_v p_v^2`` of ``p = softmax(logits / tau)``, in float64: ``[...]``.

    ``temperature``: a number or one per row (``[...]``, broadcast to the rows).
    """
    z = np.asarray(logits, dtype=np.float64)
    logp = _log_softmax(z / _tau_col(_row_tau(z, temperature)))
    return np.sum(np.exp(2.0 * logp), axis=-1)


def sum_squared_probs_grad(logits, grad_sum_p2, *, temperature=1.0) -> np.ndarray:
    """Gradient of ``sum(grad_sum_p2 * sum_v p_v^2)`` w.r.t. the logits: ``2 g p_v (p_v - sum p^2) / tau``."""
    z = np.asarray(logits, dtype=np.float64)
    t = _tau_col(_row_tau(z, temperature))
    p = np.exp(_log_softmax(z / t))
    s = np.sum(p * p, axis=-1, keepdims=True)
    return 2.0 * np.asarray(grad_sum_p2, dtype=np.float64)[..., None] * p * (p - s) / t


def logprob_entropy_grad(
    logits,
    target,
    grad_logprob,
    grad_entropy=None,
    *,
    keep_mask=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    keep_ids=None,
) -> np.ndarray:
    """Gradient of ``sum(grad_logprob * L + grad_entropy * H)`` w.r.t. logits.

    Args:
      logits, target, keep_mask, temperature, ignore_index, keep_ids: as in
        :func:`logprob_entropy`.
      grad_logprob: ``[...]`` upstream gradient of the log-prob (``[..., K]``
        with K targets: the gradient is the sum of the K log-probs' and the
        entropy's).
      grad_entropy: ``[...]`` upstream gradient of the entropy, or ``None``.

    Returns:
      ``[..., V]`` float64.
    """
    keep_mask = _mask_of(keep_mask, keep_ids, np.shape(logits)[-1])
    if _multi(logits, target):
        # sum over the K targets of each one's log-prob gradient, plus the entropy's once
        t = _row_tau(logits, temperature)
        gls = np.asarray(grad_logprob, dtype=np.float64)
        g = logprob_entropy_grad(logits, np.full(np.shape(logits)[:-1], ignore_index, np.int64),
                                 np.zeros(np.shape(gls)[:-1]), grad_entropy, temperature=t, ignore_index=ignore_index)
        for k in range(np.shape(target)[-1]):
            g = g + logprob_entropy_grad(logits, np.asarray(target)[..., k], gls[..., k], None, keep_mask=keep_mask,
                                         temperature=t, ignore_index=ignore_index)
        return g
    u, valid, _, onehot, logp, logq = _prepare(logits, target, keep_mask, temperature, ignore_index)
    gl = np.where(valid, np.asarray(grad_logprob, dtype=np.float64), 0.0)[..., None]
    q = np.exp(logq)
    # ignore_index rows have no log-prob term (not 0 * q: q is NaN when the
    # kept set of an ignored row is empty).
    g = np.where(valid[..., None], gl * (onehot.astype(np.float64) - q), 0.0)
    if grad_entropy is not None:
        p = np.exp(logp)
        h = _entropy(logp)[..., None]
        gh = np.asarray(grad_entropy, dtype=np.float64)[..., None]
        with np.errstate(invalid="ignore"):
            g = g + gh * np.where(p == 0, 0.0, -p * (logp + h))
    return g / _tau_col(temperature)


def _linear_logits(hidden, weight_full) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    h = np.asarray(hidden, dtype=np.float64)
    w = np.asarray(weight_full, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return h, w, h @ w.T


def linear_logprob_entropy(
    hidden,
    weight_full,
    target,
    *,
    keep_mask=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    keep_ids=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Log-prob and entropy of the LM head ``z = hidden @ weight_full^T``, in float64.

    Args:
      hidden: ``[..., H]`` hidden states (any float dtype; the values are taken
        as they are and the product is formed in float64).
      weight_full: ``[V, H]`` the whole (unsharded) output weight.
      target, keep_mask (``[..., V]``), temperature, ignore_index, keep_ids: as in
        :func:`logprob_entropy`.

    Returns:
      ``(logprob [...], entropy [...])`` float64.
    """
    _, _, z = _linear_logits(hidden, weight_full)
    return logprob_entropy(z, target, keep_mask=keep_mask, temperature=temperature, ignore_index=ignore_index,
                           keep_ids=keep_ids)


def linear_logprob_entropy_grad(
    hidden,
    weight_full,
    target,
    grad_logprob,
    grad_entropy=None,
    *,
    keep_mask=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    keep_ids=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of ``sum(grad_logprob * L + grad_entropy * H)`` w.r.t. hidden and weight.

    Returns:
      ``(d_hidden [..., H], d_weight [V, H])`` float64: ``G W`` and ``G^T h``
      with ``G`` = :func:`logprob_entropy_grad` of ``z = h W^T``.
    """
    h, w, z = _linear_logits(hidden, weight_full)
    g = logprob_entropy_grad(
        z, target, grad_logprob, grad_entropy, keep_mask=keep_mask, temperature=temperature, ignore_index=ignore_index,
        keep_ids=keep_ids,
    )
    g2 = g.reshape(-1, g.shape[-1])
    with np.errstate(invalid="ignore", over="ignore"):
        dh = (g2 @ w).reshape(h.shape)
        dw = g2.T @ h.reshape(-1, h.shape[-1])
    return dh, dw
