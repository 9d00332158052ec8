"""The logits op as a ``torch.library`` custom-op pair: the one primitive of every engine.

::

    dualvp::logprob_entropy_fwd(logits, target, keep_mask, group_name, options..., impl, keep_ids)
        -> logprob, entropy, res [5, T] (the row statistics M, log S, c, Mk, log Sk)
    dualvp::logprob_entropy_bwd(logits, target, keep_mask, res, grad_logprob, grad_entropy, ...)
        -> the gradient of the logits
    dualvp::logprob_entropy_bwd_(...)   the same written into the logits (inplace_grad=True)

with the backward registered through ``register_autograd``. An eager call
(:func:`dualvp_torch.logprob_entropy`), a caller's ``torch.compile(fullgraph=True)``
(the ops are opaque nodes of its graph) and a CUDA-graph capture
(``mode="reduce-overhead"``; with ``validate=False`` neither op synchronises
or allocates by data on the Triton engine) all run this one object. Each op
body takes the checked call from :func:`dualvp_torch.checks.logits_call`
(cached per call metadata), then the engine's steps
(:data:`dualvp_torch.engines.ENGINES`)::

    stats   [T, V_local] -> [T, 6] (+ the out-of-range count)      engine
    agree   validate=True: the agreement record / the count         checks.agree (1 host sync)
    gather  [T, 6] -> [W, T, 6]                                     collectives (1 all-gather)
    merge   [W, T, 6] -> logprob, entropy, res [5, T]               engine (identical on every rank)
    grad    [T, V_local] -> gradient (backward; no collective)      engine

The group goes by name (a custom op takes no ``ProcessGroup``) and is
resolved in the op.

Memory (``B`` = bytes of the logits shard): the forward allocates only O(T)
tensors (plus bounded row-chunk scratch on the eager engine); autograd saves
the logits by reference, the target, the keep mask (by reference) and the
O(T) statistics; the backward allocates the gradient (input dtype) and O(T)
(or chunk) scratch. With ``inplace_grad=True`` the gradient is written into
the saved logits' storage instead.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import checks, collectives, engines
from . import keep_ids as _ids
from .stages import compute_dtype

__all__ = ["eligible", "logprob_entropy", "in_graph", "forward", "grad"]


def _group(name: str):
    return torch.distributed.distributed_c10d._resolve_process_group(name)


def forward(logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], call: checks.Call,
            group, keep_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(logprob, entropy, res [5, T])`` of a checked call: the engine's stats, the agreement, gather, merge.

    The outputs come in the target's shape; every rank enters the same
    collectives (with ``validate=True`` and a group the agreement all-gather,
    then the statistics' all-gather). ``keep_ids``: the kept set as ids
    (:mod:`dualvp_torch.keep_ids`: the engine runs unmasked, the kept pair
    comes from a gather beside it).
    """
    eng = engines.ENGINES[call.engine]
    v = call.v_local
    z = logits.reshape(-1, v)
    y = target.reshape(-1)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    ids = None if keep_ids is None else keep_ids.reshape(y.shape[0], keep_ids.shape[-1])
    if ids is not None and call.validate:
        _ids.check_range(ids, call, group, z)
    stats, bad, rows = eng.stats(z, y, keep, call)
    if ids is not None:
        stats = _ids.stats_with_ids(stats, z, y, ids, call)
    if call.validate:
        if bad is None:
            bad = checks.count_bad_targets(y, call.opt.ignore_index, call.vocab)
        checks.agree(call, bad, group, z, y)
    all_stats = stats[None] if group is None else collectives.gather_stats(stats, group)
    logprob, entropy, res = eng.merge(all_stats, y, rows, call)
    return logprob.view(target.shape), entropy.view(target.shape), res


