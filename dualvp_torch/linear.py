"""The fused LM-head op: log-prob and entropy from hidden states and the vocab-parallel weight.

``linear_logprob_entropy(hidden, weight, target, ...)`` computes what
``logprob_entropy(hidden @ weight.T, target, ...)`` computes, without ever
holding the ``[T, V_local]`` logits (or their gradient). The math is
:mod:`dualvp.spec` over vocabulary blocks of ``z = h W^T`` (see its module
docstring); this module only chooses the tiles, runs the two matmuls per tile
and the spec stages of :mod:`dualvp_torch.engines` on each tile.

Data flow of one call (``group`` with ``W`` ranks; ``T`` rows, this rank's
``V_local`` weight rows, hidden size ``H``)::

    validate=True:  local checks -> agreement all-gather ([W, 16] int64) -> 1 host sync
    forward:        (sequence_parallel: all-gather hidden [T/W, H] -> [T, H])
                    per tile (rows i, columns j): z = h_i W_j^T (float32 [tc, vc])
                        -> engines.block_stats(start=j0) -> [tc, 6]
                    spec.reduce_stats over the blocks -> [T, 6]
                    collectives.gather_stats -> [W, T, 6]      (1 all-gather, as the logits op)
                    spec.reduce_stats, spec.finalize, spec.outputs
    backward:       (sequence_parallel: all-gather hidden again)
                    per tile: z = h_i W_j^T recomputed, engines.block_grad_ writes G over z (float32),
                        dh_i += G W_j,  dW_j += G^T h_i        (float32 accumulators)
                    dh: all-reduce (reduce_hidden_grad) or reduce-scatter (sequence_parallel), float32

The collectives depend only on the options that enter the agreement record
(``sequence_parallel``, ``reduce_hidden_grad``, whether hidden and weight
require grad), never on the tiling, the mask, the temperature or the entropy
flags.

Tiles and memory
----------------
``B`` = ``T * V_local * itemsize`` (the logits shard the unfused path would
hold in the caller's dtype). One tile is a float32 block ``[tc, vc]``; its
bytes (4 per element, plus :data:`dualvp_torch.engines.BLOCK_SCRATCH_BYTES` per
element on the eager path, whose spec temporaries are tile-sized) stay within
``memory_budget``, default ``max(B / 16, 1 MiB)`` (``B / 4`` on CUDA). The loop order keeps the
float32 accumulator that must span the whole loop small:
``T <= V_local``: vocabulary blocks outside (each block's ``dW_j`` is complete
after its token chunks; ``dh`` accumulates in ``[T, H]``); otherwise token
chunks outside (``dh_i`` complete per chunk, ``dW`` accumulates in
``[V_local, H]``). Either way a row's ``dh`` adds its blocks' products in
vocabulary order.

Batch invariance (docs/decisions.md, "Fused op: batch invariance and G
rounding"): a row's log-prob, entropy and ``dh`` row are bitwise the same
alone and in any call, at a fixed weight, dtype and options; ``dW`` sums over
the rows and is exempt. What a row's values depend on is chosen without
``T``: the vocabulary blocks (:func:`~dualvp_torch.linear_tiles.tile_shape`:
the columns that :data:`MIN_SIDE` rows fit in a budget from ``V_local`` alone
by default, or in an explicit ``memory_budget``; at most ``MAX_COLS``); the
blocks' statistics merge one after another; token chunks are even
(``even_ranges``) and a call of fewer than :data:`MIN_ROWS` rows runs as
``MIN_ROWS`` (its rows repeated, upstream gradients 0): CPU GEMMs (MKL) of 1
to 3 rows take other paths than the same rows in a larger product, and
dynamo specialises one row. The token chunks' size follows ``T`` (a row's
values do not depend on it: MKL's product of 4 or more rows gives a row the
same bits wherever it sits, checked by tests/torch/test_linear_batch_invariance.py).
``impl="triton"``: its vocabulary splits come from ``V`` (``linear_triton.SPLIT_COLUMNS``
on CUDA), merged split after split in a kernel, and the backward's ``G``
chunks from ``V`` (an explicit ``memory_budget`` sizes them from ``T``). On
CUDA, cuBLAS's choice of kernel for the ``dh`` products (split-K) may depend
on ``T``: unchecked without a GPU.

Besides the tile the op holds (float32 input: nothing else, the accumulators
are the returned gradients; 16-bit: ``[T, H]`` float32 for ``dh``, a ``[vc,
H]`` float32 block of ``dW`` rounded once into the returned gradient, and on
the CPU float32 copies of the tile's operand rows). Between forward and
backward: the inputs by reference and O(T) statistics. A frozen input
(``requires_grad=False``) skips its matmul.

Precision: every logits block and every gradient block ``G`` is float32
(float64 for float64 input), and ``dh``/``dW`` accumulate in float32 across
tiles and ranks; each gradient is rounded once to the input dtype at the end.
16-bit inputs on CUDA: the blocks are ``torch.mm(..., out_dtype=float32)`` of
the 16-bit operands, and the backward products take ``G`` rounded once to the
input dtype, its rounding residual at the target's and at the (at most two)
other ``p_v > 1/3`` columns added back as rank-1 terms per row
(``tuning.Tuning.gradient_rounding`` ``"fixed"``, the default: 1.0x the credited
FLOP, ``dh``/``dW`` within 2x the error of the float64 result rounded once; the
option ``"split"`` takes a high and a low 16-bit part, two products each, 1.5x),
multiplied on tensor cores with float32 accumulation; no float32 copy of a
weight or hidden row is made.
``"fixed"`` adds the residual terms of ``dW`` in row order (:func:`_add_rows_`),
``dh``'s per row. On the CPU
(torch has no 16-bit matmul with float32 output there) the operands are
upcast to float32 (exact) and ``G`` multiplies them as it is. float32 inputs
multiply in IEEE float32 unless ``allow_tf32=True``.

``impl="triton"`` (:mod:`dualvp_torch.linear_triton`) replaces the tile loop by
two fused kernels, the statistics in the forward GEMM's epilogue and ``G``
formed in registers in the backward (``dualvp_torch/triton_kernels/linear_fwd.py``,
``linear_bwd.py``); the merge, the collectives and autograd are the same.

The op is a ``torch.library`` custom-op pair on :mod:`dualvp_torch.library`'s
fragment, registered as the logits op's (schema, one kernel for every device,
fake kernels, the forward's autograd kernel) and its only autograd path::

    dualvp::linear_logprob_entropy_fwd(hidden, weight, target, keep_mask, options..., keep_ids)
        -> logprob, entropy, res [5, T]   (the body runs the checks and, validate=True, the agreement)
    dualvp::linear_logprob_entropy_bwd(hidden, weight, target, keep_mask, res, grads, options...,
                                       need_dh, need_dw, keep_ids) -> dh, dW (a [0] tensor when not needed)

A call whose arguments have the schema's types goes to the op as is, eagerly
and as one node of a caller's ``torch.compile(fullgraph=True)`` graph; other
calls are checked first, then run the same op. The agreement record's
"hidden / weight require grad" are op arguments (the caller's grad mode and
flags, which the op's body no longer sees).

Non-finite values, row by row: a NaN/inf in hidden row ``t`` makes that row's
logits non-finite, so its log-prob, entropy and ``dh`` row are NaN (the other
rows are unaffected); ``dW`` sums over all rows, so every entry of it that
the row reaches is NaN, as in the unfused path and the oracle. A non-finite
weight row poisons every token's row.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Optional

import array_api_compat.torch as xp
import torch

from dualvp import spec, validation

from . import checks, collectives, engines, linear_triton, op_library, tuning
from . import keep_ids as _ids
from .stages import xp as _sxp  # with take_along_axis (the kept columns of keep_ids)
from .linear_tiles import (  # noqa: F401 (re-exported)
    BUDGET_FRACTION,
    CUDA_BUDGET_FRACTION,
    MIN_BUDGET,
    MIN_ROWS,
    MIN_SIDE,
    TileBuffer,
    column_budget,
    default_budget,
    even_ranges,
    pad_rows,
    ranges,
    tile_shape,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["linear_logprob_entropy", "tile_shape", "default_budget", "MIN_SIDE", "MIN_BUDGET", "BUDGET_FRACTION"]

def _ycol(local, owns, valid):
    # [T] int64 for the Triton kernels: the target's column where this shard owns it, -1 for a
    # valid row whose target lies elsewhere, -2 for an ignored row
    return torch.where(owns, local, torch.where(valid, -1, -2))


def _up(x: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    return x if x.dtype == cdt else x.to(cdt)


_OUT_DTYPE_MM: dict = {}


def _native_out_dtype(x: torch.Tensor, cdt: torch.dtype) -> bool:
    # CUDA: a 16-bit x 16-bit -> float32 matmul (float32 accumulation on
    # tensor cores) forms the blocks and the backward products without float32
    # copies of the operands; the CPU has none (torch has no CPU kernel of it).
    return x.dtype != cdt and x.device.type == "cuda" and _OUT_DTYPE_MM.get("cuda", True)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two 16-bit matrices, accumulated and returned in float32."""
    return torch.mm(a, b, out_dtype=torch.float32)


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (+)= a @ b`` (``first``: ``=``), 16-bit operands, float32 ``acc``."""
    if _OUT_DTYPE_MM.get("cuda", True):
        try:
            r = _mm_f32(a, b)
            acc.copy_(r) if first else acc.add_(r)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_MM["cuda"] = False  # this torch has none: upcast from now on
    if first:
        torch.mm(a.to(acc.dtype), b.to(acc.dtype), out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _g_parts(g: torch.Tensor, dtype: torch.dtype):
    """``G``'s parts in ``dtype``, one after the other: ``G_hi`` (``G`` rounded), then ``G_lo``.

    ``G_lo`` only with ``tuning.current().gradient_rounding == "split"`` (a high and a
    low part, ~16 significant bits; docs/decisions.md, "Fused LM-head: G split into hi + lo";
    ``"fixed"``: ``G_hi`` alone, the caller adds the rank-1 residual terms, :func:`_tile_fixes`).

    ``G_lo`` is ``G - G_hi`` (exact in float32) rounded, formed over ``g``
    itself: one 16-bit part is alive at a time next to the float32 tile.
    """
    hi = g.to(dtype)
    yield hi
    if tuning.current().gradient_rounding == "split":
        g.sub_(hi)
        del hi
        yield g.to(dtype)


def _fwd_operand(x: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``x`` as the forward matmul takes it: as is where the matmul outputs float32 natively, else upcast."""
    return x if _native_out_dtype(x, cdt) else _up(x, cdt)


