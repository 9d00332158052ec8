"""The op with K targets per row, a per-row temperature and/or the sum of squared probabilities.

The same shape as :mod:`dualvp_jax.function`'s op, over the extended
statistics of :mod:`dualvp.spec` (``spec.ext_block_stats``: the shared row
statistics, then ``s2``, ``zy_k`` and the dropped flags, one array)::

    stats = spec.ext_block_stats(z_shard)               [..., width]   O(T K)
    table = all_gather(stats, axis_name, to="invarying") the only collective, whatever K
    ec    = spec.ext_finalize(spec.ext_reduce_stats(table))
    logprob [..., K], entropy [...], sum_p2 [...] = spec.ext_outputs(ec)

Backward: ``spec.ext_block_grad`` from the saved logits and ``ec``, no
collective; ``sum_p2`` is differentiable (``dS/dz_v = 2 p_v (p_v - S) /
tau``, verl's drop-in differentiates it), the temperature is not (a
constant: its cotangent is zero).

The :class:`~dualvp.validation.Options` decide the layout: ``n_targets``
(0: one target ``[...]``, run as K = 1 and squeezed), ``row_temperature``
(the temperature is an array broadcast to the rows, an input of the
program: changing it never recompiles; otherwise the static
``opt.temperature``) and ``with_sum_p2``. Rows whose temperature is not a
finite number > 0 come out NaN (``spec.row_temperature``); rows with an
out-of-range target come out NaN whole (every log-prob of the row, the
entropy, ``sum_p2`` and the gradient row).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from dualvp import spec
from dualvp.validation import Options

from . import chunks
from ._tuning import ENTROPY_TERMS, Tuning
from .shards import compute_dtype, gather_stats, int_dtype

__all__ = ["layout_of", "ext_apply"]


def layout_of(opt: Options) -> spec.ExtLayout:
    """The statistics layout of ``opt``."""
    return spec.ExtLayout(max(opt.n_targets, 1), opt.has_mask, opt.with_sum_p2)


def _position(axis_name, opt: Options, target, v_local: int):
    """``(valid, owns, local, row_bad)`` for this shard; ``target`` is ``[..., K]``."""
    if axis_name is None:
        r, w = 0, 1
    else:
        r = lax.axis_index(axis_name)
        w = lax.axis_size(axis_name)
    valid, owns, local = spec.target_to_local(jnp, target, r, v_local, opt.ignore_index)
    bad = valid & ((target < 0) | (target >= w * v_local))
    return valid, owns, local, jnp.any(bad, axis=-1)


def _stats(logits, local, owns, keep, tau, cdt, opt: Options, tuning: Tuning):
    """``spec.ext_block_stats`` of the whole shard, in bounded row chunks on the CPU.

    The same plan as :func:`dualvp_jax.function._shard_stats` (row chunks of
    ``tuning.chunk_bytes``, column blocks of ``tuning.column_block`` merged
    with the spec's reduce, a keep mask in one pass with ``kept_shift="max"``
    and one redo of the marked rows under ``lax.cond``), with the per-row
    temperature chunked along with the rows.
    """
    lay = layout_of(opt)
    row_tau = opt.row_temperature

    def whole(z, local, owns, keep, t, start=0, kept_shift="kept"):
        return spec.ext_block_stats(jnp, z, local, owns, keep, t if row_tau else tau, start=start, dtype=cdt,
                                    with_entropy=opt.with_entropy, with_sum_p2=opt.with_sum_p2,
                                    kept_shift=kept_shift, entropy_terms=ENTROPY_TERMS)

    def blocked(z, local, owns, keep, t, kept_shift):
        bounds = chunks.column_blocks(z.shape[-1], tuning.column_block)
        parts = [whole(z[..., a:b], local, owns, None if keep is None else keep[..., a:b], t, start=a,
                       kept_shift=kept_shift) for a, b in bounds]
        if len(parts) == 1:
            return parts[0]
        return spec.ext_reduce_stats(jnp, jnp.stack(parts), lay, axis=0, temperature=t if row_tau else tau)

    def run(args, kept_shift):
        rows = chunks.chunk_rows(args[0].shape[-1], budget=tuning.chunk_bytes)
        return chunks.map_row_chunks(partial(blocked, kept_shift=kept_shift), args, rows)

    def chunked(z, local, owns, keep, t):
        n, v = math.prod(z.shape[:-1]), z.shape[-1]
        k = local.shape[-1]
        args = (z.reshape(n, v), local.reshape(n, k), owns.reshape(n, k),
                None if keep is None else keep.reshape(n, v), None if t is None else t.reshape(n))
        out = chunks.stats_with_redo(run, args, keep is not None)
        return out.reshape(z.shape[:-1] + out.shape[-1:])

    t = tau if row_tau else None
    if tuning.path == "auto":
        return lax.platform_dependent(logits, local, owns, keep, t, cpu=chunked, default=whole)
    return {"whole": whole, "chunked": chunked}[tuning.path](logits, local, owns, keep, t)


def _forward(logits, target, keep, tau, axis_name, opt: Options, tuning: Tuning):
    cdt = compute_dtype(logits.dtype)
    t = tau.astype(cdt) if opt.row_temperature else opt.temperature
    lay = layout_of(opt)
    valid, owns, local, bad = _position(axis_name, opt, target, logits.shape[-1])
    stats = _stats(logits, local, owns, keep, t, cdt, opt, tuning)
    ec = spec.ext_finalize(jnp, spec.ext_reduce_stats(jnp, gather_stats(axis_name, stats), lay, axis=0, temperature=t),
                           lay, t)
    logprob, entropy, sum_p2 = spec.ext_outputs(jnp, ec, valid, t)
    logprob = jnp.where(bad[..., None], jnp.nan, logprob)
    entropy = jnp.where(bad, jnp.nan, entropy)
    if sum_p2 is None:
        sum_p2 = jnp.zeros_like(entropy)
    sum_p2 = jnp.where(bad, jnp.nan, sum_p2)
    return (logprob, entropy, sum_p2), ec


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _op(logits, target, keep, tau, axis_name, opt: Options, tuning: Tuning):
    return _forward(logits, target, keep, tau, axis_name, opt, tuning)[0]


def _op_fwd(logits, target, keep, tau, axis_name, opt: Options, tuning: Tuning):
    out, ec = _forward(logits, target, keep, tau, axis_name, opt, tuning)
    return out, (logits, target, keep, tau, ec)


def _op_bwd(axis_name, opt: Options, tuning: Tuning, res, cotangents):
    logits, target, keep, tau, ec = res
    g_logprob, g_entropy, g_sum_p2 = cotangents
    cdt = compute_dtype(logits.dtype)
    t = tau.astype(cdt) if opt.row_temperature else opt.temperature
    valid, owns, local, bad = _position(axis_name, opt, target, logits.shape[-1])
    g_entropy = jnp.asarray(g_entropy, cdt) if opt.need_entropy_grad else None
    g_sum_p2 = jnp.asarray(g_sum_p2, cdt) if opt.with_sum_p2 else None
    g = spec.ext_block_grad(jnp, logits, local, owns, keep, ec, valid, jnp.asarray(g_logprob, cdt), g_entropy, t,
                            dtype=cdt, g_sum_p2=g_sum_p2)
    g = jnp.where(bad[..., None], jnp.full_like(g, jnp.nan), g)
    # The temperature is a constant: a zero cotangent.
    return g.astype(logits.dtype), None, None, None if tau is None else jnp.zeros_like(tau)


_op.defvjp(_op_fwd, _op_bwd)


def ext_apply(logits, target, keep_mask, tau, axis_name, opt: Options, tuning: Tuning):
    """The extended op on validated arguments (per shard): ``(logprob, entropy, sum_p2)``.

    ``target`` is ``[...]`` (``opt.n_targets == 0``) or ``[..., K]``; ``tau``
    ``None`` (static ``opt.temperature``) or an array of the rows' shape.
    ``entropy`` is ``None`` without ``opt.with_entropy`` (and under
    ``stop_gradient`` without ``opt.entropy_grad``), ``sum_p2`` ``None``
    without ``opt.with_sum_p2``.
    """
    logits = jnp.asarray(logits)
    target = jnp.asarray(target).astype(int_dtype())
    if opt.n_targets == 0:
        target = target[..., None]
    keep = None if keep_mask is None else jnp.asarray(keep_mask)
    if opt.row_temperature:
        tau = jnp.broadcast_to(jnp.asarray(tau), target.shape[:-1])
    else:
        tau = None
    lp, h, p2 = _op(logits, target, keep, tau, axis_name, opt, tuning)
    if opt.n_targets == 0:
        lp = lp[..., 0]
    if not opt.with_entropy:
        h = None
    elif not opt.entropy_grad:
        h = lax.stop_gradient(h)
    return lp, h, (p2 if opt.with_sum_p2 else None)


def uses_extended(opt: Options) -> bool:
    """The call needs this op (K targets, a per-row temperature or ``sum_p2``)."""
    return opt.n_targets > 0 or opt.row_temperature or opt.with_sum_p2
