"""The fused LM-head op's blocks and its ``custom_vjp`` (called by :mod:`dualvp_jax.linear`).

The logits ``z = h W_r^T`` of this shard are never materialised at
``[T, V_local]``; they are made one block ``[token_block, vocab_block]`` at a
time, and everything else is the math of :mod:`dualvp.spec`, block by block::

    forward, per token chunk, over vocab blocks (nested lax.fori_loop):
        stats  = spec.reduce_stats(spec.block_stats(z_block) ...)    [T, 6]  O(T)
    table = all_gather(stats, axis_name, to="invarying")          the only collective
    comb  = spec.finalize(spec.reduce_stats(table)); spec.outputs(comb)

    backward, per vocab block j (outer), per token chunk i (inner):
        z_ij = h_i W_j^T (recomputed)      G_ij = spec.block_grad(z_ij)   float32
        dh_i += G_ij W_j                    dW_j += G_ij^T h_i            float32
    dh: psum over axis_name (reduce_hidden_grad=True, in float32), or the
        partial sum (False), or psum_scatter (sequence_parallel=True).

With ``keep_ids`` (the kept set as ``[T, K]`` global ids) the blocks'
statistics are unmasked; the logits at the kept columns are gathered block by
block into ``zk [T, K+1]`` for the kept pair (``spec.kept_pair``), and each
backward tile writes ``spec.kept_grad`` at the kept columns it holds over
``spec.block_grad_base`` (``spec.set_at_columns``): O(T K) more, no mask.

Residuals for the backward: the inputs (references) and the O(T) combined
statistics. The loop order is vocabulary-major in the backward, so the
float32 accumulators are ``dh [T, H]`` (needed whole anyway for the float32
reduce over ``axis_name``) and one ``dW_j [vocab_block, H]``; ``dW`` is
written block by block into its output buffer.

Frozen weight or frozen hidden (``jax.grad`` w.r.t. one of them, under
``jit``): the backward's unused accumulator is dead code, and XLA drops its
GEMM (and, for a frozen hidden, the ``psum`` of ``dh``); the compiled HLO then
has no ``dW`` (resp. ``dh``) dot, pinned by
``tests/jax/test_linear.py::test_frozen_input_skips_its_gemm``.

Blocks that do not divide the sizes: the last token chunk and the last
vocabulary block are a separate, smaller block of static shape (never a
padded or overlapping one), so no padded column or row ever enters a sum.

Precision: logits blocks are float32 (float64 for float64 inputs) from
``lax.dot_general(..., preferred_element_type=float32, precision=HIGHEST)``,
also for bfloat16 operands; the gradient blocks ``G`` are float32 and the
backward GEMMs take float32 ``G`` against the (exactly up-cast) bfloat16
operands; ``dh`` and ``dW`` accumulate in float32 and are cast to the inputs'
dtypes once, at the end (``dW`` block by block: each ``dW_j`` is complete).

Memory: the scratch of forward + backward beyond the arguments and the
returned gradients is a small multiple of one float32 block (the block, its
gradient and XLA's fused temporaries) plus, for 16-bit inputs, the float32
``dh`` accumulator (``T * H * 4``; for float32 it is the returned gradient
itself), pinned by ``tests/jax/test_linear.py``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from dualvp import spec
from dualvp.validation import Options

from ._tuning import INDICATOR
from .function import op_outputs
from .shards import compute_dtype, gather_stats, int_dtype, shard_index, shard_position

__all__ = ["DEFAULT_MEMORY_BUDGET", "plan"]

#: Default bytes of one float32 logits block ``[token_block, vocab_block]``.
#: The op's scratch is a small multiple of it (the block, its gradient and
#: XLA's fused temporaries) plus the float32 ``[T, H]`` accumulator of ``dh``.
DEFAULT_MEMORY_BUDGET = 2 * 2**20
#: Default longest token chunk (rows of one block).
_DEFAULT_TOKEN_BLOCK = 4096
#: Vocabulary blocks are a multiple of this many columns (unless V_local is smaller).
_VOCAB_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one call (hashable, a ``jit`` static argument).

    The shared :class:`~dualvp.validation.Options` (the same object the torch
    op carries and the agreement record is made from) plus the JAX block sizes.
    """

    opt: Options
    token_block: int
    vocab_block: int


def axis_world(axis_name) -> int:
    if axis_name is None:
        return 1
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"axis_name: expected a mesh axis bound by an enclosing jax.shard_map (or None), got {axis_name!r}"
        ) from None


