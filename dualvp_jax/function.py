"""The JAX op: a ``jax.custom_vjp`` over one vocab shard, combined over a mesh axis.

Forward, per shard (inside ``shard_map``, or unsharded when ``axis_name`` is
``None``)::

    stats = spec.shard_stats(z_shard)                 [..., 6]   O(T)
    table = all_gather(stats, axis_name, to="invarying")  [W, ..., 6]  the only collective
    comb  = spec.combine_stats(table)                  O(T), identical on every shard
    logprob, entropy = spec.outputs(comb)

On the CPU the shard statistics are computed over bounded blocks of rows
(:mod:`dualvp_jax.chunks`, a few ``chunks.CHUNK_BYTES`` of scratch, whatever
``T``): XLA:CPU would otherwise materialise a float32 ``[T, V_local]`` input
for each row reduction. Rows are independent, so each block's
``spec.block_stats`` are the shard's rows. Rows wider than
``chunks.COLUMN_BLOCK`` columns are split into column blocks, merged with
``spec.reduce_stats`` like shards. Other platforms fuse the reductions and
take the whole shard at once (:func:`_shard_stats`; the choice is a
:class:`~dualvp_jax._tuning.Tuning`, a static argument).

Backward: ``spec.grad_logits`` from the saved logits and the O(T) combined
statistics, one fused pass over the shard (read the logits, write the
gradient); no collective (the statistics are already global). Residuals are
the caller's logits (a reference, in the caller's dtype), target, keep mask and
O(T) statistics: nothing of size ``[T, V_local]`` is created for the backward.
Under ``jit(value_and_grad)`` the peak beyond the inputs is the gradient (1 B)
plus the chunk scratch (``tests/jax/test_memory.py``).

Varying-manual-axes (``check_vma``): the gathered table and everything
computed from it (outputs, statistics) is *invariant* over ``axis_name``
(``all_gather(..., to="invarying")``), so a caller may declare the outputs
replicated over the vocab axis; the gradient with respect to the logits varies
like the logits. ``lax.pmax`` is not used anywhere, so nothing needs a
differentiation rule for it (the forward of a ``custom_vjp`` is never
differentiated).

Precision: 16- and 32-bit inputs are computed in float32, float64 inputs in
float64 (under ``jax_enable_x64``); outputs have the compute dtype; the
gradient is computed in the compute dtype and cast to the input dtype last.

Out-of-range targets: a traced target cannot raise. A row whose target is
neither ``ignore_index`` nor in ``[0, W * V_local)`` gets NaN log-prob, NaN
entropy and a NaN gradient row (never a silently wrong number). When the
target is concrete (not traced) and ``validate=True`` (the default) the public
functions check the range first and raise ``ValueError``; with several JAX
processes only each process's addressable shards are read, and the processes
agree before anyone raises (:mod:`dualvp_jax.multiprocess`).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from dualvp import spec
from dualvp.validation import Options, bad_ids_error, check_args, count_bad_ids
from dualvp.validation import check_temperature_values as check_temperature_values_count

from . import chunks, extended, multiprocess
from .shards import compute_dtype, gather_stats, int_dtype, shard_index, shard_position
from ._tuning import DEFAULT, ENTROPY_TERMS, INDICATOR, Tuning

__all__ = ["logprob_entropy"]


# --- argument handling --------------------------------------------------------


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def describe(name: str, x, kinds: str):
    """``(shape, dtype name)`` of an array argument, or TypeError naming it."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or _is_tracer(x):
        return tuple(int(d) for d in np.shape(x)) if not _is_tracer(x) else tuple(x.shape), jnp.dtype(x.dtype).name
    raise TypeError(f"{name}: expected {kinds}, got {type(x).__name__}")


def check_temperature_type(temperature) -> None:
    # dualvp.validation.check_temperature falls back to float(), which accepts
    # True and "1.0"; the op needs a static Python / NumPy number.
    if isinstance(temperature, (bool, np.bool_, str, bytes)) or _is_tracer(temperature):
        raise TypeError(
            f"temperature: expected a finite float > 0 (a static Python number), "
            f"got {type(temperature).__name__} {temperature!r}"
        )


def _is_row_temperature(temperature) -> bool:
    """A temperature tensor (one per row): a traced value, or an array with at least one dim.

    A concrete 0-d array or NumPy scalar stays a static number, as before.
    """
    if _is_tracer(temperature):
        return True
    return isinstance(temperature, (jax.Array, np.ndarray)) and np.ndim(temperature) > 0