def _logits_block(h_i: torch.Tensor, w_j: torch.Tensor, cdt: torch.dtype, out: Optional[torch.Tensor] = None):
    """``h_i W_j^T`` as a contiguous ``cdt`` (float32/float64) block, from operands of any float dtype.

    ``out``: a contiguous ``[rows, cols]`` ``cdt`` tensor to form it in (see :class:`TileBuffer`).
    """
    if h_i.dtype == w_j.dtype and _native_out_dtype(h_i, cdt):
        try:  # a float32-output matmul of the 16-bit operands (float32 accumulation)
            return _mm_f32(h_i, w_j.t())
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_MM["cuda"] = False  # this torch has none: upcast from now on
    if out is None:
        return torch.mm(_up(h_i, cdt), _up(w_j, cdt).t())
    return torch.mm(_up(h_i, cdt), _up(w_j, cdt).t(), out=out)


def _padded(pad, h2, target, valid, owns, local, keep, keep_ids):
    """The row-indexed inputs at the rows ``pad`` (:func:`~dualvp_torch.linear_tiles.pad_rows`), or as they are.

    ``h2 [T, H]``, ``target``/``valid``/``owns``/``local`` ``[T]``, ``keep
    [T, V]``, ``keep_ids [..., K]`` (any may be ``None``).
    """
    if pad is None:
        return h2, target, valid, owns, local, keep, keep_ids
    pad = pad.to(h2.device)
    n = h2.shape[0]
    ids = None if keep_ids is None else keep_ids.reshape(n, keep_ids.shape[-1])[pad]
    return tuple(None if x is None else x[pad] for x in (h2, target, valid, owns, local, keep)) + (ids,)


def _kept(keep_ids, target, rank: int, v_local: int, opt: validation.Options):
    """``spec.kept_columns`` ``(cols, use)`` ``[T, K+1]`` of ``keep_ids`` on this rank, or ``None`` without ids."""
    if keep_ids is None:
        return None
    y = target.reshape(-1).to(torch.int64)
    ids = keep_ids.reshape(y.shape[0], keep_ids.shape[-1]).to(torch.int64)
    return spec.kept_columns(_sxp, ids, y, rank, v_local, opt.ignore_index)


