"""``keep_ids``: the kept set as global token ids, beside every engine of the logits op (O(T K) in torch).

The engines (:mod:`dualvp_torch.engines`: compiled, eager, Triton) take a
``[T, V_local]`` keep mask or none. With ``keep_ids [T, K]`` (padding -1) the
op runs the engine *without* a mask and does the kept set's part in torch
beside it, from the ``K + 1`` logits of each row at its kept columns (its
ids in this rank's shard and the target; :func:`dualvp.spec.kept_columns`):

    forward   engine stats (unmasked) [T, 6]; the kept pair (mk, sk) from
              the gathered logits [T, K+1] replaces the unmasked one
              (spec.kept_pair, spec.with_kept_pair); then the gather, merge
              and outputs as with a mask
    backward  the logits at the kept columns gathered first (the in-place
              gradient overwrites them); the engine's gradient with a zero
              log-prob cotangent (its entropy term only: right on every
              column outside the kept set, where q = 0); the kept columns'
              values (spec.kept_grad) written over it with one scatter

The extended op (K targets, a temperature tensor, sum p^2) takes the ids the
same way (:func:`ext_stats_with_ids`, and its backward in
:mod:`dualvp_torch.extended`).

Memory: O(T K) beyond the unmasked op; nothing of size ``[T, V_local]`` but
the gradient itself. The engines' kernels are unchanged: the Triton engine's
kernels never see the ids (the simplest correct route; its statistics pass
is the unmasked one, and the gather and the scatter are torch ops).

NaN rows as with a mask: a valid row whose kept set has no mass (log-prob
``-inf``) or holds NaN gets a NaN gradient row; the entropy cotangent handed
to the engine carries that NaN (``0 * log Sk``) into the row, O(T) work.
"""

from __future__ import annotations

from typing import Optional

import torch

from dualvp import spec, validation

from . import agreement
from .stages import compute_dtype, xp

__all__ = ["kept_columns", "stats_with_ids", "grad_with_ids", "ext_stats_with_ids", "count_bad_ids"]


def kept_columns(ids: torch.Tensor, y: torch.Tensor, call) -> tuple:
    """``(cols, use)`` ``[T, K+1]`` of this rank's shard (``spec.kept_columns``)."""
    return spec.kept_columns(xp, ids.to(torch.int64), y.to(torch.int64), call.rank, call.v_local,
                             call.opt.ignore_index)


def _tau(call, device) -> torch.Tensor:
    return torch.full((), call.opt.temperature, dtype=compute_dtype(call.dtype), device=device)


def stats_with_ids(stats: torch.Tensor, z: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, call) -> torch.Tensor:
    """The engine's unmasked ``[T, 6]`` statistics with the kept pair of the ids.

    The Triton engine's statistics are ``[S, T, 6]`` (``S`` column splits of
    a row, merged later like ranks; with ``keep_ids`` its plan never fuses
    the outputs into the statistics kernel): the first split takes the kept
    pair of the whole row, the others the empty pair ``(-inf, 0)``.
    """
    cols, use = kept_columns(ids, y, call)
    zk = spec.gather_columns(xp, z, cols, use, dtype=stats.dtype)
    mk, sk = spec.kept_pair(xp, zk, use, _tau(call, z.device))
    if stats.dim() == 2:
        return spec.with_kept_pair(xp, stats, mk, sk)
    out = stats.clone()
    out[..., 3], out[..., 4] = -torch.inf, 0.0
    out[0] = spec.with_kept_pair(xp, stats[0], mk, sk)
    return out