def validated_options(logits, target, keep_mask, temperature, ignore_index, with_entropy, entropy_grad,
              multi_target=False, with_sum_p2=False, keep_ids=None):
    """Static checks (shapes, dtypes, options); returns the :class:`~dualvp.validation.Options`.

    The frozen options object is the static (``jit``) configuration of the op,
    next to ``axis_name``; ``opt.has_ids`` says that the op's ``keep``
    argument holds ``keep_ids`` rather than a mask.
    """
    tau_kw = {}
    if _is_row_temperature(temperature):
        tau_kw = dict(temperature_shape=tuple(temperature.shape), temperature_dtype=jnp.dtype(temperature.dtype).name)
    else:
        check_temperature_type(temperature)
    ls, ld = describe("logits", logits, "a floating jax.Array or numpy array [..., V_local]")
    ts, td = describe("target", target, "an integer jax.Array or numpy array [...]")
    ks = kd = None
    if keep_mask is not None:
        ks, kd = describe("keep_mask", keep_mask, "None or a bool jax.Array or numpy array [..., V_local]")
    ids_shape, ids_dtype = describe_ids(keep_ids)
    return check_args(
        logits_shape=ls,
        logits_dtype=ld,
        target_shape=ts,
        target_dtype=td,
        keep_shape=ks,
        keep_dtype=kd,
        temperature=1.0 if tau_kw else temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        ids_shape=ids_shape,
        ids_dtype=ids_dtype,
        multi_target=multi_target,
        with_sum_p2=with_sum_p2,
        **tau_kw,
    )


def describe_ids(keep_ids):
    """``(shape, dtype name)`` of ``keep_ids``, ``(None, None)`` for ``None``."""
    if keep_ids is None:
        return None, None
    return describe("keep_ids", keep_ids, "None or an integer jax.Array or numpy array [..., K] of global ids")


def check_ids_range(keep_ids, vocab_size: int) -> None:
    """Raise ``ValueError`` naming ``keep_ids`` if a concrete ``keep_ids`` holds ids outside ``[0, V)`` other than -1.

    Nothing for ``None`` or traced ids (those ids are ignored: they lie in no
    shard). Reads this process's addressable part (one host synchronisation,
    O(T K) bytes); with several JAX processes it runs inside the checks that
    the processes agree on, so that every one raises or none does.
    """
    if keep_ids is None or _is_tracer(keep_ids):
        return
    count, shown = 0, []
    for part in multiprocess._local_parts(keep_ids):
        c, s = count_bad_ids(part, vocab_size)
        count, shown = count + c, shown + s
    if count:
        raise bad_ids_error(count, sorted(set(shown))[:5], vocab_size)


def check_temperature_values(temperature) -> None:
    """Raise ``ValueError`` naming ``temperature`` if a concrete temperature tensor holds a value that
    is not finite and > 0; traced values are not checked (NaN rows).

    Reads this process's addressable part only (one host synchronisation, O(its rows) bytes): a global
    array spanning other processes is never fetched whole. With several JAX processes it runs inside
    the checks that the processes agree on, so that every one raises or none does.
    """
    if _is_tracer(temperature) or not _is_row_temperature(temperature):
        return
    count, shown = 0, None
    for part in multiprocess._local_parts(temperature):
        t = np.asarray(part, dtype=np.float64)
        bad = ~(np.isfinite(t) & (t > 0))
        n = int(np.count_nonzero(bad))
        if n and shown is None:
            shown = float(t[bad][0])
        count += n
    check_temperature_values_count(count, shown)


def check_target_range(target, vocab_size: int, ignore_index: int, *, processes=None) -> None:
    """Raise ``ValueError`` if a concrete ``target`` holds ids outside ``[0, V)``.

    Does nothing for traced targets (under ``jit`` / ``grad`` / ``vmap`` /
    ``shard_map``); those rows come out NaN instead. Reads this process's
    part of the target back to the host (O(T) bytes, one synchronisation);
    with one JAX process that is the whole target.

    With several JAX processes (``jax.distributed``) and a target that spans
    more than one of them (or ``processes``, a tuple of process indices, given
    explicitly), it is a collective over those processes: each counts the bad
    ids in its addressable shards only, they agree
    (:func:`dualvp_jax.multiprocess.agree`), and every one of them raises the
    same ``ValueError`` or none does. Every process of the set must call it.
    """
    if _is_tracer(target):
        return
    procs = multiprocess.processes_of(target) if processes is None else tuple(processes)
    count, shown = multiprocess.count_bad_targets(target, vocab_size, ignore_index)
    if len(procs) > 1:
        multiprocess.agree(procs, "check_target_range", {"vocab_size": int(vocab_size),
                                                         "ignore_index": int(ignore_index)},
                           bad_targets=(count, shown, int(vocab_size), int(ignore_index)))
        return
    if count:
        raise ValueError(
            f"target: expected ids in [0, {vocab_size}) or ignore_index={ignore_index}, "
            f"got {count} out-of-range id(s), e.g. {shown}"
        )


