"""The logits op with K targets per row, a per-row temperature tensor and/or ``sum_v p_v^2``.

:func:`dualvp_torch.logprob_entropy` sends a call here when it passes
``multi_target=True``, ``with_sum_p2=True`` or a temperature tensor (checked by
:func:`dualvp_torch.checks.logits_call`, like every call). The steps are the
base op's, over the extended statistics of :mod:`dualvp.spec`
(``spec.ext_block_stats``: the shared row statistics, then ``s2``, the K
target logits and, with a mask, the K dropped flags: one ``[T, width]``
tensor)::

    stats   [T, V_local] -> [T, width]         the engine (compiled or eager spec stage, or Triton kernel)
    ids     keep_ids: the kept pair and dropped flags from the ids, O(T K) (keep_ids.ext_stats_with_ids)
    agree   validate=True: the agreement        checks.agree (1 host sync; + 1 for a temperature tensor)
    gather  [T, width] -> [W, T, width]         collectives.gather_stats: ONE all-gather, whatever K
    merge   -> logprob [..., K], entropy, sum_p2, the reduced statistics (saved, O(T K))
    grad    [T, V_local] (backward; no collective): the engine's dense pass without the K targets' terms,
            then each target's column written over it (spec.ext_block_grad at the gathered logits, one
            scatter of O(T K) values, rounded once), on every engine

Engines: ``compiled`` (``torch.compile`` of the spec stages), ``eager``
(the same over row chunks) and ``triton``: the logits op's statistics
kernel without a target (``HAS_TARGET=False``; ``s2`` and a per-row
temperature by constexpr switches), its ``[S, T, 7]`` column splits merged
here, the K target logits and dropped flags gathered here (O(T K)); the
gradient's dense pass is ``logits_ext_grad_kernel`` (``spec.ext_block_grad``
without the target terms, from per-row coefficients formed here).
``impl=None`` chooses ``compiled`` / ``eager`` for such calls. A one-row
call runs the compiled stages as two rows (``compiled.run``), as the base
op does: a row's results are bitwise the same alone and in a batch.

``keep_ids`` (the kept set as ids, :mod:`dualvp_torch.keep_ids`): the engine
runs unmasked; the shared kept pair comes from the ids' gathered logits and
target k's dropped flag from a compare with the ids (O(T K K_ids)); the
gradient's dense pass has no q-term (it lives on the kept columns only) and
the kept and target columns are written over it as above. No ``[T,
V_local]`` mask is built.

The op is a ``torch.library`` custom-op pair on :mod:`dualvp_torch.library`'s
fragment, registered the same way (schema, one kernel for every device,
fake kernels, the forward's autograd kernel, the in-place op's version
bump), and its only autograd path::

    dualvp::logprob_entropy_ext_fwd(logits, target, keep_mask, temperature_tensor, options..., keep_ids)
        -> logprob, entropy, sum_p2 (zeros without with_sum_p2), red [T, width] (the reduced statistics)
    dualvp::logprob_entropy_ext_bwd(logits, target, keep_mask, temperature_tensor, red, grads..., options...)
    dualvp::logprob_entropy_ext_bwd_(...)   the same written into the logits (inplace_grad=True)

An eligible call (plain tensors, options of their schema types,
:func:`eligible`) goes to the op as is, eagerly and as one node of a
caller's ``torch.compile(fullgraph=True)`` graph; the op's body runs the
checks. Other calls (DTensor, other argument types) are checked first
(:func:`logprob_entropy`), then run the same op.

Semantics: with a keep mask each target is kept for its own log-prob (target
k's distribution is renormalised over the mask plus ``y_k``); the gradient is
``sum_k gL_k (1[v = y_k] - q^k_v) / tau`` plus the entropy's and, when
``sum_p2`` reaches the loss, ``gS 2 p_v (p_v - S) / tau``. The temperature is
a constant (no gradient flows to a temperature tensor). The temperature
tensor must be the same on every rank (like the target).
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch

from dualvp import spec

from . import checks, collectives, engines, op_library
from . import compiled as _compiled_path
from . import keep_ids as _ids
from .engines import accumulation_dtype
from .stages import as_bool, compute_dtype, mask_arg, xp

__all__ = ["logprob_entropy"]

#: Elements per row chunk of the eager engine's stages (a float32 chunk is 256 KiB: its temporaries stay in cache).
CHUNK_ELEMENTS = 1 << 16


def _layout(opt, engine: bool = False) -> spec.ExtLayout:
    # the call's statistics (keep_ids: the dropped flags of a mask); ``engine``: what the engine computes (with
    # keep_ids it runs unmasked, the kept set's part is added beside it: :mod:`dualvp_torch.keep_ids`)
    return spec.ExtLayout(max(opt.n_targets, 1), opt.has_mask or (opt.has_ids and not engine), opt.with_sum_p2)


# --- the stages (their names key the compile cache: dualvp_torch.compiled) ------------


def ext_stats_stage(z, local, owns, keep: Optional[torch.Tensor], tau, acc_dtype, with_entropy, with_sum_p2):
    """``spec.ext_block_stats`` of the shard ``z [T, V_local]`` in the compute dtype: ``[T, width]``."""
    return spec.ext_block_stats(xp, z, local, owns, as_bool(keep), tau, dtype=compute_dtype(z.dtype),
                                acc_dtype=acc_dtype, with_entropy=with_entropy, with_sum_p2=with_sum_p2)


def ext_grad_stage(z, local, owns, keep: Optional[torch.Tensor], red, valid, gl, ge, gs, tau, k, has_mask,
                   with_sum_p2):
    """``spec.ext_block_grad`` of the shard from the reduced statistics ``red [T, width]``, in ``z.dtype``,
    without the K targets' terms (the backward writes those columns over it: :func:`_column_values`)."""
    lay = spec.ExtLayout(k, has_mask, with_sum_p2)
    ec = spec.ext_finalize(xp, red, lay, tau)
    g = spec.ext_block_grad(xp, z, local, owns, as_bool(keep), ec, valid, gl, ge, tau,
                            dtype=compute_dtype(z.dtype), g_sum_p2=gs, target_terms=False)
    return xp.astype(g, z.dtype)


