"""The float64 NumPy oracle of the KL divergence, over the full (gathered) logits.

Textbook formulas, independent of :mod:`dualvp.kl_spec` (no shards, no
statistics, no shifted combine)::

    log p = log_softmax(a / tau)        log q = log_softmax(b / tau)
    KL    = sum_v p_v (log p_v - log q_v)           (0 log 0 = 0: p_v = 0 terms are 0)
    dKL/da = p (log p - log q - KL) / tau           dKL/db = (q - p) / tau

``direction="reverse"`` swaps the operands (``KL(q || p)``) and the two
gradients. Rows outside ``row_mask`` give 0 and zero gradients. Slow,
allocating, exact to float64 round-off: the judge for the backends.
"""

from __future__ import annotations

import numpy as np

__all__ = ["kl_divergence", "kl_divergence_grad"]


def _log_softmax(u: np.ndarray) -> np.ndarray:
    m = np.max(u, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore", invalid="ignore"):
        return u - m - np.log(np.sum(np.exp(u - m), axis=-1, keepdims=True))


def _prepare(logits, ref_logits, temperature, direction, row_mask):
    z = np.asarray(logits, dtype=np.float64)
    r = np.asarray(ref_logits, dtype=np.float64)
    if direction == "forward":
        a, b = z, r
    elif direction == "reverse":
        a, b = r, z
    else:
        raise ValueError(f"direction: expected 'forward' or 'reverse', got {direction!r}")
    tau = float(temperature)
    log_p = _log_softmax(a / tau)
    log_q = _log_softmax(b / tau)
    mask = np.ones(z.shape[:-1], dtype=bool) if row_mask is None else np.asarray(row_mask, dtype=bool)
    p = np.exp(log_p)
    with np.errstate(invalid="ignore"):
        kl = np.sum(np.where(p == 0, 0.0, p * (log_p - log_q)), axis=-1)
    return tau, log_p, log_q, p, kl, mask


def kl_divergence(logits, ref_logits, *, temperature: float = 1.0, direction: str = "forward",
                  row_mask=None) -> np.ndarray:
    """Per-row ``KL(softmax(logits / tau) || softmax(ref_logits / tau))`` (``"reverse"``: the other way), float64.

    Args:
      logits, ref_logits: ``[..., V]`` full logits (any float dtype; taken as they are, computed in float64).
      temperature: ``tau > 0``.
      direction: ``"forward"`` or ``"reverse"``.
      row_mask: ``[...]`` bool (``True``: the row counts) or ``None``.

    Returns:
      ``[...]`` float64; 0 on masked rows.
    """
    _, _, _, _, kl, mask = _prepare(logits, ref_logits, temperature, direction, row_mask)
    return np.where(mask, kl, 0.0)


def kl_divergence_grad(logits, ref_logits, grad, *, temperature: float = 1.0, direction: str = "forward",
                       row_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of ``sum(grad * KL)`` w.r.t. ``logits`` and ``ref_logits``: ``([..., V], [..., V])`` float64."""
    tau, log_p, log_q, p, kl, mask = _prepare(logits, ref_logits, temperature, direction, row_mask)
    g = np.where(mask, np.asarray(grad, dtype=np.float64), 0.0)[..., None] / tau
    q = np.exp(log_q)
    with np.errstate(invalid="ignore"):
        ga = np.where(p == 0, 0.0, p * (log_p - log_q - kl[..., None])) * g
        gb = (q - p) * g
    ga = np.where(mask[..., None], ga, 0.0)
    gb = np.where(mask[..., None], gb, 0.0)
    return (ga, gb) if direction == "forward" else (gb, ga)