def call_record(opt: Options, **arrays) -> dict:
    """What must agree across processes: the options and the global shapes and dtypes."""
    return {"options": dataclasses.asdict(opt), "arrays": multiprocess.describe_arrays(**arrays)}


def _check_varying(logits, axis_name) -> None:
    """Inside shard_map the logits shard must vary over ``axis_name`` (check_vma on).

    With ``check_vma=False`` JAX cannot tell a replicated output from a
    per-device one and hands each shard 1/W of the cotangent of a replicated
    output, so the gradient would silently come out W times too small.
    """
    mat = getattr(jax.typeof(logits), "manual_axis_type", None)
    varying = getattr(mat, "varying", None)
    if varying is None:  # no such type information in this JAX version
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = [a for a in names if a not in varying]
    if missing:
        raise ValueError(
            f"axis_name: expected logits that vary over mesh axis {axis_name!r} (this shard's vocab columns, "
            f"inside jax.shard_map with check_vma=True), got logits varying over {sorted(varying)}; "
            "with check_vma=False the gradients of the replicated outputs would be scaled by 1/W"
        )


# --- the op -------------------------------------------------------------------

def _shard_stats(logits, local, owns, keep, tau, cdt, with_entropy: bool, tuning: Tuning):
    """``spec.block_stats`` of the whole shard: ``[..., N_STATS]`` in ``cdt``.

    On the CPU (``tuning.path`` ``"auto"`` or ``"chunked"``) the rows are
    processed in bounded chunks (:mod:`dualvp_jax.chunks`): XLA:CPU would
    otherwise materialise a float32 ``[..., V_local]`` input for each row
    reduction; chunked, the forward's scratch is a few
    ``tuning.chunk_bytes`` whatever the row count. Rows wider than
    ``tuning.column_block`` are reduced in column blocks (``start=`` of
    ``spec.block_stats``) merged with ``spec.reduce_stats``, which XLA:CPU
    runs on all cores. With a keep mask every block takes one pass
    (``kept_shift="max"``), and if any row of the shard is marked
    (``spec.marked_rows``: its kept sum underflowed, or a NaN), the loop runs
    once more with ``"kept"`` under one ``lax.cond`` and only the marked rows
    take its statistics; a top-k / top-p mask keeps every column above a kept
    one, so it never marks a row (docs/decisions.md, "dualvp_jax: kept
    shift by the max, one redo per shard"). On other platforms XLA fuses the
    elementwise work into its reductions itself and a loop of small chunks
    would only add steps: the whole shard is one call there, with ``"kept"``.
    """
    def whole(z, local, owns, keep, start=0, kept_shift="kept"):
        return spec.block_stats(jnp, z, local, owns, keep, tau, start=start, dtype=cdt, with_entropy=with_entropy,
                                kept_shift=kept_shift, entropy_terms=ENTROPY_TERMS)

    def blocked(z, local, owns, keep, kept_shift):
        # Rows wider than the column block are reduced in column blocks, which merge like shards.
        bounds = chunks.column_blocks(z.shape[-1], tuning.column_block)
        parts = [whole(z[..., a:b], local, owns, None if keep is None else keep[..., a:b], start=a,
                       kept_shift=kept_shift) for a, b in bounds]
        return parts[0] if len(parts) == 1 else spec.reduce_stats(jnp, jnp.stack(parts), axis=0, temperature=tau)

    def run(args, kept_shift):
        rows = chunks.chunk_rows(args[0].shape[-1], budget=tuning.chunk_bytes)
        return chunks.map_row_chunks(partial(blocked, kept_shift=kept_shift), args, rows)

    def chunked(z, local, owns, keep):
        n, v = math.prod(z.shape[:-1]), z.shape[-1]
        args = (z.reshape(n, v), local.reshape(n), owns.reshape(n), None if keep is None else keep.reshape(n, v))
        out = chunks.stats_with_redo(run, args, keep is not None)
        return out.reshape(z.shape[:-1] + out.shape[-1:])

    if tuning.path == "auto":
        return lax.platform_dependent(logits, local, owns, keep, cpu=chunked, default=whole)
    return {"whole": whole, "chunked": chunked}[tuning.path](logits, local, owns, keep)