def _chunks(n: int, v: int):
    step = max(1, CHUNK_ELEMENTS // max(1, v))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _rows(x, i, j):
    return None if x is None or x.ndim == 0 else x[i:j]


def _stats(z, local, owns, keep, tau, opt, compiled: bool) -> torch.Tensor:
    n, v = z.shape
    width = _layout(opt, engine=True).width
    if n == 0:
        return torch.zeros((0, width), dtype=compute_dtype(z.dtype), device=z.device)
    if compiled:  # one row: as two (compiled._run_one_row: batch invariance)
        args = (z, local, owns, mask_arg(keep, z), tau, accumulation_dtype(z), opt.with_entropy, opt.with_sum_p2)
        out, ok = _compiled_path.run(ext_stats_stage, args, opt.with_entropy or opt.with_sum_p2)
        if ok:
            return out
    out = torch.empty((n, width), dtype=compute_dtype(z.dtype), device=z.device)
    for i, j in _chunks(n, v):
        out[i:j] = ext_stats_stage(z[i:j], local[i:j], owns[i:j], _rows(keep, i, j), _rows(tau, i, j)
                                   if tau.ndim else tau, None, opt.with_entropy, opt.with_sum_p2)
    return out


def _grad(z, local, owns, keep, red, valid, gl, ge, gs, tau, opt, compiled: bool,
          out: Optional[torch.Tensor]) -> torch.Tensor:
    # ext_grad_stage into ``out`` (z itself for in place) or, None, a fresh [T, V_local] (compiled: the stage's own
    # output, no second buffer)
    n, v = z.shape
    if n == 0:
        return torch.empty(z.shape, dtype=z.dtype, device=z.device) if out is None else out
    lay = _layout(opt, engine=True)
    if compiled:  # one row: as two (compiled._run_one_row: batch invariance)
        args = (z, local, owns, mask_arg(keep, z), red, valid, gl, ge, gs, tau, lay.k, lay.has_mask,
                lay.with_sum_p2)
        g, ok = _compiled_path.run(ext_grad_stage, args, ge is not None)
        if ok:
            if out is None:
                return g
            out.copy_(g)
            return out
    if out is None:
        out = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    for i, j in _chunks(n, v):
        out[i:j] = ext_grad_stage(z[i:j], local[i:j], owns[i:j], _rows(keep, i, j), red[i:j], valid[i:j],
                                  gl[i:j], _rows(ge, i, j), _rows(gs, i, j), _rows(tau, i, j) if tau.ndim else tau,
                                  lay.k, lay.has_mask, lay.with_sum_p2)
    return out


# --- the Triton engine (dualvp_torch/logits_triton.py) ------------------------------------------


def _unit_stride(z, keep):
    z = z if z.stride(-1) == 1 else z.contiguous()
    keep = None if keep is None else (keep if keep.stride(-1) == 1 else keep.contiguous()).view(torch.uint8)
    return z, keep


def _triton_stats(z, local, owns, keep, tau, opt, plan) -> torch.Tensor:
    """``spec.ext_block_stats`` of the shard ``[T, width]``: the kernel's row statistics (and ``s2``) per column
    split, merged here (``spec.ext_reduce_stats``, O(S T)), then the K target logits and dropped flags (an O(T K)
    gather)."""
    from . import logits_triton

    n = z.shape[0]
    cdt = compute_dtype(z.dtype)
    if n == 0:
        return torch.zeros((0, _layout(opt, engine=True).width), dtype=cdt, device=z.device)
    zc, k8 = _unit_stride(z, keep)
    st = logits_triton.ext_stats(zc, k8, tau if tau.ndim else None, opt.with_entropy, opt.with_sum_p2, plan)
    if st.shape[0] == 1:
        base = st[0]
    else:  # column splits (from V_local alone), merged as ranks are
        base = spec.ext_reduce_stats(xp, st, spec.ExtLayout(0, False, opt.with_sum_p2), axis=0, temperature=tau)
    cols = [base, torch.where(owns, z.gather(1, local), 0.0).to(cdt)]
    if keep is not None:
        cols.append((owns & ~keep.gather(1, local)).to(cdt))
    return torch.cat(cols, dim=-1)


def _triton_coef(ec, valid, gl, ge, gs, tau, masked: bool, plan) -> torch.Tensor:
    """The extended gradient kernel's per-row coefficients ``[len(EXT_COEF), T]`` (``logits_ext_grad_kernel``)."""
    from . import logits_triton

    comb = ec.comb
    cdt = comb.M.dtype
    a = spec.ext_q_coefficient(xp, ec, valid, gl, tau, masked=masked)
    zero = torch.zeros_like(comb.M)
    if tau.ndim:  # one temperature per row: log2(e) / tau formed (in float64) and rounded as the kernel forms it
        l2e = (math.log2(math.e) / tau.to(torch.float64)).to(cdt)
    else:  # the plan's number, as the statistics kernel used it
        l2e = torch.full_like(comb.M, plan.scalars[2] if cdt == torch.float32
                              else math.log2(math.e) / plan.opt.temperature)
    rows = dict(
        M=comb.M, log_s=comb.log_s, c=comb.c, sum_p2=zero if ec.sum_p2 is None else ec.sum_p2, A=a,
        GE=zero if ge is None else ge * (math.log(2.0) / tau), GS=zero if gs is None else 2.0 * gs / tau,
        Mk=comb.mk, l2e_tau=l2e,
    )
    return torch.stack([rows[name].to(cdt) for name in logits_triton.EXT_COEF]).contiguous()


# --- the columns written by the host (the K targets, and keep_ids' kept set) ------------------------------


def _host_columns(y, owns, ids, call):
    """``(cols, use)`` ``[T, C]``: each shard column whose gradient the host writes, once per row: the targets'
    (on this shard) and, with ``keep_ids``, the kept set's (``spec.kept_columns``' dedup)."""
    cand = torch.where(owns, y, -1)
    if ids is not None:
        cand = torch.cat([cand, ids.to(torch.int64)], dim=-1)
    none = torch.full(cand.shape[:-1], -1, dtype=torch.int64, device=cand.device)
    return spec.kept_columns(xp, cand, none, call.rank, call.v_local, -1)


def _column_values(zk, kbits, cols, use, local, owns, ec, valid, gl, ge, gs, tau):
    """``[T, C]``: ``spec.ext_block_grad`` at the gathered columns, the targets' terms included (repeated targets
    add up), in the compute dtype."""
    g = spec.ext_block_grad(xp, zk, local, owns, kbits, ec, valid, gl, ge, tau, g_sum_p2=gs, target_terms=False)
    w = spec.ext_target_weights(xp, ec, valid, gl, tau)  # [T, K]
    hit = use[:, :, None] & owns[:, None, :] & (cols[:, :, None] == local[:, None, :])  # [T, C, K]
    return g + torch.where(hit, w[:, None, :], 0.0).sum(-1)


# --- the op's steps ------------------------------------------------------------------------


def _positions(y, call):
    return spec.target_to_local(xp, y.to(torch.int64), call.rank, call.v_local, call.opt.ignore_index)


def row_tau(temperature: Optional[torch.Tensor], target: torch.Tensor, call: checks.Call,
            logits: torch.Tensor) -> torch.Tensor:
    """The temperature as the steps take it: ``[T]`` in the compute dtype (a tensor), else a 0-d tensor."""
    opt = call.opt
    cdt = compute_dtype(logits.dtype)
    if opt.row_temperature:
        lead = tuple(target.shape[:-1]) if opt.n_targets else tuple(target.shape)
        return temperature.detach().to(cdt).broadcast_to(lead).reshape(-1).contiguous()
    return torch.full((), opt.temperature, dtype=cdt, device=logits.device)


def _as_rows(logits, target, keep_mask, keep_ids, call: checks.Call):
    """``(z [T, V_local], y [T, K], keep [T, V_local] or None, ids [T, K_ids] or None, K)``: the call's
    arrays as rows (``K = 1`` for a single target per row)."""
    v = call.v_local
    k = max(call.opt.n_targets, 1)
    y = target.reshape(-1, k)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    ids = None if keep_ids is None else keep_ids.reshape(y.shape[0], keep_ids.shape[-1])
    return logits.reshape(-1, v), y, keep, ids, k


def forward(logits, target, keep_mask, tau, call: checks.Call, group, keep_ids=None):
    """``(logprob, entropy, sum_p2 (zeros without with_sum_p2), red [T, width])`` of a checked call.

    ``red``: the reduced statistics (:func:`_layout`), all that :func:`grad`
    needs beside the inputs. Every rank enters the same collectives.
    """
    opt = call.opt
    z, y, keep, ids, k = _as_rows(logits, target, keep_mask, keep_ids, call)
    if ids is not None and call.validate:
        _ids.check_range(ids, call, group, z)
    valid, owns, local = _positions(y, call)
    if call.engine == "triton":
        stats = _triton_stats(z, local, owns, keep, tau, opt, call.plan)
    else:
        stats = _stats(z, local, owns, keep, tau, opt, engines.ENGINES[call.engine].compiled)
    if ids is not None:
        stats = _ids.ext_stats_with_ids(stats, z, y, owns, ids, tau, call)
    if call.validate:
        checks.agree(call, checks.count_bad_targets(y, opt.ignore_index, call.vocab), group, z, y)
    all_stats = stats[None] if group is None else collectives.gather_stats(stats, group)
    lay = _layout(opt)
    red = spec.ext_reduce_stats(xp, all_stats, lay, axis=0, temperature=tau)
    ec = spec.ext_finalize(xp, red, lay, tau)
    lp, h, p2 = spec.ext_outputs(xp, ec, valid, tau)
    if p2 is None:
        p2 = torch.zeros_like(h)
    lead = tuple(target.shape[:-1]) if opt.n_targets else tuple(target.shape)
    lp = lp.reshape(lead + ((k,) if opt.n_targets else ()))
    return lp, h.reshape(lead), p2.reshape(lead), red


def grad(logits, target, keep_mask, tau, red, g_logprob, g_entropy, g_sum_p2, call: checks.Call,
         inplace: bool = False, keep_ids=None):
    """The gradient w.r.t. the logits (their shape) from :func:`forward`'s ``red``; no collective.

    A ``None`` upstream gradient is zero; ``inplace=True`` writes it into the
    logits' storage and returns them.
    """
    opt = call.opt
    z, y, keep, ids, k = _as_rows(logits, target, keep_mask, keep_ids, call)
    valid, owns, local = _positions(y, call)
    cdt = compute_dtype(z.dtype)
    gl = (torch.zeros((z.shape[0], k), dtype=cdt, device=z.device) if g_logprob is None
          else g_logprob.reshape(-1, k).to(cdt).contiguous())
    ge = None
    if opt.need_entropy_grad and g_entropy is not None:
        ge = g_entropy.reshape(-1).to(cdt).contiguous()
    gs = g_sum_p2.reshape(-1).to(cdt).contiguous() if opt.with_sum_p2 and g_sum_p2 is not None else None
    out = z if inplace else None
    # a dense pass without the targets' terms (with keep_ids: without the q-terms, which live on the kept
    # columns only), then the host's columns written over it: the targets' and the kept set's, each from
    # spec.ext_block_grad at the gathered logits (gathered first: the in-place gradient overwrites z), in
    # the compute dtype and rounded once; at most K (+ K_ids) columns a row, no K compares over the shard
    lay = _layout(opt)
    ec = spec.ext_finalize(xp, red, lay, tau)
    cols, use = _host_columns(y.to(torch.int64), owns, ids, call)
    zk = spec.gather_columns(xp, z, cols, use, dtype=cdt)
    if keep is not None:
        kbits = keep.gather(1, cols)
    elif ids is not None:
        kbits = ((cols + call.rank * call.v_local)[:, :, None] == ids.to(torch.int64)[:, None, :]).any(-1)
    else:
        kbits = None
    vals = _column_values(zk, kbits, cols, use, local, owns, ec, valid, gl, ge, gs, tau)
    gl_dense = gl if ids is None else torch.zeros_like(gl)  # keep_ids: no q-term off the kept columns
    if call.engine == "triton":
        from . import logits_triton

        zc, k8 = _unit_stride(z, keep)
        coef = _triton_coef(ec, valid, gl_dense, ge, gs, tau, keep is not None, call.plan)
        out = logits_triton.ext_grad(zc, k8, coef, ge is not None, gs is not None, call.plan, out=out)
    else:
        out = _grad(z, local, owns, keep, red, valid, gl_dense, ge, gs, tau, opt,
                    engines.ENGINES[call.engine].compiled, out)
    spec.set_at_columns(xp, out, cols, vals, use)
    return out.view(logits.shape)


# --- the ops, registered with torch's dispatcher (as dualvp_torch.library's, and for the same host time) --
#
#   dualvp::logprob_entropy_ext_fwd(logits, target, keep_mask, temperature_tensor, group_name, options...,
#                                   impl, ..., multi_target, with_sum_p2, keep_ids)
#       -> logprob [..., K] or [...], entropy [...], sum_p2 [...] (zeros without with_sum_p2), red [T, width]
#   dualvp::logprob_entropy_ext_bwd(logits, target, keep_mask, temperature_tensor, red, grad_logprob?,
#                                   grad_entropy?, grad_sum_p2?, ...) -> the gradient of the logits
#   dualvp::logprob_entropy_ext_bwd_(...)   the same written into the logits (inplace_grad=True)
#
# ``temperature_tensor``: the per-row temperature tensor (``temperature`` is then unused), else None.

_LIB = op_library.LIB
_OPTIONS = ("str group_name, float temperature, bool with_entropy, bool entropy_grad, SymInt ignore_index, "
            "bool validate, bool inplace_grad, str impl, float label_smoothing, bool multi_target, bool with_sum_p2")
_BWD_OPTIONS = ("str group_name, float temperature, bool with_entropy, bool entropy_grad, SymInt ignore_index, "
                "str impl, bool multi_target, bool with_sum_p2")
_BWD_ARGS = "Tensor target, Tensor? keep_mask, Tensor? temperature_tensor, Tensor red, Tensor? grad_logprob, " \
            "Tensor? grad_entropy, Tensor? grad_sum_p2"
_LIB.define(f"logprob_entropy_ext_fwd(Tensor logits, Tensor target, Tensor? keep_mask, Tensor? temperature_tensor, "
            f"{_OPTIONS}, Tensor? keep_ids=None) -> (Tensor, Tensor, Tensor, Tensor)", tags=op_library.PT2)
_LIB.define(f"logprob_entropy_ext_bwd(Tensor logits, {_BWD_ARGS}, {_BWD_OPTIONS}, Tensor? keep_ids=None) -> Tensor",
            tags=op_library.PT2)
_LIB.define(f"logprob_entropy_ext_bwd_(Tensor(a!) logits, {_BWD_ARGS}, {_BWD_OPTIONS}, Tensor? keep_ids=None) -> ()",
            tags=op_library.PT2)
_FWD = torch.ops.dualvp.logprob_entropy_ext_fwd.default
_BWD = torch.ops.dualvp.logprob_entropy_ext_bwd.default
_BWD_INPLACE = torch.ops.dualvp.logprob_entropy_ext_bwd_.default

#: A call checked before the op (:func:`logprob_entropy`: ``(logits, call)``), which the op's body then takes
#: as its own instead of checking again (a temperature tensor's value check is a host sync).
_CHECKED = threading.local()


def _call_of(logits, target, keep_mask, temperature_tensor, group_name, temperature, with_entropy, entropy_grad,
             ignore_index, validate, inplace_grad, impl, label_smoothing, multi_target, with_sum_p2,
             keep_ids=None) -> checks.Call:
    pre = getattr(_CHECKED, "call", None)
    if pre is not None and pre[0] is logits:
        return pre[1]
    return checks.logits_call(
        logits, target, keep_mask, group=op_library.group_of(group_name),
        temperature=temperature if temperature_tensor is None else temperature_tensor, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
        impl=impl or None, label_smoothing=label_smoothing, multi_target=multi_target, with_sum_p2=with_sum_p2,
        keep_ids=keep_ids,
    )


def _run_forward(call, logits, target, keep_mask, temperature_tensor, group_name, keep_ids):
    tau = row_tau(temperature_tensor, target, call, logits)
    out = forward(logits, target, keep_mask, tau, call, op_library.group_of(group_name),
                  keep_ids)
    return out, tau


def _fwd_impl(logits, target, keep_mask, temperature_tensor, *options_and_ids):
    call = _call_of(logits, target, keep_mask, temperature_tensor, *options_and_ids)
    return _run_forward(call, logits, target, keep_mask, temperature_tensor, options_and_ids[0],
                        options_and_ids[11] if len(options_and_ids) > 11 else None)[0]


def _fwd_fake(logits, target, keep_mask, temperature_tensor, group_name, temperature, with_entropy, entropy_grad,
              ignore_index, validate, inplace_grad, impl, label_smoothing, multi_target, with_sum_p2,
              keep_ids=None):
    cdt = compute_dtype(logits.dtype)
    lead = tuple(target.shape[:-1]) if multi_target and target.dim() else tuple(target.shape)
    k = target.shape[-1] if multi_target and target.dim() else 1
    width = spec.ExtLayout(k, keep_mask is not None or keep_ids is not None, with_sum_p2).width
    return (logits.new_empty(target.shape, dtype=cdt), logits.new_empty(lead, dtype=cdt),
            logits.new_empty(lead, dtype=cdt), logits.new_empty((math.prod(lead), width), dtype=cdt))


def _bwd_call(logits, target, keep_mask, temperature_tensor, group_name, temperature, with_entropy, entropy_grad,
              ignore_index, impl, multi_target, with_sum_p2, keep_ids):
    # the forward's call again (its options and engine; validate=False: no agreement, no sync)
    return checks.logits_call(
        logits, target, keep_mask, group=op_library.group_of(group_name),
        temperature=temperature if temperature_tensor is None else temperature_tensor, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=False, impl=impl or None,
        multi_target=multi_target, with_sum_p2=with_sum_p2, keep_ids=keep_ids,
    )


def _bwd_run(logits, target, keep_mask, temperature_tensor, red, grad_logprob, grad_entropy, grad_sum_p2,
             options, keep_ids, inplace):
    call = _bwd_call(logits, target, keep_mask, temperature_tensor, *options, keep_ids)
    tau = row_tau(temperature_tensor, target, call, logits)
    return grad(logits, target, keep_mask, tau, red, grad_logprob, grad_entropy, grad_sum_p2, call,
                inplace=inplace, keep_ids=keep_ids)


def _bwd_impl(logits, target, keep_mask, temperature_tensor, red, grad_logprob, grad_entropy, grad_sum_p2,
              *options, keep_ids=None):
    if len(options) > 8:  # (keep_ids positionally)
        options, keep_ids = options[:8], options[8]
    return _bwd_run(logits, target, keep_mask, temperature_tensor, red, grad_logprob, grad_entropy, grad_sum_p2,
                    options, keep_ids, False)


def _bwd_fake(logits, *rest, **kw):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _bwd_inplace_impl(logits, target, keep_mask, temperature_tensor, red, grad_logprob, grad_entropy, grad_sum_p2,
                      *options, keep_ids=None):
    if len(options) > 8:
        options, keep_ids = options[:8], options[8]
    _bwd_run(logits, target, keep_mask, temperature_tensor, red, grad_logprob, grad_entropy, grad_sum_p2,
             options, keep_ids, True)


op_library.register_kernels((("logprob_entropy_ext_fwd", _fwd_impl, _fwd_fake),
                             ("logprob_entropy_ext_bwd", _bwd_impl, _bwd_fake),
                             ("logprob_entropy_ext_bwd_", _bwd_inplace_impl, op_library.no_output)),
                            inplace="logprob_entropy_ext_bwd_")


# --- autograd (as dualvp_torch.library's: one node; eagerly, with only a backend below it, the node runs the
# kernels directly and keeps the checked call and the temperature for its backward) -----------------------


def _backward(ctx, g_logprob, g_entropy, g_sum_p2):
    if g_logprob is None and g_entropy is None and g_sum_p2 is None:
        return None
    logits, target, keep_mask, temperature_tensor, red, keep_ids = ctx.saved_tensors
    if ctx.call is not None and torch._C._len_torch_dispatch_stack() == 0:
        if ctx.inplace:
            torch.autograd.graph.increment_version(logits)  # what the op's ADInplaceOrView kernel does
        with torch._C._AutoDispatchBelowAutograd():
            return grad(logits, target, keep_mask, ctx.tau, red, g_logprob, g_entropy, g_sum_p2, ctx.call,
                        inplace=ctx.inplace, keep_ids=keep_ids)
    args = (logits, target, keep_mask, temperature_tensor, red, g_logprob, g_entropy, g_sum_p2, *ctx.options,
            keep_ids)
    if ctx.inplace:
        _BWD_INPLACE(*args)
        return logits
    return _BWD(*args)


_backward_once = torch.autograd.function.once_differentiable(_backward)


def _autograd_forward(ctx, below, logits, target, keep_mask, temperature_tensor, keep_ids, options):
    # options: the op's 11 arguments between temperature_tensor and keep_ids
    args = (logits, target, keep_mask, temperature_tensor, *options, keep_ids)
    ctx.call = None
    with torch._C._AutoDispatchBelowAutograd():
        if below.highestPriorityTypeId() in op_library.DIRECT:
            ctx.call = _call_of(*args)
            out, ctx.tau = _run_forward(ctx.call, logits, target, keep_mask, temperature_tensor, options[0],
                                        keep_ids)
        else:
            out = _FWD.redispatch(below, *args)
    (group_name, temperature, with_entropy, entropy_grad, ignore_index, _, inplace_grad, impl, _, multi_target,
     with_sum_p2) = options
    ctx.save_for_backward(logits, target, keep_mask, temperature_tensor, out[3], keep_ids)
    ctx.options = (group_name, temperature, with_entropy, entropy_grad, ignore_index, impl, multi_target,
                   with_sum_p2)
    ctx.inplace = inplace_grad
    ctx.mark_non_differentiable(out[3])
    ctx.set_materialize_grads(False)  # an output that does not reach the loss: None (zero), no fill kernel
    return out


def _autograd_backward(ctx, g_logprob, g_entropy, g_sum_p2, _):
    # create_graph=True: once_differentiable's wrapper (the backward ops have no derivative)
    g = (_backward_once if torch.is_grad_enabled() else _backward)(ctx, g_logprob, g_entropy, g_sum_p2)
    return None, g, None, None, None, None, None


#: The forward op's autograd node (``grad_fn`` is a ``dualvp_logprob_entropy_ext_fwdBackward``).
_Autograd = type("dualvp_logprob_entropy_ext_fwd", (torch.autograd.Function,), {
    "forward": staticmethod(_autograd_forward), "backward": staticmethod(_autograd_backward)})


def _fwd_autograd(keyset, logits, target, keep_mask, temperature_tensor, group_name, temperature, with_entropy,
                  entropy_grad, ignore_index, validate, inplace_grad, impl, label_smoothing, multi_target,
                  with_sum_p2, keep_ids=None):
    below = keyset & op_library.AFTER_AUTOGRAD
    options = (group_name, temperature, with_entropy, entropy_grad, ignore_index, validate, inplace_grad, impl,
               label_smoothing, multi_target, with_sum_p2)
    if logits.requires_grad and torch.is_grad_enabled():
        return _Autograd.apply(below, logits, target, keep_mask, temperature_tensor, keep_ids, options)
    with torch._C._AutoDispatchBelowAutograd():
        if below.highestPriorityTypeId() in op_library.DIRECT:
            return _fwd_impl(logits, target, keep_mask, temperature_tensor, *options, keep_ids)
        return _FWD.redispatch(below, logits, target, keep_mask, temperature_tensor, *options, keep_ids)


_LIB.impl("logprob_entropy_ext_fwd", _fwd_autograd, "Autograd", with_keyset=True)


# --- the entry points ----------------------------------------------------------------------------------


def eligible(logits: object, target: object, *, group: object = None, keep_mask: object = None,
             temperature: object = 1.0, with_entropy: object = True, entropy_grad: object = True,
             ignore_index: object = -100, validate: object = True, inplace_grad: object = False,
             impl: object = None, keep_ids: object = None, multi_target: object = False,
             with_sum_p2: object = False) -> bool:
    """Whether an extended call's arguments fit the op's schema as they are (:func:`dualvp_torch.op_library.eligible`,
    a temperature tensor ``[...]`` allowed): then :func:`run_op`, else :func:`logprob_entropy` after the checks."""
    tensor_tau = type(temperature) is torch.Tensor and temperature.ndim > 0
    return (type(multi_target) is bool and type(with_sum_p2) is bool and op_library.eligible(
        logits, target, group=group, keep_mask=keep_mask, temperature=1.0 if tensor_tau else temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate,
        inplace_grad=inplace_grad, impl=impl, keep_ids=keep_ids))


def _results(lp, h, p2, with_entropy: bool, entropy_grad: bool, with_sum_p2: bool):
    if not with_entropy:
        h = None
    elif not entropy_grad:
        h = h.detach()
    return (lp, h, p2) if with_sum_p2 else (lp, h)


def run_op(logits, target, *, group=None, keep_mask=None, temperature=1.0, with_entropy=True, entropy_grad=True,
           ignore_index=-100, validate=True, inplace_grad=False, impl=None, keep_ids=None, multi_target=False,
           with_sum_p2=False):
    """An :func:`eligible` call, eagerly or in a caller's ``torch.compile`` (one node of its graph): the op as
    is; its body runs the checks. ``(logprob, entropy or None)`` (``+ (sum_p2,)`` with ``with_sum_p2``)."""
    tt = temperature if type(temperature) is torch.Tensor else None
    lp, h, p2, _ = _FWD(logits, target, keep_mask, tt, "" if group is None else group.group_name,
                        1.0 if tt is not None else float(temperature), with_entropy, entropy_grad, ignore_index,
                        validate, inplace_grad, impl or "", 0.0, multi_target, with_sum_p2, keep_ids)
    return _results(lp, h, p2, with_entropy, entropy_grad, with_sum_p2)


def logprob_entropy(logits, target, keep_mask, temperature, call: checks.Call, group, keep_ids=None):
    """The extended op on a checked call: ``(logprob, entropy or None, sum_p2 or None)``.

    ``target`` is ``[...]`` (``call.opt.n_targets == 0``) or ``[..., K]``;
    ``temperature`` the number of ``call.opt`` or a tensor broadcastable to
    the rows. Outputs are float32 (float64 for float64 logits). The op's body
    takes ``call`` as checked (:data:`_CHECKED`).
    """
    opt = call.opt
    tt = temperature if opt.row_temperature else None
    _CHECKED.call = (logits, call)
    try:
        lp, h, p2, _ = _FWD(logits, target, keep_mask, tt, "" if group is None else group.group_name,
                            1.0 if tt is not None else opt.temperature, opt.with_entropy, opt.entropy_grad,
                            opt.ignore_index, call.validate, opt.inplace_grad, call.engine, opt.label_smoothing,
                            opt.n_targets > 0, opt.with_sum_p2, keep_ids)
    finally:
        _CHECKED.call = None
    lp, h = _results(lp, h, p2, opt.with_entropy, opt.entropy_grad, True)[:2]
    return lp, h, (p2 if opt.with_sum_p2 else None)
