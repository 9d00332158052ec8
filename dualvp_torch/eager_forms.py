"""Torch-specific eager forms of the spec's unmasked shard stages: fewer aten ops, reused scratch.

The eager engine (:mod:`dualvp_torch.eager`) runs the spec's functions op by
op; through the array API each function is a new temporary per step and
some ``O(T)`` helper ops per row chunk (~100 aten ops per chunk of the
gradient). The forms here compute the same functions of :mod:`dualvp.spec`
over torch directly, for a whole-shard block (``start = 0``) without a keep
mask:

* :func:`stats_rows` is ``spec.block_stats`` (``keep=None``, i.e.
  ``spec.block_sums`` then ``spec.stats_from_sums``): the same ops in the same
  order on the block (``d = (z - m) / tau`` clamped as ``spec._shifted``,
  ``s = sum e^d``, ``t = sum e^d d``): bit for bit the spec's statistics;
  written straight into the ``[T, 6]`` output, two chunk-sized buffers reused
  by every chunk, the target logit gathered once per shard
  (:func:`finish_stats`).
* :func:`grad_rows` is ``spec.block_grad`` (``keep=None``)::

      g_v = (gL (1[v=y] - p_v) + gH p_v (c - d_v)) / tau
          = p_v (k0 - b d_v) + a 1[v=y]
      a = gL / tau (0 on rows that are not valid), b = gH / tau, k0 = b c - a

  the per-row coefficients formed once per shard (:func:`grad_coefficients`),
  the block in two passes after ``p`` (one ``addcmul``, one ``mul``), the
  target's ``+a`` an ``O(T)`` scatter. Rounding differs from the spec's order
  by an ulp or so (within the float64 oracle's tolerances); every value is a
  function of its own row, so rows are bitwise the same at any ``T`` and
  position. Without the entropy term (``gH`` absent) the rows that are not
  valid get 0, as in the spec, NaN rows included.

Both read only the shard's row vectors (``local`` in ``[0, V_local)`` where
``owns``, as :func:`dualvp.spec.target_to_local` gives it) and allocate at
most two chunk-sized compute-dtype buffers (a bfloat16 / float16 block is
cast inside the first op: ``z - m`` with ``m`` in float32 computes in
float32, the cast's values exactly).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["GRAD_D_FLOOR", "scratch", "stats_rows", "finish_stats", "grad_coefficients", "grad_buffers", "grad_rows"]


#: The gradient's floor for ``d`` (``spec._shifted`` clamps to the dtype's lowest value): ``p = e^(d - log S)``
#: is 0 below it in float32 and float64 alike (``log S >= 0``), so the clamp changes no ``p > 0`` column, and
#: ``b d`` cannot overflow where ``p = 0`` (``|b| = |gH / tau| < 3e35``; ``p (k0 - b d)`` multiplies ``p`` last).
GRAD_D_FLOOR = -1024.0


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    # spec._finite_or_zero: -inf -> 0; NaN and +inf as they are
    return torch.nan_to_num(m, nan=math.nan, posinf=math.inf, neginf=0.0)


def _is_one(tau) -> bool:
    return isinstance(tau, (int, float)) and tau == 1


def scratch(rows: int, v: int, dtype: torch.dtype, device, n: int = 2) -> list:
    """``n`` buffers ``[rows, v]`` of the compute dtype, for every chunk of one stage."""
    return [torch.empty((rows, v), dtype=dtype, device=device) for _ in range(n)]


def stats_rows(z: torch.Tensor, out: torch.Tensor, tau, with_entropy: bool, bufs: Optional[list] = None) -> None:
    """Columns ``m, s, t`` of ``spec.block_stats`` (``keep=None``) of the rows ``z [n, V]``, into ``out [n, 6]``.

    ``bufs``: two buffers of at least ``n`` rows (:func:`scratch`), or None.
    """
    n = z.shape[0]
    m = out[:, 0:1]
    if z.dtype == out.dtype:
        torch.amax(z, -1, keepdim=True, out=m)
    else:  # the max of the cast values is the cast of the max
        m.copy_(torch.amax(z, -1, keepdim=True))
    if bufs is None:
        d = torch.sub(z, _finite_or_zero(m))
        e = torch.empty_like(d)
    else:
        d = torch.sub(z, _finite_or_zero(m), out=bufs[0][:n])
        e = bufs[1][:n]
    if not _is_one(tau):
        d.div_(tau)
    if with_entropy:
        d.clamp_(min=torch.finfo(d.dtype).min)  # spec._shifted(products=True)
    torch.exp(d, out=e)
    torch.sum(e, -1, keepdim=True, out=out[:, 1:2])
    if with_entropy:
        torch.sum(e.mul_(d), -1, keepdim=True, out=out[:, 2:3])
    else:
        out[:, 2].zero_()


def finish_stats(out: torch.Tensor, z: torch.Tensor, local: torch.Tensor, owns: torch.Tensor) -> torch.Tensor:
    """The shard's ``[T, 6]`` statistics from :func:`stats_rows`' columns: ``mk, sk = m, s``; ``zy``."""
    out[:, 3:5] = out[:, 0:2]
    zy = torch.gather(z, 1, local[:, None])
    out[:, 5:6] = torch.where(owns[:, None], zy, 0.0)  # (cast to the compute dtype: exact)
    return out


def grad_coefficients(M, log_s, c, valid, owns, gl, ge, tau) -> tuple:
    """Per-row ``(shift, log_s, k0, -b, a, a_y)`` of :func:`grad_rows`, ``[T, 1]`` each.

    ``k0, -b`` are None without ``ge``; ``a_y`` is ``a`` on the rows whose
    target this shard owns, else 0 (what the scatter adds at the target).
    """
    a = torch.where(valid, gl, 0.0)
    if not _is_one(tau):
        a = a / tau
    a = a[:, None]
    a_y = torch.where(owns[:, None], a, 0.0)
    shift = _finite_or_zero(M)[:, None]
    if ge is None:
        return shift, log_s[:, None], None, None, a, a_y
    b = ge if _is_one(tau) else ge / tau
    k0 = torch.addcmul(-a, b[:, None], c[:, None])
    return shift, log_s[:, None], k0, -b[:, None], a, a_y


def grad_buffers(z_dtype: torch.dtype, compute_dtype: torch.dtype, with_entropy: bool = True) -> int:
    """Scratch buffers :func:`grad_rows` takes when it writes into a ``dst`` of ``z_dtype``: the
    compute dtype's ``d`` and ``p``, one of which is ``dst`` itself (``z`` in place: ``d``) where
    the dtypes are the same; without the entropy term one array holds ``d``, ``p`` and ``g`` in turn."""
    return (1 if z_dtype == compute_dtype else 2) - (0 if with_entropy else 1)


def grad_rows(z, dst, local, valid, coef, tau, bufs: Optional[list] = None) -> torch.Tensor:
    """``spec.block_grad`` (``keep=None``) of the rows ``z [n, V]`` (``coef``: their :func:`grad_coefficients`).

    Written into ``dst`` (``z`` itself for the in-place gradient; in ``z``'s
    dtype) or, with ``dst=None``, returned as a new tensor (then ``bufs`` must
    be None). ``bufs``: :func:`grad_buffers` buffers of at least ``n`` rows, or None.
    """
    shift, log_s, k0, nb, a, a_y = coef
    n = z.shape[0]
    cd = log_s.dtype
    inplace = dst is not None and dst.data_ptr() == z.data_ptr()
    direct = dst is not None and dst.dtype == cd  # the gradient written straight into dst

    pool = list(bufs or ())

    def buf():  # the next scratch buffer (grad_buffers of them in all), or a new one
        return pool.pop(0)[:n] if pool else torch.empty((n, z.shape[1]), dtype=cd, device=z.device)

    if k0 is None:  # log-prob only: one array holds d, p and the gradient in turn
        g = (z.sub_(shift) if inplace else torch.sub(z, shift, out=dst)) if direct else torch.sub(z, shift, out=buf())
        if not _is_one(tau):
            g.div_(tau)
        g.sub_(log_s).exp_()  # p = q = e^(d - log S)
        # rows that are not valid: 0, as the spec's where (a NaN row's p included)
        torch.where(valid[:, None], g.mul_(-a), g.new_zeros(()), out=g)
        return _finish(g.scatter_add_(1, local[:, None], a_y), z, dst)
    # d = (z - M) / tau; in place where the gradient is written over z in its own dtype
    d = z.sub_(shift) if inplace and direct else torch.sub(z, shift, out=buf())
    if not _is_one(tau):
        d.div_(tau)
    p = torch.sub(d, log_s, out=dst if direct and not inplace else buf())
    p.exp_()  # p = e^(d - log S)
    d.clamp_(min=GRAD_D_FLOOR)  # as spec._shifted(products=True): p (c - d) = 0 on -inf columns
    torch.addcmul(k0, d, nb, out=d)  # b (c - d) - a
    g = torch.mul(p, d, out=d) if inplace and direct else p.mul_(d)
    return _finish(g.scatter_add_(1, local[:, None], a_y), z, dst)  # + a 1[v = y]


def _finish(g, z, dst):
    if dst is None:
        return g if g.dtype == z.dtype else g.to(z.dtype)
    if g.data_ptr() != dst.data_ptr():
        dst.copy_(g)
    return dst