def _kept_columns(ids, target, axis_name, opt: Options, v_local: int):
    """``spec.kept_columns`` of this shard: ``(cols, use)``, ``[..., K+1]``."""
    return spec.kept_columns(jnp, ids, target, shard_index(axis_name)[0], v_local, opt.ignore_index)


def _kept_pair(zk, use, tau):
    """``spec.kept_pair`` of ``[..., K+1]`` gathered logits, reduced in a fixed tree (``tree=True``).

    XLA:CPU reduces a narrow ``[T, K+1]`` along a path that depends on ``T``
    (a row of a 257-row call differed from the same row alone); the tree of
    elementwise ops gives a row the same bits whatever ``T`` (batch invariance).
    """
    return spec.kept_pair(jnp, zk, use, tau, tree=True)


def _forward(logits, target, keep, axis_name, opt: Options, tuning: Tuning):
    cdt = compute_dtype(logits.dtype)
    tau = opt.temperature
    valid, owns, local, bad = shard_position(axis_name, opt, target, logits.shape[-1])
    if opt.has_ids:
        # keep holds keep_ids: the unmasked statistics of the shard, then the
        # kept pair from the K + 1 logits gathered at the kept columns; no
        # [..., V_local] mask exists.
        stats = _shard_stats(logits, local, owns, None, tau, cdt, opt.with_entropy, tuning)
        cols, use = _kept_columns(keep, target, axis_name, opt, logits.shape[-1])
        zk = spec.gather_columns(jnp, logits, cols, use, dtype=cdt)
        stats = spec.with_kept_pair(jnp, stats, *_kept_pair(zk, use, tau))
    else:
        stats = _shard_stats(logits, local, owns, keep, tau, cdt, opt.with_entropy, tuning)
    comb = spec.finalize(jnp, spec.reduce_stats(jnp, gather_stats(axis_name, stats), axis=0, temperature=tau), tau)
    logprob, entropy = spec.outputs(jnp, comb, valid, tau)
    nan = jnp.full_like(logprob, jnp.nan)
    logprob = jnp.where(bad, nan, logprob)
    entropy = jnp.where(bad, nan, entropy)
    return (logprob, entropy), comb


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _op(logits, target, keep, axis_name, opt: Options, tuning: Tuning):
    return _forward(logits, target, keep, axis_name, opt, tuning)[0]


def _op_fwd(logits, target, keep, axis_name, opt: Options, tuning: Tuning):
    out, comb = _forward(logits, target, keep, axis_name, opt, tuning)
    # Residuals: references to the inputs plus O(T) statistics.
    return out, (logits, target, keep, comb)


def _op_bwd(axis_name, opt: Options, tuning: Tuning, res, cotangents):
    logits, target, keep, comb = res
    g_logprob, g_entropy = cotangents
    cdt = compute_dtype(logits.dtype)
    valid, owns, local, bad = shard_position(axis_name, opt, target, logits.shape[-1])
    g_logprob = jnp.asarray(g_logprob, cdt)
    g_entropy = jnp.asarray(g_entropy, cdt) if opt.need_entropy_grad else None
    if opt.has_ids:
        # The unmasked gradient without its q term, cast to the logits' dtype
        # (fused into the dense pass), then the kept columns' values, from the
        # K + 1 gathered logits, written over it (an O(T K) scatter in place).
        g = spec.block_grad_base(jnp, logits, local, owns, comb, valid, g_logprob, g_entropy, opt.temperature,
                                 dtype=cdt, indicator=INDICATOR)
        cols, use = _kept_columns(keep, target, axis_name, opt, logits.shape[-1])
        zk = spec.gather_columns(jnp, logits, cols, use, dtype=cdt)
        vals = spec.kept_grad(jnp, zk, cols, use, local, owns, comb, valid, g_logprob, g_entropy, opt.temperature)
        g = jnp.where(bad[..., None], jnp.full_like(g, jnp.nan), g).astype(logits.dtype)
        vals = jnp.where(bad[..., None], jnp.full_like(vals, jnp.nan), vals)
        return spec.set_at_columns(jnp, g, cols, vals, use), None, None
    g = spec.block_grad(jnp, logits, local, owns, keep, comb, valid, g_logprob, g_entropy, opt.temperature,
                        dtype=cdt, indicator=INDICATOR)
    g = jnp.where(bad[..., None], jnp.full_like(g, jnp.nan), g)
    return g.astype(logits.dtype), None, None