def plan(n_rows: int, v_local: int, token_block, vocab_block, memory_budget) -> tuple:
    """``(token_block, vocab_block)``: explicit sizes, else from the memory budget.

    ``token_block`` defaults to ``min(T, 4096)``; ``vocab_block`` to the
    largest multiple of 128 columns whose float32 block ``[token_block,
    vocab_block]`` fits ``memory_budget`` bytes (at least 128), both capped
    by the actual sizes.
    """
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    tc = int(token_block) if token_block is not None else _DEFAULT_TOKEN_BLOCK
    tc = max(1, min(tc, n_rows))
    if vocab_block is not None:
        bv = int(vocab_block)
    else:
        bv = max(_VOCAB_ALIGN, (budget // (4 * tc)) // _VOCAB_ALIGN * _VOCAB_ALIGN)
    return tc, max(1, min(bv, v_local))


# --- the blocks ---------------------------------------------------------------


def _dot(a, b, contract, cdt):
    # float32 (float64) result from any operand dtype; HIGHEST so that an
    # accelerator does not drop float32 operands to bf16/tf32 passes.
    return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=cdt)


def _logits(h, w, cdt):
    """``h [n, H] @ w [m, H]^T`` -> ``[n, m]`` in the compute dtype."""
    return _dot(h, w, ((1,), (1,)), cdt)


def _vary(x, axis_name, *like):
    """``x`` cast to vary over ``axis_name`` and every axis the arrays ``like`` vary over.

    Fresh constants (loop-carry inits) are invariant; the carried values vary
    like the operands (over the vocab axis like the weight, and over a
    data-parallel axis like rows split there), and a loop carry must keep its
    type.
    """
    axes = set(_names(axis_name))
    for a in like:
        axes |= _varying(a)
    return lax.pcast(x, tuple(sorted(axes, key=str)), to="varying") if axes else x


def _names(axis_name) -> tuple:
    if axis_name is None:
        return ()
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _slice(x, start, size, axis=0):
    if x is None:
        return None
    if isinstance(start, int):
        return lax.slice_in_dim(x, start, start + size, axis=axis)
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _over_blocks(n: int, size: int, step, carry, operands=(), lo: int = 0):
    """``carry = step(carry, operands, start, size)`` over the blocks ``[start, start+size)`` of ``range(n)``.

    The full blocks from number ``lo`` on run in a ``lax.fori_loop``
    (``start`` traced); the last, smaller block, if any, runs once with a
    static ``start`` and its own static size, so no padded element ever
    exists.

    ``operands`` (hidden, weight) are sliced by ``step``. They travel in the
    loop carry through an optimisation barrier, so that XLA sees them as
    loop-variant: otherwise a backend that up-casts bf16 GEMM operands
    (XLA:CPU) hoists the cast out of the loop as one float32 copy of the
    whole weight (``V_local * H * 4`` bytes). Carried unchanged, they cost
    no copy.
    """
    nfull, rem = divmod(n, size)
    if nfull - lo == 1:
        carry = step(carry, operands, lo * size, size)
    elif nfull - lo > 1:
        def body(j, c):
            acc, ops = c
            # One barrier per operand: a joint one would merge their varying axes.
            ops = tuple(lax.optimization_barrier(o) for o in ops)
            return step(acc, ops, j * size, size), ops

        carry, _ = lax.fori_loop(lo, nfull, body, (carry, operands))
    if rem:
        carry = step(carry, operands, nfull * size, rem)
    return carry


def _row_stats(h, w, keep, local, owns, cfg: Config, cdt, kept=None):
    """``[n, N_STATS]`` statistics of the rows ``h [n, H]`` over all columns of ``w [V_local, H]``.

    ``spec.block_stats`` needs a static ``start`` (it builds the block's
    column ids with ``arange``); inside the loop the target's column is made
    block-relative instead (``local - start``, with ``start=0``), which is the
    same test ``column == local``.

    With ``keep_ids`` (``kept = (cols, use)``, ``[n, K+1]`` from
    ``spec.kept_columns``; ``keep`` is ``None``) the blocks' statistics are
    unmasked and each block's logits at the kept columns it holds are
    gathered into ``zk [n, K+1]`` (carried through the loop); the kept pair
    comes from ``zk`` at the end.
    """
    tau = cfg.opt.temperature

    def stats(w, j0, size):
        z = _logits(h, _slice(w, j0, size), cdt)
        k = _slice(keep, j0, size, 1)
        if isinstance(j0, int):
            return z, spec.block_stats(jnp, z, local, owns, k, tau, start=j0, dtype=cdt)
        return z, spec.block_stats(jnp, z, local - j0, owns, k, tau, start=0, dtype=cdt)

    def gather(z, j0, size, zk):
        if kept is None:
            return zk
        c, u = spec.columns_in_block(jnp, kept[0], kept[1], j0, size)
        return spec.gather_columns(jnp, z, c, u, zk, dtype=cdt)

    def step(acc, ops, j0, size):
        st, zk = acc
        z, sj = stats(ops[0], j0, size)
        return spec.merge_stats(jnp, st, sj, tau), gather(z, j0, size, zk)

    size = min(cfg.vocab_block, w.shape[0])
    z, first = stats(w, 0, size)
    out, zk = _over_blocks(w.shape[0], cfg.vocab_block, step, (first, gather(z, 0, size, None)), (w,), lo=1)
    if kept is None:
        return out
    return spec.with_kept_pair(jnp, out, *spec.kept_pair(jnp, zk, kept[1], tau))


def _all_stats(h, w, keep, local, owns, cfg: Config, cdt, axis_name, kept=None):
    """``[T, N_STATS]`` statistics of every row, token chunk by token chunk."""
    T = h.shape[0]
    out = _vary(jnp.zeros((T, spec.N_STATS), cdt), axis_name, h, w)
    if T == 0:
        return out

    def step(out, ops, i0, n):
        h, w = ops
        kr = None if kept is None else tuple(_slice(a, i0, n) for a in kept)
        st = _row_stats(_slice(h, i0, n), w, _slice(keep, i0, n), _slice(local, i0, n), _slice(owns, i0, n),
                        cfg, cdt, kr)
        return lax.dynamic_update_slice_in_dim(out, st, i0, axis=0)

    return _over_blocks(T, cfg.token_block, step, out, (h, w))


# --- the op -------------------------------------------------------------------


def _gather_hidden(h, axis_name, cfg: Config):
    if not cfg.opt.sequence_parallel:
        return h
    # Sequence parallel: this shard's T/W rows -> all T rows, identical everywhere.
    return lax.all_gather(h, axis_name, axis=0, tiled=True, to="invarying")


def _flat(h, target, keep):
    """``[T, H]``, ``[T]``, ``[T, V_local]`` views of the (gathered) inputs."""
    H = h.shape[-1]
    h2 = h.reshape(-1, H)
    y = target.reshape(-1)
    k = None if keep is None else keep.reshape(y.shape[0], keep.shape[-1])
    return h2, y, k


def _kept(k, y, axis_name, cfg: Config, v_local: int):
    """``(mask, kept)``: with ``keep_ids`` (``k`` holds them) ``(None, spec.kept_columns(...))``, else ``(k, None)``."""
    if not cfg.opt.has_ids:
        return k, None
    return None, spec.kept_columns(jnp, k, y, shard_index(axis_name)[0], v_local, cfg.opt.ignore_index)


def _forward(hidden, weight, target, keep, axis_name, cfg: Config):
    opt = cfg.opt
    cdt = compute_dtype(hidden.dtype)
    tau = opt.temperature
    h2, y, k = _flat(_gather_hidden(hidden, axis_name, cfg), target, keep)
    valid, owns, local, bad = shard_position(axis_name, opt, y, weight.shape[0])
    k, kept = _kept(k, y, axis_name, cfg, weight.shape[0])
    stats = _all_stats(h2, weight, k, local, owns, cfg, cdt, axis_name, kept)
    comb = spec.finalize(jnp, spec.reduce_stats(jnp, gather_stats(axis_name, stats), axis=0, temperature=tau), tau)
    logprob, entropy = spec.outputs(jnp, comb, valid, tau)
    nan = jnp.full_like(logprob, jnp.nan)
    logprob = jnp.where(bad, nan, logprob).reshape(target.shape)
    entropy = jnp.where(bad, nan, entropy).reshape(target.shape)
    return (logprob, entropy), comb


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _op(hidden, weight, target, keep, axis_name, cfg: Config):
    return _forward(hidden, weight, target, keep, axis_name, cfg)[0]


def _op_fwd(hidden, weight, target, keep, axis_name, cfg: Config):
    out, comb = _forward(hidden, weight, target, keep, axis_name, cfg)
    # Residuals: references to the inputs (this shard's rows of hidden under
    # sequence parallelism: gathered again in the backward) and O(T) statistics.
    return out, (hidden, weight, target, keep, comb)


def _op_bwd(axis_name, cfg: Config, res, cotangents):
    hidden, weight, target, keep, comb = res
    opt = cfg.opt
    tau = opt.temperature
    cdt = compute_dtype(hidden.dtype)
    h2, y, k = _flat(_gather_hidden(hidden, axis_name, cfg), target, keep)
    T, H = h2.shape
    valid, owns, local, bad = shard_position(axis_name, opt, y, weight.shape[0])
    k, kept = _kept(k, y, axis_name, cfg, weight.shape[0])
    gl = jnp.asarray(cotangents[0], cdt).reshape(-1)
    ge = jnp.asarray(cotangents[1], cdt).reshape(-1) if opt.need_entropy_grad else None

    def tile(carry, ops, i0, n, j0, size, wj):
        # One [n, size] tile: recompute z; G in float32; both GEMMs take the
        # float32 G against exactly up-cast operands and accumulate in float32.
        dh, dwj = carry
        hi = _slice(ops[0], i0, n).astype(cdt)
        rows = lambda a: _slice(a, i0, n)  # noqa: E731
        z = _logits(hi, wj, cdt)
        kij = None if k is None else _slice(rows(k), j0, size, 1)
        if isinstance(j0, int):
            loc, start = rows(local), j0
        else:
            loc, start = rows(local) - j0, 0
        cb = spec.Combined(*(rows(f) for f in comb))
        if kept is None:
            g = spec.block_grad(jnp, z, loc, rows(owns), kij, cb, rows(valid), rows(gl),
                                None if ge is None else rows(ge), tau, start=start, dtype=cdt, indicator=INDICATOR)
        else:
            # keep_ids: the gradient without its q term, with the kept columns of this tile written over it.
            ge_rows = None if ge is None else rows(ge)
            g = spec.block_grad_base(jnp, z, loc, rows(owns), cb, rows(valid), rows(gl), ge_rows, tau, start=start,
                                     dtype=cdt, indicator=INDICATOR)
            c, u = spec.columns_in_block(jnp, rows(kept[0]), rows(kept[1]), j0, size)
            vals = spec.kept_grad(jnp, spec.gather_columns(jnp, z, c, u, dtype=cdt), rows(kept[0]), u, rows(local),
                                  rows(owns), cb, rows(valid), rows(gl), ge_rows, tau)
            g = spec.set_at_columns(jnp, g, c, vals, u)
        g = jnp.where(rows(bad)[:, None], jnp.full_like(g, jnp.nan), g)
        dh = lax.dynamic_update_slice_in_dim(dh, rows(dh) + _dot(g, wj, ((1,), (0,)), cdt), i0, axis=0)
        return dh, dwj + _dot(g, hi, ((0,), (0,)), cdt)

    def vocab_block(carry, ops, j0, size):
        dh, dw = carry
        h2, w = ops
        wj = _slice(w, j0, size).astype(cdt)
        dwj = _vary(jnp.zeros((size, H), cdt), axis_name, h2, w)
        dh, dwj = _over_blocks(T, cfg.token_block, lambda c, o, i0, n: tile(c, o, i0, n, j0, size, wj),
                               (dh, dwj), (h2,))
        # dW_j is complete (all tokens): written once, in the weight's dtype.
        return dh, lax.dynamic_update_slice_in_dim(dw, dwj.astype(weight.dtype), j0, axis=0)

    dh = _vary(jnp.zeros((T, H), cdt), axis_name, h2, weight)
    dw = _vary(jnp.zeros(weight.shape, weight.dtype), axis_name, h2, weight)
    if T:
        dh, dw = _over_blocks(weight.shape[0], cfg.vocab_block, vocab_block, (dh, dw), (h2, weight))
    if axis_name is not None:
        if cfg.opt.sequence_parallel:
            full = (hidden.shape[0] * axis_world(axis_name),) + hidden.shape[1:]
            dh = lax.psum_scatter(dh.reshape(full), axis_name, scatter_dimension=0, tiled=True)
        elif cfg.opt.reduce_hidden_grad:
            dh = lax.psum(dh, axis_name)  # in float32: the partial sums of every shard
    # Rows that vary over more axes than the weight (tokens split over a
    # data-parallel axis, the weight replicated there): each shard's dW covers
    # only its rows, and the cotangent of the replicated weight is their sum
    # (taken in the compute dtype: one rounding to a 16-bit weight dtype after it).
    extra = _varying(dw) - _varying(weight)
    if extra:
        dw = lax.psum(dw.astype(cdt), tuple(sorted(extra, key=str))).astype(weight.dtype)
    dh = dh.reshape(hidden.shape).astype(hidden.dtype)
    return dh, dw, None, None


def _varying(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (inside ``shard_map`` with check_vma); empty outside."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", None) or ())


_op.defvjp(_op_fwd, _op_bwd)


def _apply(hidden, weight, target, keep_mask, axis_name, cfg: Config):
    """The op on validated arguments (per shard); ``keep_mask`` holds the ids when ``cfg.opt.has_ids``."""
    hidden = jnp.asarray(hidden)
    weight = jnp.asarray(weight)
    target = jnp.asarray(target).astype(int_dtype())
    keep = None if keep_mask is None else jnp.asarray(keep_mask)
    if cfg.opt.has_ids:
        keep = keep.astype(target.dtype)
    return op_outputs(*_op(hidden, weight, target, keep, axis_name, cfg), cfg.opt)


apply_jit = jax.jit(_apply, static_argnames=("axis_name", "cfg"))