def _stats(h2, weight, local, owns, keep, tau, tiles, compiled: bool, kept=None):
    """``[T, 6]`` statistics of this rank's logits ``h2 weight^T``, tile by tile.

    ``kept``: ``(cols, use)`` ``[T, K+1]`` of ``keep_ids`` (``keep`` is then
    ``None``): each tile's logits at the kept columns it holds are gathered
    into ``zk [T, K+1]``, and the kept pair comes from ``zk`` at the end.
    """
    n, v = h2.shape[0], weight.shape[0]
    tc, vc = tiles
    cdt = tau.dtype
    buf = TileBuffer(min(tc, n), min(vc, v), cdt, h2.device)
    zk = None if kept is None else torch.zeros(kept[0].shape, dtype=cdt, device=h2.device)
    parts = []
    for i0, i1 in even_ranges(n, tc):
        h_i = _fwd_operand(h2[i0:i1], cdt)  # upcast once per token chunk, not once per tile
        run = None
        for j0, j1 in ranges(v, vc):
            z = _logits_block(h_i, weight[j0:j1], cdt, buf.take(i1 - i0, j1 - j0))
            kb = None if keep is None else keep[i0:i1, j0:j1]
            st = engines.block_stats(z, local[i0:i1], owns[i0:i1], kb, tau, start=j0, compiled=compiled)
            # merged block after block (not one reduction over the stacked blocks: ATen may split
            # that sum between threads by the chunk's row count, and a row's order would follow T)
            run = st if run is None else spec.merge_stats(xp, run, st, tau)
            if kept is not None:
                c, u = spec.columns_in_block(_sxp, kept[0][i0:i1], kept[1][i0:i1], j0, j1 - j0)
                zk[i0:i1] = spec.gather_columns(_sxp, z, c, u, zk[i0:i1])
            del z  # the tile is not needed once its statistics are taken (off the CPU: freed here)
        parts.append(run)
    stats = parts[0] if len(parts) == 1 else torch.cat(parts)
    if kept is None:
        return stats
    return spec.with_kept_pair(_sxp, stats, *spec.kept_pair(_sxp, zk, kept[1], tau))


def _tile_peak(z, local, owns, valid, res, tau, j0: int, j1: int):
    """``(ly, at_y, cands)`` of a logits tile (``gradient_rounding="fixed"``), before it holds ``G``.

    ``ly [tc]``: the target's tile column (clamped), ``at_y``: the tile holds
    it; ``cands``: ``[(column [tc], on [tc])]`` for the tile's two largest
    logits in column order, ``on`` where that column has ``p_v > 1/3`` (the
    unmasked distribution) and is not the target. A row has at most two
    columns with ``p_v > 1/3`` (``p`` sums to 1), and both are among its
    tile's two largest logits: which two, and their order, do not depend on
    how ``topk`` breaks ties.
    """
    k = min(2, j1 - j0)
    top, idx = z.topk(k, dim=1)
    m = res[0]
    ms = torch.where(m == float("-inf"), torch.zeros((), dtype=m.dtype, device=m.device), m)
    ly = (local - j0).clamp(0, j1 - j0 - 1)
    at_y = owns & valid & (local >= j0) & (local < j1)
    p = torch.exp((top - ms[:, None]) / tau - res[1][:, None])
    on = valid[:, None] & (p > 1 / 3) & ~(at_y[:, None] & (idx == ly[:, None]))
    idx, order = idx.sort(dim=1)
    on = on.gather(1, order)
    return ly, at_y, [(idx[:, i], on[:, i]) for i in range(k)]


def _tile_fixes(g, dtype, found=None, kept_cols=None):
    """``[(tile column [tc], residual G - rnd(G) [tc])]`` of a gradient tile ``g`` (float32) rounded to ``dtype``.

    ``found``: :func:`_tile_peak`'s result (the target, then the ``p > 1/3``
    columns in column order, residual 0 where the row has none); ``kept_cols``:
    ``(c, u, vals)`` of ``keep_ids`` instead (every kept column: the written
    values' residuals).
    """
    def residual(x):
        return x - x.to(dtype).to(x.dtype)

    if kept_cols is not None:
        c, u, vals = kept_cols
        zero = torch.zeros((), dtype=vals.dtype, device=vals.device)
        return [(c[:, k].clamp(min=0), torch.where(u[:, k], residual(vals[:, k]), zero)) for k in range(c.shape[1])]
    ly, at_y, cands = found
    out = []
    for col, on in [(ly, at_y)] + cands:
        v = g.gather(1, col[:, None])[:, 0]
        out.append((col, torch.where(on, residual(v), torch.zeros((), dtype=v.dtype, device=v.device))))
    return out


def _add_rows_(acc: torch.Tensor, col: torch.Tensor, rows: torch.Tensor) -> None:
    """``acc[col[t]] += rows[t]`` for every ``t``, rows sharing a column summed in ``t`` order, run to run.

    CUDA: ``index_put_(accumulate=True)``, ATen's sort-based kernel (a stable
    sort of the indices, then each index's run summed in order by one warp:
    no atomics, no host sync; the path ``index_add_`` itself takes under
    ``torch.use_deterministic_algorithms``), not ``index_add_``, whose CUDA
    kernel adds with atomics in no fixed order. Elsewhere ``index_add_``
    (the CPU adds the rows one after another).
    """
    if acc.device.type == "cuda":
        acc.index_put_((col,), rows, accumulate=True)
    else:
        acc.index_add_(0, col, rows)