_op.defvjp(_op_fwd, _op_bwd)


def logprob_entropy(
    logits,
    target,
    *,
    axis_name=None,
    keep_mask=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    validate: bool = True,
    keep_ids=None,
    multi_target: bool = False,
    with_sum_p2: bool = False,
):
    """Log-prob of ``target`` and entropy, from this shard's logits.

    Call it inside ``jax.shard_map`` on the per-shard logits with the vocab
    split over the mesh axis ``axis_name`` (shard ``r = lax.axis_index``
    holds global columns ``[r*V_local, (r+1)*V_local)``), or outside any
    ``shard_map`` with ``axis_name=None`` on full logits.

    Args:
      logits: ``[..., V_local]`` float32 / bfloat16 / float16 / float64.
      target: ``[...]`` integer *global* token ids in ``[0, W*V_local)`` or
        ``ignore_index``. Same on every shard of ``axis_name``.
      axis_name: the mesh axis (or tuple of axes) that splits the vocabulary;
        ``None``: unsharded.
      keep_mask: ``None`` or ``[..., V_local]`` bool (top-p / top-k replay);
        the log-prob is under the distribution renormalised over
        ``keep_mask`` plus the target. The entropy ignores it.
      keep_ids: ``None`` or ``[..., K]`` integer *global* token ids (the
        same on every shard; padding -1): the kept set as ids, the
        alternative to ``keep_mask`` with its semantics (never both). Each
        shard uses the ids in its columns; a repeated id counts once; no
        ``[..., V_local]`` mask is built (O(T K) memory and work beyond the
        unmasked op). With ``validate=True`` concrete ids outside ``[0, V)``
        other than -1 raise ``ValueError``; otherwise (or traced) they lie
        in no shard and are ignored. (Without ``jax_enable_x64`` JAX holds
        integers as int32: ids beyond its range wrap when converted.)
        Not yet with ``multi_target``, ``with_sum_p2`` or a temperature
        array (``NotImplementedError``; pass ``keep_mask`` there).
      temperature: finite float > 0, a Python number (static); or an array
        broadcastable to the rows ``[...]`` (one temperature per row, an
        input of the program: changing it never recompiles), treated as a
        constant (no gradient flows to it); rows whose temperature is not a
        finite number > 0 give NaN (``validate=True`` raises for a concrete
        array). Logits are divided by it inside the op.
      multi_target: ``True``: ``target`` is ``[..., K]`` (K >= 1 ids per row)
        and the log-prob ``[..., K]``, one collective round whatever K; each
        target is kept for its own log-prob under ``keep_mask`` (target k's
        distribution is renormalised over ``keep_mask`` plus ``y_k``); the
        gradient is that of the sum of the K log-probs (weighted by their
        cotangents) plus the entropy's.
      with_sum_p2: ``True``: also return ``sum_v p_v^2`` (``[...]``, same
        collective round), differentiable (``2 p_v (p_v - S) / tau``).
      with_entropy: ``False``: the entropy output is ``None``.
      entropy_grad: ``False``: the entropy is returned under
        ``lax.stop_gradient`` and contributes no gradient.
      ignore_index: rows whose target equals it get log-prob 0 and no
        log-prob gradient.
      validate: ``True``: a concrete target is range-checked (one host
        synchronisation); with ``axis_name=None`` and arrays spanning
        several JAX processes, the processes also agree on the options and
        shapes (:mod:`dualvp_jax.multiprocess`). ``False``: no check and no
        synchronisation; out-of-range ids give NaN rows. Inside a
        ``shard_map`` (``axis_name`` given) the processes do not agree: use
        :func:`dualvp_jax.sharded_logprob_entropy` for that.

    Returns:
      ``(logprob, entropy)``, each ``[...]`` float32 (float64 for float64
      input under ``jax_enable_x64``), invariant over ``axis_name``;
      ``entropy`` is ``None`` when ``with_entropy=False``; ``logprob`` is
      ``[..., K]`` with ``multi_target``; with ``with_sum_p2`` a third
      output ``sum_p2 [...]``.

    Raises:
      TypeError / ValueError naming the argument for bad shapes, dtypes or
      options (at trace time), and ``ValueError`` for out-of-range targets
      when ``target`` is concrete, ``axis_name`` is ``None`` and
      ``validate`` is on. Traced out-of-range targets give NaN rows.
      ``RuntimeError`` on every process when processes disagree.
    """
    return _logprob_entropy(logits, target, axis_name, keep_mask, temperature, with_entropy, entropy_grad,
                            ignore_index, DEFAULT, validate=validate, multi_target=multi_target,
                            with_sum_p2=with_sum_p2, keep_ids=keep_ids)