def grad(logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], res: Tensor, grad_logprob: Tensor,
         grad_entropy: Optional[Tensor], call: checks.Call, inplace: bool = False,
         keep_ids: Optional[Tensor] = None) -> Tensor:
    """The gradient w.r.t. the logits (their shape) from :func:`forward`'s ``res``; no collective.

    ``grad_entropy`` is read only when ``call.opt.need_entropy_grad``;
    ``inplace=True`` writes it into the logits' storage and returns them.
    """
    eng = engines.ENGINES[call.engine]
    v = call.v_local
    z = logits.reshape(-1, v)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    ge = grad_entropy.reshape(-1) if call.opt.with_entropy and call.opt.entropy_grad else None
    if keep_ids is not None:
        y = target.reshape(-1)
        g = _ids.grad_with_ids(eng, z, y, keep_ids.reshape(y.shape[0], keep_ids.shape[-1]), res,
                               grad_logprob.reshape(-1), ge, call, out=z if inplace else None)
        return g.view(logits.shape)
    g = eng.grad(z, target.reshape(-1), keep, res, grad_logprob.reshape(-1), ge, call, out=z if inplace else None)
    return g.view(logits.shape)


@torch.library.custom_op("dualvp::logprob_entropy_fwd", mutates_args=())
def _fwd(
    logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], group_name: str, temperature: float,
    with_entropy: bool, entropy_grad: bool, ignore_index: int, validate: bool, inplace_grad: bool, impl: str,
    label_smoothing: float, keep_ids: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    group = _group(group_name) if group_name else None
    call = checks.logits_call(
        logits, target, keep_mask, group=group, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
        impl=impl or None, label_smoothing=label_smoothing, keep_ids=keep_ids,
    )
    return forward(logits, target, keep_mask, call, group, keep_ids)


@_fwd.register_fake
def _fwd_fake(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
              validate, inplace_grad, impl, label_smoothing, keep_ids=None):
    cdt = compute_dtype(logits.dtype)
    return (logits.new_empty(target.shape, dtype=cdt), logits.new_empty(target.shape, dtype=cdt),
            logits.new_empty((5, target.numel()), dtype=cdt))


def _bwd_call(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, impl,
              keep_ids=None):
    # the forward's call again (its options and engine), from the cache: no agreement, no sync
    return checks.logits_call(
        logits, target, keep_mask, group=_group(group_name) if group_name else None, temperature=temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index, validate=False,
        impl=impl or None, keep_ids=keep_ids,
    )


@torch.library.custom_op("dualvp::logprob_entropy_bwd", mutates_args=())
def _bwd(
    logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], res: Tensor, grad_logprob: Tensor,
    grad_entropy: Tensor, group_name: str, temperature: float, with_entropy: bool, entropy_grad: bool,
    ignore_index: int, impl: str, keep_ids: Optional[Tensor] = None,
) -> Tensor:
    return grad(logits, target, keep_mask, res, grad_logprob, grad_entropy,
                _bwd_call(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad,
                          ignore_index, impl, keep_ids), keep_ids=keep_ids)


@_bwd.register_fake
def _bwd_fake(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("dualvp::logprob_entropy_bwd_", mutates_args=("logits",))
def _bwd_inplace(
    logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], res: Tensor, grad_logprob: Tensor,
    grad_entropy: Tensor, group_name: str, temperature: float, with_entropy: bool, entropy_grad: bool,
    ignore_index: int, impl: str, keep_ids: Optional[Tensor] = None,
) -> None:
    call = _bwd_call(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
                     impl, keep_ids)
    grad(logits, target, keep_mask, res, grad_logprob, grad_entropy, call, inplace=True, keep_ids=keep_ids)


@_bwd_inplace.register_fake
def _bwd_inplace_fake(logits, *rest):
    return None