def _grads(h2, weight, local, owns, keep, res, valid, gl, ge, tau, tiles, need_dh, need_dw, compiled: bool,
           kept=None):
    """``(dh [T, H] float32 or None, dW [V_local, H] in weight's dtype or None)``: the local partial sums.

    ``res``: the ``[5, T]`` row statistics (``engines.merge``). ``kept``: as
    in :func:`_stats`; each tile's gradient is then the entropy term alone
    (``spec.block_grad`` with a zero log-prob cotangent, NaN rows carried in
    its entropy cotangent) with the kept columns' values
    (``spec.kept_grad``) written over it.
    """
    if kept is not None:
        comb_all = spec.Combined(*res.unbind(0), None)
        nan_rows = torch.where(valid, 0.0 * comb_all.log_sk, torch.zeros_like(comb_all.log_sk))
        gl_kept, ge_kept, gl, ge = gl, ge, torch.zeros_like(gl), (nan_rows if ge is None else ge + nan_rows)
    n, hsz = h2.shape
    v = weight.shape[0]
    tc, vc = tiles
    cdt = tau.dtype
    vocab_major = n <= v
    dev = h2.device
    dh = torch.zeros((n, hsz), dtype=cdt, device=dev) if need_dh else None
    direct_dw = weight.dtype == cdt  # accumulate straight into the returned gradient
    dw_out = dw_full = None
    if need_dw:
        if direct_dw and vocab_major:
            dw_out = torch.empty((v, hsz), dtype=cdt, device=dev)  # each block written by its first product
        elif direct_dw:
            dw_out = dw_full = torch.zeros((v, hsz), dtype=cdt, device=dev)
        elif vocab_major:
            dw_out = torch.empty((v, hsz), dtype=weight.dtype, device=dev)
        else:
            dw_full = torch.zeros((v, hsz), dtype=cdt, device=dev)
    rows, cols = even_ranges(n, tc), ranges(v, vc)
    outer, inner = (cols, rows) if vocab_major else (rows, cols)
    buf = TileBuffer(min(tc, n), min(vc, v), cdt, dev)
    # 16-bit operands on CUDA: products of G's 16-bit parts with the rows as
    # they are (tensor cores, float32 accumulation), no float32 copies.
    native = _native_out_dtype(h2, cdt)
    fixing = native and tuning.current().gradient_rounding == "fixed"
    up = (lambda x: x) if native else (lambda x: _up(x, cdt))
    # Operand rows upcast once where the inner loop has a single step (the
    # common case): the full hidden for vocabulary-major, the full weight for
    # token-major (that is then one tile wide, so it is tile-sized).
    inner_up = None
    for a0, a1 in outer:
        # vocabulary-major: this block's dW, complete after the inner loop; float32
        # (the returned gradient itself for float32 input), rounded once below.
        block_acc = None
        if need_dw and vocab_major:
            block_acc = dw_out[a0:a1] if direct_dw else torch.empty((a1 - a0, hsz), dtype=cdt, device=dev)
        outer_up = up(weight[a0:a1] if vocab_major else h2[a0:a1])
        for k, (b0, b1) in enumerate(inner):
            (i0, i1), (j0, j1) = ((b0, b1), (a0, a1)) if vocab_major else ((a0, a1), (b0, b1))
            if len(inner) == 1:
                if inner_up is None:
                    inner_up = up(h2[i0:i1] if vocab_major else weight[j0:j1])
                this_up = inner_up
            else:
                this_up = up(h2[i0:i1] if vocab_major else weight[j0:j1])
            h_i, w_j = (this_up, outer_up) if vocab_major else (outer_up, this_up)
            if native:  # the forward's own product (same values as its statistics)
                z = _logits_block(h2[i0:i1], weight[j0:j1], cdt)
            else:
                z = _logits_block(h_i, w_j, cdt, buf.take(i1 - i0, j1 - j0))
            kb = None if keep is None else keep[i0:i1, j0:j1]
            ge_i = None if ge is None else ge[i0:i1]
            if kept is not None:  # the kept columns' values, from the tile before it holds G
                c, u = spec.columns_in_block(_sxp, kept[0][i0:i1], kept[1][i0:i1], j0, j1 - j0)
                vals = spec.kept_grad(
                    _sxp, spec.gather_columns(_sxp, z, c, u), kept[0][i0:i1], u, local[i0:i1], owns[i0:i1],
                    spec.Combined(*(f[i0:i1] for f in comb_all[:5]), None), valid[i0:i1], gl_kept[i0:i1],
                    None if ge_kept is None else ge_kept[i0:i1], tau)
            found = None
            if fixing and kept is None:
                found = _tile_peak(z, local[i0:i1], owns[i0:i1], valid[i0:i1], res[:, i0:i1], tau, j0, j1)
            engines.block_grad_(
                z, local[i0:i1], owns[i0:i1], kb, res[:, i0:i1], valid[i0:i1], gl[i0:i1], ge_i, tau, start=j0,
                compiled=compiled,
            )  # z holds G now (float32)
            if kept is not None:
                spec.set_at_columns(_sxp, z, c, vals, u)
            if native:
                fixes = _tile_fixes(z, h2.dtype, found, None if kept is None else (c, u, vals)) if fixing else ()
                acc = None
                for q, g in enumerate(_g_parts(z, h2.dtype)):
                    if need_dh:
                        _addmm_f32_(dh[i0:i1], g, w_j, False)
                    if need_dw:
                        acc = block_acc if block_acc is not None else dw_full[j0:j1]
                        _addmm_f32_(acc, g.t(), h_i, block_acc is not None and k == 0 and q == 0)
                    del g
                # "fixed": G rounded once above; its residual at the target / p > 1/3 (or kept) columns added
                # back as rank-1 terms into the float32 accumulators (dh per row; dW before its rounding)
                for col, r in fixes:
                    if need_dh:
                        dh[i0:i1].addcmul_(r[:, None], w_j[col].to(cdt))
                    if need_dw:
                        _add_rows_(acc, col, r[:, None] * h_i.to(cdt))
            else:  # float32 G times float32 (or upcast) rows
                if need_dh:
                    dh[i0:i1].addmm_(z, w_j)
                if need_dw and block_acc is not None:
                    if k == 0:
                        torch.mm(z.t(), h_i, out=block_acc)
                    else:
                        block_acc.addmm_(z.t(), h_i)
                elif need_dw:
                    dw_full[j0:j1].addmm_(z.t(), h_i)
            del z, this_up
        if block_acc is not None and not direct_dw:
            dw_out[a0:a1].copy_(block_acc)  # the one rounding of this block of dW
        del block_acc
        del outer_up
    if need_dw and dw_out is None:
        dw_out = dw_full.to(weight.dtype)
    return dh, dw_out


_UNMATERIALISED = (
    "dualvp_torch.linear_logprob_entropy: the gradient of the {} arrived as None in backward (gradient "
    "materialisation was disabled by a caller or wrapper); computing the gradient without it would silently "
    "drop that term, so the op refuses."
)


def _check_materialised(need_entropy_grad: bool, grad_logprob, grad_entropy) -> None:
    if grad_logprob is None:
        raise RuntimeError(_UNMATERIALISED.format("log-prob"))
    if need_entropy_grad and grad_entropy is None:
        raise RuntimeError(_UNMATERIALISED.format("entropy"))