def grad_with_ids(eng, z: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, res: torch.Tensor, gl: torch.Tensor,
                  ge: Optional[torch.Tensor], call, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient ``[T, V_local]`` under the kept set ``ids`` (see the module docstring); into ``out`` if given."""
    cdt = compute_dtype(call.dtype)
    tau = _tau(call, z.device)
    y64 = y.to(torch.int64)
    valid, owns, local = spec.target_to_local(xp, y64, call.rank, call.v_local, call.opt.ignore_index)
    M, log_s, c, mk, log_sk = res.unbind(0)
    comb = spec.Combined(M, log_s, c, mk, log_sk, None)
    gl = gl.to(cdt)
    ge = None if ge is None else ge.to(cdt)
    cols, use = kept_columns(ids, y, call)
    # Before the engine runs: the in-place gradient overwrites z.
    zk = spec.gather_columns(xp, z, cols, use, dtype=cdt)
    vals = spec.kept_grad(xp, zk, cols, use, local, owns, comb, valid, gl, ge, tau)
    # 0, or NaN on a valid row whose kept set has no mass (or holds NaN)
    nan_rows = torch.where(valid, 0.0 * log_sk, torch.zeros_like(log_sk))
    if ge is None:
        g = out if out is not None else torch.empty(z.shape, dtype=z.dtype, device=z.device)
        g.copy_(nan_rows[:, None].expand(g.shape))
    else:
        g = eng.grad(z, y, None, res, torch.zeros_like(gl), (ge + nan_rows).contiguous(), call, out=out)
    return spec.set_at_columns(xp, g, cols, vals, use)


def ext_stats_with_ids(stats: torch.Tensor, z: torch.Tensor, y: torch.Tensor, owns: torch.Tensor, ids: torch.Tensor,
                       tau: torch.Tensor, call) -> torch.Tensor:
    """The extended op's unmasked statistics ``[T, N_STATS (+ s2) + K]`` as with a mask: ``[T, width + K]``.

    (:mod:`dualvp_torch.extended`, ``spec.ext_block_stats`` with the kept set
    as ids.) The shared kept pair is the ids' alone (no target: each target is
    merged into its own kept set after the reduce, ``spec.ext_finalize``), from
    the gathered logits ``[T, K_ids + 1]``; the dropped flag of target k is
    "owned here and not among the row's ids", an O(T K K_ids) compare. ``y``,
    ``owns``: ``[T, K]``; ``tau``: 0-d or ``[T]``.
    """
    none = torch.full(y.shape[:-1], -1, dtype=torch.int64, device=y.device)
    cols, use = spec.kept_columns(xp, ids.to(torch.int64), none, call.rank, call.v_local, -1)
    zk = spec.gather_columns(xp, z, cols, use, dtype=stats.dtype)
    mk, sk = spec.kept_pair(xp, zk, use, tau[:, None] if tau.ndim else tau)
    base = spec.with_kept_pair(xp, stats[:, :spec.N_STATS], mk, sk)
    listed = (y.to(torch.int64)[:, :, None] == ids.to(torch.int64)[:, None, :]).any(-1)
    dropped = (owns & ~listed).to(stats.dtype)
    return torch.cat([base, stats[:, spec.N_STATS:], dropped], dim=-1)


def count_bad_ids(ids: torch.Tensor, vocab_size: int) -> tuple:
    """``(count, up to 5 distinct bad ids)`` on the host: ids outside ``[0, vocab_size)`` other than -1 (a sync)."""
    i = ids.to(torch.int64)
    bad = (i != -1) & ((i < 0) | (i >= vocab_size))
    n = int(bad.sum())
    return n, (torch.unique(i[bad])[:5].tolist() if n else [])


def check_range(ids: torch.Tensor, call, group, hint: torch.Tensor) -> None:
    """``validate=True``: ids out of range raise ``ValueError`` naming ``keep_ids`` on every rank, or none does.

    A rank that finds bad ids goes through the agreement's error path
    (:func:`dualvp_torch.agreement.raise_on_every_rank`), which meets the other
    ranks' agreement all-gather: every rank raises (one host sync more, under
    ``validate=True`` only).
    """
    n, shown = count_bad_ids(ids, call.vocab)
    if not n:
        return
    agreement.raise_on_every_rank(validation.bad_ids_error(n, shown, call.vocab), group, hint,
                                  fused=call.fields == validation.LINEAR_RECORD_FIELDS, rank=call.rank)