def _logprob_entropy(logits, target, axis_name, keep_mask, temperature, with_entropy, entropy_grad, ignore_index,
                     tuning: Tuning, validate: bool = True, multi_target: bool = False, with_sum_p2: bool = False,
                     keep_ids=None):
    """:func:`logprob_entropy` with an explicit :class:`~dualvp_jax._tuning.Tuning` (tests reach other paths)."""
    multiprocess.check_flag(validate)

    def checks():
        opt = validated_options(logits, target, keep_mask, temperature, ignore_index, with_entropy, entropy_grad,
                        multi_target, with_sum_p2, keep_ids)
        vocab = int(np.shape(logits)[-1]) if not _is_tracer(logits) else int(logits.shape[-1])
        if validate and axis_name is None:
            check_ids_range(keep_ids, vocab)
        if validate:
            check_temperature_values(temperature)
        return opt, vocab

    procs = (multiprocess.processes_of(logits, target, keep_mask, keep_ids, temperature)
             if validate and axis_name is None else ())
    if len(procs) > 1:
        opt = multiprocess.checked(procs, "logprob_entropy", checks, target, ignore_index,
                                   lambda opt: call_record(opt, logits=logits, target=target, keep_mask=keep_mask,
                                                       keep_ids=keep_ids))
    else:
        opt, vocab = checks()
        if validate and axis_name is None:
            check_target_range(target, vocab, ignore_index, processes=procs)
    if axis_name is not None:
        _check_varying(logits, axis_name)
    if extended.uses_extended(opt):
        # check_args refuses keep_ids with the extended options: keep_mask is the mask here
        lp, h, p2 = _ext_apply_jit(logits, target, keep_mask, temperature if opt.row_temperature else None,
                                   axis_name=axis_name, opt=opt, tuning=tuning)
        return (lp, h, p2) if opt.with_sum_p2 else (lp, h)
    # One "keep" argument: the mask, or the ids (opt.has_ids says which).
    keep = keep_ids if opt.has_ids else keep_mask
    return _apply_jit(logits, target, keep, axis_name=axis_name, opt=opt, tuning=tuning)


def apply_op(logits, target, keep_mask, axis_name, opt: Options, tuning: Tuning = DEFAULT):
    """The op on validated arguments (called per shard); ``keep_mask`` holds the ids when ``opt.has_ids``."""
    logits = jnp.asarray(logits)
    target = jnp.asarray(target).astype(int_dtype())
    keep = None if keep_mask is None else jnp.asarray(keep_mask)
    if opt.has_ids:
        keep = keep.astype(target.dtype)
    return op_outputs(*_op(logits, target, keep, axis_name, opt, tuning), opt)


def op_outputs(logprob: jax.Array, entropy: jax.Array, opt: Options) -> tuple[jax.Array, Optional[jax.Array]]:
    """The op's ``(logprob [...], entropy [...])`` as returned to the caller.

    ``entropy`` is ``None`` without ``with_entropy`` and under
    ``lax.stop_gradient`` without ``entropy_grad``.
    """
    if not opt.with_entropy:
        return logprob, None
    if not opt.entropy_grad:
        entropy = lax.stop_gradient(entropy)
    return logprob, entropy


# Eager calls run as one compiled program instead of op-by-op dispatch; under an
# outer jit (or inside shard_map) this is simply inlined.
_apply_jit = jax.jit(apply_op, static_argnames=("axis_name", "opt", "tuning"))

_ext_apply_jit = jax.jit(extended.ext_apply, static_argnames=("axis_name", "opt", "tuning"))