def forward(hidden, weight, target, keep_mask, opt: validation.Options, group, engine: str, budget, allow_tf32,
            keep_ids=None):
    """``(logprob, entropy, res [5, T])`` of a checked call (every rank enters the same collectives).

    ``engine``: a name of :data:`dualvp_torch.engines.ENGINES`; its
    ``spec_stages`` run the tile loop here, else the fused Triton kernels.
    ``budget``: :func:`_budgets`.
    """
    rank, world = collectives.group_rank_world(group)
    eng = engines.ENGINES[engine]
    h = hidden
    if opt.sequence_parallel and group is not None and world > 1:
        h = collectives.all_gather_cat(hidden, group)
    hsz, v = weight.shape[1], weight.shape[0]
    h2 = h.reshape(-1, hsz)
    n = h2.shape[0]
    cdt = engines.compute_dtype(hidden.dtype)
    valid, owns, local = spec.target_to_local(xp, target.reshape(-1).to(torch.int64), rank, v, opt.ignore_index)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    tau = torch.full((), opt.temperature, dtype=cdt, device=hidden.device)
    fused = not eng.spec_stages
    tile_budget, col_budget, _ = budget
    tiles = tile_shape(max(n, MIN_ROWS), v, tile_budget, 4 + eng.tile_scratch_bytes, col_budget)
    # Batch invariance: a call of fewer than MIN_ROWS rows runs as MIN_ROWS (its rows repeated)
    pad = pad_rows(n)
    hp, tp, vp, op, lp_, kp, idp = _padded(pad, h2, target.reshape(-1), valid, owns, local, keep, keep_ids)
    kept = _kept(idp, tp, rank, v, opt)
    if not n:
        stats = torch.zeros((0, spec.N_STATS), dtype=cdt, device=hidden.device)
    elif fused:
        stats = linear_triton.stats(hp, weight, _ycol(lp_, op, vp), kp, tau, opt.temperature, allow_tf32)
        if kept is not None:  # the kept pair from the logits at the kept columns (O(T K H) products)
            zk = linear_triton.kept_logits(hp, weight, *kept, tile_budget)
            stats = spec.with_kept_pair(_sxp, stats, *spec.kept_pair(_sxp, zk, kept[1], tau))
    else:
        with linear_triton.matmul_precision(h2, allow_tf32):
            stats = _stats(hp, weight, lp_, op, kp, tau, tiles, eng.compiled, kept)
    if pad is not None:
        stats = stats[:n]
    all_stats = collectives.gather_stats(stats, group) if group is not None else stats[None]
    # (the fused Triton kernels: the O(T) merge runs as impl=None would run it)
    merge_compiled = engines.ENGINES[engine if eng.spec_stages else engines.select(None)].compiled
    res, logprob, entropy = engines.merge(all_stats, valid, tau, compiled=merge_compiled)
    return logprob.reshape(target.shape), entropy.reshape(target.shape), res


def grads(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy, opt: validation.Options, group,
          engine: str, budget, allow_tf32, keep_ids, need_dh: bool, need_dw: bool):
    """``(dh in hidden's shape and dtype or None, dW or None)`` from :func:`forward`'s ``res`` (``dh`` reduced over
    the group as the options say)."""
    _check_materialised(opt.need_entropy_grad, grad_logprob, grad_entropy)
    rank, world = collectives.group_rank_world(group)
    eng = engines.ENGINES[engine]
    sp = opt.sequence_parallel and group is not None and world > 1
    # Gathered again rather than kept from the forward: [T, H] less between the two.
    h = collectives.all_gather_cat(hidden, group) if sp else hidden
    hsz, v = weight.shape[1], weight.shape[0]
    h2 = h.reshape(-1, hsz)
    cdt = engines.compute_dtype(hidden.dtype)
    valid, owns, local = spec.target_to_local(xp, target.reshape(-1).to(torch.int64), rank, v, opt.ignore_index)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    # Contiguous O(T) vectors (upstream gradients often arrive expanded).
    gl = grad_logprob.reshape(-1).to(cdt).contiguous()
    ge = grad_entropy.reshape(-1).to(cdt).contiguous() if opt.need_entropy_grad else None
    tau = torch.full((), opt.temperature, dtype=cdt, device=hidden.device)
    n = h2.shape[0]
    tile_budget = budget[0]
    tiles = tile_shape(max(n, MIN_ROWS), v, tile_budget, 4 + eng.tile_scratch_bytes, budget[1])
    pad = pad_rows(n)
    if pad is not None:  # as in the forward; the repeats' upstream gradients are 0 (no dW term)
        h2, _, valid, owns, local, keep, keep_ids = _padded(pad, h2, None, valid, owns, local, keep, keep_ids)
        target = target.reshape(-1)[pad]
        res = res[:, pad]
        first = torch.arange(MIN_ROWS, device=h2.device) < n
        gl = torch.where(first, gl[pad], torch.zeros((), dtype=cdt, device=h2.device))
        ge = None if ge is None else torch.where(first, ge[pad], torch.zeros((), dtype=cdt, device=h2.device))
    if not eng.spec_stages and n:
        M, log_s, c, mk, log_sk = res.unbind(0)
        kept, kept_vals = _kept(keep_ids, target, rank, v, opt), None
        if kept is not None:
            # keep_ids: the kernel forms the gradient without its log-prob term (a zero log-prob
            # cotangent: the entropy's, NaN rows carried in it), the kept columns' full values
            # (spec.kept_grad) are written over it in each G chunk (linear_triton.grads)
            zk = linear_triton.kept_logits(h2, weight, *kept, tile_budget)
            comb = spec.Combined(*res.unbind(0), None)
            kept_vals = spec.kept_grad(_sxp, zk, kept[0], kept[1], local, owns, comb, valid, gl, ge, tau)
            nan_rows = torch.where(valid, 0.0 * comb.log_sk, torch.zeros_like(comb.log_sk))
            gl = torch.zeros_like(gl)
            ge = nan_rows if ge is None else ge + nan_rows
            c = res[2]
            kept_vals = (kept[0], kept[1], kept_vals)
        dh, dw = linear_triton.grads(
            h2, weight, _ycol(local, owns, valid), keep, (M, log_s, c if ge is not None else None, mk, log_sk),
            gl, ge, opt.temperature,
            need_dh, need_dw, allow_tf32, tuning.current().gradient_rounding, budget[2], kept_vals,
        )
    else:
        with linear_triton.matmul_precision(h2, allow_tf32):
            dh, dw = _grads(
                h2, weight, local, owns, keep, res, valid, gl, ge, tau, tiles, need_dh, need_dw, eng.compiled,
                _kept(keep_ids, target, rank, v, opt),
            )
    if pad is not None and dh is not None:
        dh = dh[:n]
    if need_dh:
        if sp:
            dh = collectives.reduce_scatter_rows(dh, group)
        elif opt.reduce_hidden_grad and group is not None and world > 1:
            collectives.all_reduce_sum_(dh, group)
        dh = dh.to(hidden.dtype).reshape(hidden.shape)
    return dh, dw