def _setup_context(ctx, inputs, output):
    (logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, _, inplace_grad,
     impl, _, keep_ids) = inputs
    ctx.save_for_backward(logits, target, keep_mask, output[2], keep_ids)
    ctx.options = (group_name, temperature, with_entropy, entropy_grad, ignore_index, impl)
    ctx.need_entropy_grad = with_entropy and entropy_grad
    ctx.inplace = inplace_grad
    # An output that does not reach the loss arrives in _backward as None, not as zeros: ``res`` never does
    # (materialising its gradient would launch a fill kernel on every backward), and _backward treats a None
    # log-prob or entropy gradient explicitly as zero (never by skipping a term it needs: docs/design.md).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logprob, grad_entropy, grad_res):
    none = (None,) * 12
    if not ctx.needs_input_grad[0] or (grad_logprob is None and grad_entropy is None):
        return (None,) + none
    logits, target, keep_mask, res, keep_ids = ctx.saved_tensors
    options = ctx.options
    if grad_logprob is None:  # only the entropy reaches the loss: the log-prob term is zero (one fill)
        grad_logprob = torch.zeros(target.shape, dtype=res.dtype, device=res.device)
    if grad_entropy is None or not ctx.need_entropy_grad:  # no entropy term: the call without its gradient
        grad_entropy = grad_logprob  # (not read)
        options = options[:3] + (False,) + options[4:]
    if ctx.inplace:
        _bwd_inplace(logits, target, keep_mask, res, grad_logprob, grad_entropy, *options, keep_ids)
        return (logits,) + none
    return (_bwd(logits, target, keep_mask, res, grad_logprob, grad_entropy, *options, keep_ids),) + none


_fwd.register_autograd(_backward, setup_context=_setup_context)


def eligible(logits: object, target: object, *, group: object = None, keep_mask: object = None,
             temperature: object = 1.0, with_entropy: object = True, entropy_grad: object = True,
             ignore_index: object = -100, validate: object = True, inplace_grad: object = False,
             impl: object = None, keep_ids: object = None) -> bool:
    """Whether a call's arguments fit the custom op's schema as they are (plain tensors, options of their
    documented Python types); else the caller's ``torch.compile`` runs the op as one graph break."""
    return (
        type(logits) is Tensor and type(target) is Tensor and (keep_mask is None or type(keep_mask) is Tensor)
        and (keep_ids is None or type(keep_ids) is Tensor)
        and (group is None or collectives.is_process_group(group))
        and isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
        and all(isinstance(x, bool) for x in (with_entropy, entropy_grad, validate, inplace_grad))
        and isinstance(ignore_index, int) and not isinstance(ignore_index, bool)
        and (impl is None or isinstance(impl, str))
    )


def logprob_entropy(
    logits: Tensor, target: Tensor, *, group: object = None, keep_mask: Optional[Tensor] = None,
    temperature: object = 1.0, with_entropy: object = True, entropy_grad: object = True, ignore_index: object = -100,
    validate: object = True, inplace_grad: object = False, impl: object = None, label_smoothing: float = 0.0,
    caller_error: Optional[BaseException] = None, keep_ids: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`dualvp_torch.logprob_entropy` on plain tensors outside a compiler: the checks, then the custom op.

    :func:`dualvp_torch.checks.logits_call` checks the call (every rank
    returns or every rank raises; ``label_smoothing`` and ``caller_error`` as
    there) and the op gets the checked values and the chosen engine.
    """
    call = checks.logits_call(
        logits, target, keep_mask, group=group, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
        impl=impl, label_smoothing=label_smoothing, caller_error=caller_error, keep_ids=keep_ids,
    )
    opt = call.opt
    logprob, entropy, _ = _fwd(logits, target, keep_mask, "" if group is None else group.group_name, opt.temperature,
                               opt.with_entropy, opt.entropy_grad, opt.ignore_index, validate, opt.inplace_grad,
                               call.engine, opt.label_smoothing, keep_ids)
    if not opt.with_entropy:
        return logprob, None
    return logprob, (entropy if opt.entropy_grad else entropy.detach())


def in_graph(
    logits: Tensor, target: Tensor, *, group=None, keep_mask: Optional[Tensor] = None, temperature: float = 1.0,
    with_entropy: bool = True, entropy_grad: bool = True, ignore_index: int = -100, validate: bool = True,
    inplace_grad: bool = False, impl: Optional[str] = None, keep_ids: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """The call that a caller's ``torch.compile`` traces (an :func:`eligible` call): the custom op as is.

    Its body runs the checks (from the cache), so errors are an eager call's.
    """
    logprob, entropy, _ = _fwd(logits, target, keep_mask, "" if group is None else group.group_name,
                               float(temperature), with_entropy, entropy_grad, ignore_index, validate, inplace_grad,
                               impl or "", 0.0, keep_ids)
    if not with_entropy:
        return logprob, None
    return logprob, (entropy if entropy_grad else entropy.detach())