def _budgets(memory_budget, n_rows: int, weight, hidden, engine: str) -> tuple:
    # (tile budget, the budget that sizes the columns, the Triton backward's): an explicit
    # memory_budget is all three; by default the columns' comes from V_local alone (batch invariance)
    if memory_budget is not None:
        return (memory_budget,) * 3
    tile_loop = engines.ENGINES[engine].spec_stages
    return (
        default_budget(n_rows, weight.shape[0], hidden.element_size(), hidden.device.type, tile_loop),
        column_budget(weight.shape[0], hidden.element_size(), hidden.device.type if tile_loop else "cpu",
                      engines.ENGINES[engine].tile_scratch_bytes > 0),
        None,
    )


# --- the ops, registered with torch's dispatcher (as dualvp_torch.library's) ------------------------------
#
#   dualvp::linear_logprob_entropy_fwd(hidden, weight, target, keep_mask, group_name, options..., impl,
#                                      allow_tf32, hidden_requires_grad, weight_requires_grad, keep_ids)
#       -> logprob, entropy, res [5, T]
#   dualvp::linear_logprob_entropy_bwd(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy?,
#                                      ..., need_dh, need_dw, keep_ids) -> dh (or [0]), dW (or [0])
#
# The forward's body runs the checks (checks.linear_call; with validate=True the agreement, whose record
# takes hidden's and weight's requires_grad from the arguments: the caller's, which the body no longer sees).

_LIB = op_library.LIB
_OPTIONS = ("str group_name, float temperature, bool with_entropy, bool entropy_grad, SymInt ignore_index, "
            "bool reduce_hidden_grad, bool sequence_parallel, SymInt? memory_budget, str impl, bool allow_tf32")
_LIB.define(f"linear_logprob_entropy_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? keep_mask, {_OPTIONS}, "
            "bool validate, bool hidden_requires_grad, bool weight_requires_grad, Tensor? keep_ids=None) "
            "-> (Tensor, Tensor, Tensor)", tags=op_library.PT2)
_LIB.define(f"linear_logprob_entropy_bwd(Tensor hidden, Tensor weight, Tensor target, Tensor? keep_mask, Tensor res, "
            f"Tensor grad_logprob, Tensor? grad_entropy, {_OPTIONS}, bool need_dh, bool need_dw, "
            "Tensor? keep_ids=None) -> (Tensor, Tensor)", tags=op_library.PT2)
_FWD = torch.ops.dualvp.linear_logprob_entropy_fwd.default
_BWD = torch.ops.dualvp.linear_logprob_entropy_bwd.default


def _checked_call(hidden, weight, target, keep_mask, group_name, temperature, with_entropy, entropy_grad,
                  ignore_index, reduce_hidden_grad, sequence_parallel, memory_budget, impl, allow_tf32, validate,
                  requires_grad, keep_ids):
    """``(call, group, budgets)``: the checks (every rank returns or raises alike) and, with ``validate``, the
    agreement (one host sync)."""
    group = op_library.group_of(group_name)
    kw = dict(
        temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy, entropy_grad=entropy_grad,
        reduce_hidden_grad=reduce_hidden_grad, sequence_parallel=sequence_parallel, memory_budget=memory_budget,
    )
    call = checks.linear_call(
        hidden, weight, target, keep_mask, group=group, validate=validate, impl=impl or None, allow_tf32=allow_tf32,
        kw=kw, keep_ids=keep_ids, requires_grad=requires_grad,
    )
    if validate and keep_ids is not None:
        _ids.check_range(keep_ids, call, group, hidden)
    if validate:
        checks.agree(call, checks.count_bad_targets(target, ignore_index, call.vocab), group, hidden, target, hidden)
    return call, group, _budgets(memory_budget, target.numel(), weight, hidden, call.engine)


def _fwd_body(hidden, weight, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
              reduce_hidden_grad, sequence_parallel, memory_budget, impl, allow_tf32, validate, hidden_requires_grad,
              weight_requires_grad, keep_ids=None):
    call, group, budget = _checked_call(
        hidden, weight, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
        reduce_hidden_grad, sequence_parallel, memory_budget, impl, allow_tf32, validate,
        (hidden_requires_grad, weight_requires_grad), keep_ids)
    out = forward(hidden, weight, target, keep_mask, call.opt, group, call.engine, budget, allow_tf32, keep_ids)
    return out, call, group, budget


def _fwd_impl(*args):
    return _fwd_body(*args)[0]


def _fwd_fake(hidden, weight, target, *rest):
    cdt = engines.compute_dtype(hidden.dtype)
    return (hidden.new_empty(target.shape, dtype=cdt), hidden.new_empty(target.shape, dtype=cdt),
            hidden.new_empty((5, target.numel()), dtype=cdt))


def _bwd_impl(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy, group_name, temperature,
              with_entropy, entropy_grad, ignore_index, reduce_hidden_grad, sequence_parallel, memory_budget, impl,
              allow_tf32, need_dh, need_dw, keep_ids=None):
    # the forward's call again (validate=False: no agreement, no sync)
    call, group, budget = _checked_call(
        hidden, weight, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
        reduce_hidden_grad, sequence_parallel, memory_budget, impl, allow_tf32, False, None, keep_ids)
    dh, dw = grads(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy, call.opt, group, call.engine,
                   budget, allow_tf32, keep_ids, need_dh, need_dw)
    return _or_empty(dh, hidden), _or_empty(dw, weight)


def _or_empty(g, like):
    return like.new_empty((0,)) if g is None else g


def _bwd_fake(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy, *options_and_ids):
    need_dh, need_dw = options_and_ids[10], options_and_ids[11]
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dh else hidden.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else weight.new_empty((0,)))


op_library.register_kernels((("linear_logprob_entropy_fwd", _fwd_impl, _fwd_fake),
                             ("linear_logprob_entropy_bwd", _bwd_impl, _bwd_fake)))


# --- autograd (one node; eagerly, with only a backend below it, the node runs the kernels directly and keeps
# the checked call for its backward, as dualvp_torch.library's) ---------------------------------------------


def _backward(ctx, grad_logprob, grad_entropy):
    need_dh, need_dw = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    if not (need_dh or need_dw):
        return None, None
    hidden, weight, target, keep_mask, res, keep_ids = ctx.saved_tensors
    if ctx.call is not None and torch._C._len_torch_dispatch_stack() == 0:
        with torch._C._AutoDispatchBelowAutograd():
            return grads(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy, ctx.call.opt, ctx.group,
                         ctx.call.engine, ctx.budget, ctx.options[-1], keep_ids, need_dh, need_dw)
    if not ctx.need_entropy_grad:
        grad_entropy = None
    _check_materialised(ctx.need_entropy_grad, grad_logprob, grad_entropy)
    dh, dw = _BWD(hidden, weight, target, keep_mask, res, grad_logprob, grad_entropy, *ctx.options, need_dh, need_dw,
                  keep_ids)
    return (dh if need_dh else None), (dw if need_dw else None)


def _autograd_forward(ctx, below, hidden, weight, target, keep_mask, keep_ids, options, tail):
    # options: the op's 10 arguments between keep_mask and validate; tail: validate and the requires_grad flags
    args = (hidden, weight, target, keep_mask, *options, *tail, keep_ids)
    ctx.call = None
    with torch._C._AutoDispatchBelowAutograd():
        if below.highestPriorityTypeId() in op_library.DIRECT:
            out, ctx.call, ctx.group, ctx.budget = _fwd_body(*args)
        else:
            out = _FWD.redispatch(below, *args)
    ctx.save_for_backward(hidden, weight, target, keep_mask, out[2], keep_ids)
    ctx.options = options
    with_entropy, entropy_grad = options[2], options[3]
    ctx.need_entropy_grad = with_entropy and entropy_grad
    ctx.mark_non_differentiable(out[2])
    if not ctx.need_entropy_grad:
        ctx.mark_non_differentiable(out[1])
    return out


def _autograd_backward(ctx, grad_logprob, grad_entropy, grad_res):
    g = (_backward_once if torch.is_grad_enabled() else _backward)(ctx, grad_logprob, grad_entropy)
    return (None,) + tuple(g) + (None,) * 5


_backward_once = torch.autograd.function.once_differentiable(_backward)

#: The forward op's autograd node (``grad_fn`` is a ``dualvp_linear_logprob_entropy_fwdBackward``).
_Autograd = type("dualvp_linear_logprob_entropy_fwd", (torch.autograd.Function,), {
    "forward": staticmethod(_autograd_forward), "backward": staticmethod(_autograd_backward)})


def _fwd_autograd(keyset, hidden, weight, target, keep_mask, group_name, temperature, with_entropy, entropy_grad,
                  ignore_index, reduce_hidden_grad, sequence_parallel, memory_budget, impl, allow_tf32, validate,
                  hidden_requires_grad, weight_requires_grad, keep_ids=None):
    below = keyset & op_library.AFTER_AUTOGRAD
    options = (group_name, temperature, with_entropy, entropy_grad, ignore_index, reduce_hidden_grad,
               sequence_parallel, memory_budget, impl, allow_tf32)
    tail = (validate, hidden_requires_grad, weight_requires_grad)
    if (hidden.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        return _Autograd.apply(below, hidden, weight, target, keep_mask, keep_ids, options, tail)
    with torch._C._AutoDispatchBelowAutograd():
        return _FWD.redispatch(below, hidden, weight, target, keep_mask, *options, *tail, keep_ids)


_LIB.impl("linear_logprob_entropy_fwd", _fwd_autograd, "Autograd", with_keyset=True)


def _eligible(hidden, weight, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index,
              reduce_hidden_grad, sequence_parallel, validate, memory_budget, impl, allow_tf32, keep_ids) -> bool:
    # the arguments fit the op's schema as they are (else checked first, and one graph break in a caller's graph)
    return (
        type(hidden) is torch.Tensor and type(weight) is torch.Tensor and type(target) is torch.Tensor
        and (keep_mask is None or type(keep_mask) is torch.Tensor)
        and (keep_ids is None or type(keep_ids) is torch.Tensor)
        and type(with_entropy) is bool and type(entropy_grad) is bool and type(validate) is bool
        and (type(temperature) is float or isinstance(temperature, numbers.Real) and not isinstance(temperature, bool))
        and (type(ignore_index) is int or isinstance(ignore_index, int) and not isinstance(ignore_index, bool))
        and (impl is None or isinstance(impl, str)) and (group is None or collectives.is_process_group(group))
        and type(reduce_hidden_grad) is bool and type(sequence_parallel) is bool and type(allow_tf32) is bool
        and (memory_budget is None or type(memory_budget) is int)
    )


def _run_op(hidden, weight, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index,
            reduce_hidden_grad, sequence_parallel, validate, memory_budget, impl, allow_tf32, keep_ids):
    grad_on = torch.is_grad_enabled()
    logprob, entropy, _ = _FWD(
        hidden, weight, target, keep_mask, "" if group is None else group.group_name, float(temperature), with_entropy,
        entropy_grad, ignore_index, reduce_hidden_grad, sequence_parallel, memory_budget, impl or "", allow_tf32,
        validate, grad_on and hidden.requires_grad, grad_on and weight.requires_grad, keep_ids)
    return logprob, (entropy if with_entropy else None)


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group: Optional[ProcessGroup] = None,
    keep_mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    reduce_hidden_grad: bool = True,
    sequence_parallel: bool = False,
    validate: bool = True,
    memory_budget: Optional[int] = None,
    impl: Optional[engines.Engine] = None,
    allow_tf32: bool = False,
    keep_ids: Optional[torch.Tensor] = None,
    multi_target: bool = False,
    with_sum_p2: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of the target and entropy of ``softmax(hidden @ weight_full.T / tau)``, fused.

    ``multi_target`` / ``with_sum_p2`` (the logits op's K targets per row and sum of squared
    probabilities) are not implemented in the fused op yet: ``True`` raises ``NotImplementedError``
    (on every rank alike: an option, not data); a temperature tensor raises ``TypeError``.

    Equal (up to rounding) to ``logprob_entropy(hidden @ weight.T, target,
    ...)`` over the vocab-parallel group, without the ``[T, V_local]`` logits
    or their gradient ever existing; the logits are formed and differentiated
    one float32 tile at a time (see the module docstring for tiles, memory
    and precision).

    Args:
      hidden: ``[..., H]`` hidden states, identical on every rank of
        ``group``; with ``sequence_parallel=True``: ``[T/W, ..., H]``, this
        rank's rows ``[r*T/W, (r+1)*T/W)`` of the first dim. float32,
        bfloat16, float16 or float64.
      weight: ``[V_local, H]`` this rank's rows ``[r*V_local, (r+1)*V_local)``
        of the output weight (hidden's dtype).
      target: ``[...]`` integer *global* token ids (``[T, ...]`` with
        sequence parallelism), the same on every rank.
      group: the vocab-parallel ``torch.distributed.ProcessGroup`` or ``None``
        (unsharded: no collectives).
      keep_mask: ``[..., V_local]`` bool (``target.shape + (V_local,)``) or
        ``None``: the tokens the sampler kept; as in
        :func:`dualvp_torch.logprob_entropy`.
      keep_ids: ``[..., K]`` integer global token ids (padding -1;
        ``target.shape + (K,)``) or ``None``: the kept set as ids, as in
        :func:`dualvp_torch.logprob_entropy` (never with ``keep_mask``). Each
        tile gathers the logits at the kept columns it holds (O(T K) more, no
        mask). ``impl="triton"``: the kernels run unmasked, the logits at the
        kept columns are ``O(T K H)`` dot products, and the kept columns'
        gradient values are written into each stored ``G`` chunk (the
        default ``"gemm"`` backward; ``"atomic"`` raises).
      temperature, with_entropy, entropy_grad, ignore_index: as in
        :func:`dualvp_torch.logprob_entropy`.
      reduce_hidden_grad: ``True`` sums ``dh`` over the group in float32 in
        the backward (hidden replicated on the ranks); ``False`` returns this
        rank's partial ``dh`` (its vocabulary's share) for a caller whose
        graph already reduces it (Megatron's copy-to-tensor-parallel region):
        reducing twice would make it ``W`` times too large.
      sequence_parallel: ``True``: hidden holds ``T/W`` rows; the op
        all-gathers them (forward, and again in the backward) and
        reduce-scatters ``dh`` in float32. Needs ``reduce_hidden_grad=True``.
      validate: as in :func:`dualvp_torch.logprob_entropy`; the agreement
        record also holds ``H``, the hidden rows, ``reduce_hidden_grad``,
        ``sequence_parallel`` and whether hidden and weight require grad, so
        ranks that disagree on any of them raise instead of hanging in the
        backward or silently scaling ``dh``.
      memory_budget: bytes of one float32 logits tile (with the eager
        path's per-element temporaries; ``impl="triton"``: of one float32
        ``dW`` chunk for 16-bit weights); ``None``: ``max(B / 16, 1 MiB)``
        (``B / 4`` for the tile path on CUDA) with ``B = T * V_local *
        itemsize``, the tiles' columns sized from ``V_local`` alone, and the
        Triton backward's ``G`` chunks of ``V_local / 16`` columns (batch
        invariance; an explicit budget sizes the tile path's columns from the
        budget alone, and the Triton ``G`` chunks from it and ``T``). Need not
        agree across ranks (it changes no collective).
      impl: ``None``, ``"compiled"`` or ``"eager"``: how the spec stages of
        each tile run (:func:`dualvp_torch.engines.select`); ``"triton"``:
        the fused Triton kernels (CUDA, or CPU tensors under
        ``TRITON_INTERPRET=1``; float32, bfloat16 and float16).
      allow_tf32: ``True`` lets float32 inputs multiply in TF32 on CUDA
        (faster, ~10 bits of mantissa in the products); ``False`` (the
        default): IEEE float32, whatever torch's global TF32 flag says.

    Returns:
      ``(logprob [...], entropy [...] or None)``, float32 (float64 for
      float64), identical on every rank. Gradients flow to ``hidden`` and
      ``weight`` in their dtype, accumulated in float32.

    Raises:
      TypeError / ValueError naming the argument for invalid input (with a
      group and ``validate=True``, on every rank, or ``RuntimeError`` on every
      rank when the ranks disagree).

    Example:
      >>> import torch
      >>> from dualvp_torch import linear_logprob_entropy
      >>> hidden = torch.eye(2)  # logits = hidden @ weight.T = [[2, 0, 0, 0], [0, 0, 0, 0]]
      >>> weight = torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
      >>> lp, h = linear_logprob_entropy(hidden, weight, torch.tensor([0, 1]), impl="eager")
      >>> [round(v, 4) for v in lp.tolist()], [round(v, 4) for v in h.tolist()]
      ([-0.3408, -1.3863], [0.9183, 1.3863])
    """
    for name, on in (("multi_target", multi_target), ("with_sum_p2", with_sum_p2)):
        if on is not False:
            raise NotImplementedError(
                f"{name}: the fused LM-head op does not take it yet, got {on!r}; form the logits and call "
                "dualvp_torch.logprob_entropy, which does"
            )
    args = (hidden, weight, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index,
            reduce_hidden_grad, sequence_parallel, validate, memory_budget, impl, allow_tf32, keep_ids)
    if _eligible(*args):  # the custom op as is, eagerly and as one node of a caller's graph; its body checks
        return _run_op(*args)
    # arguments of other types: checked here (every rank raises alike), then the op with the checked values
    return (torch.compiler.disable(_checked_run) if torch.compiler.is_compiling() else _checked_run)(*args)


def _checked_run(hidden, weight, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index,
                 reduce_hidden_grad, sequence_parallel, validate, memory_budget, impl, allow_tf32, keep_ids):
    kw = dict(
        temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy, entropy_grad=entropy_grad,
        reduce_hidden_grad=reduce_hidden_grad, sequence_parallel=sequence_parallel, memory_budget=memory_budget,
    )
    call = checks.linear_call(
        hidden, weight, target, keep_mask, group=group, validate=validate, impl=impl, allow_tf32=allow_tf32, kw=kw,
        keep_ids=keep_ids,
    )
    opt = call.opt
    return _run_op(hidden, weight, target, keep_mask, group, opt.temperature, opt.with_entropy, opt.entropy_grad,
                   opt.ignore_index, opt.reduce_hidden_grad, opt.sequence_parallel, validate,
                   None if memory_budget is None else int(memory_budget), call.engine, allow_tf32, keep_ids)
