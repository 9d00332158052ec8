"""The logits op as a ``torch.library`` custom-op pair: the one primitive of every engine.

::

    dualvp::logprob_entropy_fwd(logits, target, keep_mask, group_name, options..., impl, keep_ids)
        -> logprob, entropy, res [5, T] (the row statistics M, log S, c, Mk, log Sk)
    dualvp::logprob_entropy_bwd(logits, target, keep_mask, res, grad_logprob, grad_entropy, ...)
        -> the gradient of the logits
    dualvp::logprob_entropy_bwd_(...)   the same written into the logits (inplace_grad=True)

defined on a ``torch.library.Library`` fragment, with the forward's autograd
kernel (one node, :data:`_Autograd`) registered beside its kernel and fake
kernel. An eager call (:func:`dualvp_torch.logprob_entropy`), a caller's
``torch.compile(fullgraph=True)`` (the ops are opaque nodes of its graph,
``inplace_grad=True`` included) and a CUDA-graph capture
(``mode="reduce-overhead"``; with ``validate=False`` neither op synchronises
or allocates by data on the Triton engine) all run this one object; eagerly,
with nothing but a backend key below autograd, the autograd node runs the
kernels without a second trip through the dispatcher (see "autograd"). Each op
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

from typing import Optional

import torch
from torch import Tensor

from . import checks, collectives, engines
from . import keep_ids as _ids
from .op_library import AFTER_AUTOGRAD as _AFTER_AUTOGRAD
from .op_library import DIRECT as _DIRECT
from .op_library import LIB as _LIB
from .op_library import PT2 as _PT2
from .op_library import eligible, group_of, no_output, register_kernels
from .stages import compute_dtype

__all__ = ["eligible", "logprob_entropy", "forward", "grad"]


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
    flat = target.dim() == 1  # logits [T, V_local] (no reshape: a view each, ~1 us of host time)
    z = logits if flat else logits.reshape(-1, v)
    y = target if flat else target.reshape(-1)
    keep = keep_mask if keep_mask is None or flat else keep_mask.reshape(-1, v)
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
    if flat:
        return logprob, entropy, res
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
    flat = target.dim() == 1  # (as in forward)
    z = logits if flat else logits.reshape(-1, v)
    keep = keep_mask if keep_mask is None or flat else keep_mask.reshape(-1, v)
    gl = grad_logprob if flat else grad_logprob.reshape(-1)
    ge = None
    if call.opt.with_entropy and call.opt.entropy_grad:
        ge = grad_entropy if flat else grad_entropy.reshape(-1)
    y = target if flat else target.reshape(-1)
    if keep_ids is not None:
        g = _ids.grad_with_ids(eng, z, y, keep_ids.reshape(y.shape[0], keep_ids.shape[-1]), res, gl, ge, call,
                               out=z if inplace else None)
    else:
        g = eng.grad(z, y, keep, res, gl, ge, call, out=z if inplace else None)
    return g if flat else g.view(logits.shape)


# --- the ops, registered with torch's dispatcher -------------------------------------------
#
# Defined on a ``torch.library.Library`` fragment with the registrations that ``torch.library.custom_op``
# makes (schema, a kernel for every device, a fake kernel, an autograd kernel, the mutated argument's version
# bump), written out: custom_op wraps each of them in Python layers that cost ~190 us per forward + backward
# on a CPU (the setup-context path's fill_defaults rebuilds the 13-argument schema 14 times, ~110 us; each
# kernel runs under a dynamo-disabling wrapper and an aliasing check; the forward goes through a generated
# autograd.Function with a metadata object), 2.5x the whole op's host time in the launch-stubbed benchmark
# (benchmarks/host_overhead.py; docs/decisions.md, "Host time and the eager engine").

_OPTIONS = ("str group_name, float temperature, bool with_entropy, bool entropy_grad, SymInt ignore_index, "
            "bool validate, bool inplace_grad, str impl, float label_smoothing")
_BWD_OPTIONS = "str group_name, float temperature, bool with_entropy, bool entropy_grad, SymInt ignore_index, str impl"
_LIB.define(f"logprob_entropy_fwd(Tensor logits, Tensor target, Tensor? keep_mask, {_OPTIONS}, Tensor? keep_ids=None) "
            "-> (Tensor, Tensor, Tensor)", tags=_PT2)
_LIB.define("logprob_entropy_bwd(Tensor logits, Tensor target, Tensor? keep_mask, Tensor res, Tensor grad_logprob, "
            f"Tensor grad_entropy, {_BWD_OPTIONS}, Tensor? keep_ids=None) -> Tensor", tags=_PT2)
_LIB.define("logprob_entropy_bwd_(Tensor(a!) logits, Tensor target, Tensor? keep_mask, Tensor res, "
            f"Tensor grad_logprob, Tensor grad_entropy, {_BWD_OPTIONS}, Tensor? keep_ids=None) -> ()", tags=_PT2)
_FWD = torch.ops.dualvp.logprob_entropy_fwd.default
_BWD = torch.ops.dualvp.logprob_entropy_bwd.default
_BWD_INPLACE = torch.ops.dualvp.logprob_entropy_bwd_.default


def _call_of(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, validate,
             inplace_grad, impl, label_smoothing, keep_ids=None) -> checks.Call:
    return checks.logits_call(
        logits, target, keep_mask, group=group_of(group_name), temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
        impl=impl or None, label_smoothing=label_smoothing, keep_ids=keep_ids,
    )


def _fwd_impl(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, validate,
              inplace_grad, impl, label_smoothing, keep_ids=None):
    # (the dispatcher leaves out a trailing argument equal to its default: keep_ids=None)
    call = _call_of(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
                    validate, inplace_grad, impl, label_smoothing, keep_ids)
    return forward(logits, target, keep_mask, call, group_of(group_name), keep_ids)


def _fwd_fake(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
              validate, inplace_grad, impl, label_smoothing, keep_ids=None):
    cdt = compute_dtype(logits.dtype)
    return (logits.new_empty(target.shape, dtype=cdt), logits.new_empty(target.shape, dtype=cdt),
            logits.new_empty((5, target.numel()), dtype=cdt))


def _bwd_call(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, impl,
              keep_ids):
    # the forward's call again (its options and engine), from the cache: no agreement, no sync
    return checks.logits_call(
        logits, target, keep_mask, group=group_of(group_name), temperature=temperature,
        with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index, validate=False,
        impl=impl or None, keep_ids=keep_ids,
    )


def _bwd_impl(logits, target, keep_mask, res, grad_logprob, grad_entropy, group_name, temperature, with_entropy,
              entropy_grad, ignore_index, impl, keep_ids=None):
    return grad(logits, target, keep_mask, res, grad_logprob, grad_entropy,
                _bwd_call(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad,
                          ignore_index, impl, keep_ids), keep_ids=keep_ids)


def _bwd_fake(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _bwd_inplace_impl(logits, target, keep_mask, res, grad_logprob, grad_entropy, group_name, temperature,
                      with_entropy, entropy_grad, ignore_index, impl, keep_ids=None):
    call = _bwd_call(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
                     impl, keep_ids)
    grad(logits, target, keep_mask, res, grad_logprob, grad_entropy, call, inplace=True, keep_ids=keep_ids)


register_kernels((("logprob_entropy_fwd", _fwd_impl, _fwd_fake), ("logprob_entropy_bwd", _bwd_impl, _bwd_fake),
                  ("logprob_entropy_bwd_", _bwd_inplace_impl, no_output)), inplace="logprob_entropy_bwd_")


# --- autograd ----------------------------------------------------------------------------
#
# The forward op's autograd kernel records one node (``_Autograd``) and runs the op below autograd. Where
# nothing but a backend key (CPU, CUDA) is left below autograd (no tracing mode, fake or functional tensor,
# torch function transform), the dispatcher's redispatch would run the CompositeExplicitAutograd kernel and
# nothing else: the node calls it directly (one boxing of 13 arguments less) and keeps the checked call for
# its backward, which then runs the backward kernel directly too (no lookup of the call again) unless a
# dispatch mode is active by then. Anything else goes through the dispatcher: a caller's torch.compile
# traces the ops (their fake kernels), never their bodies.



def _backward(ctx, grad_logprob, grad_entropy):
    """The gradient w.r.t. the logits (``None`` when none reaches them): the backward op or its kernel."""
    if grad_logprob is None and grad_entropy is None:
        return None
    logits, target, keep_mask, res, keep_ids = ctx.saved_tensors
    options = ctx.options
    call = ctx.call
    if grad_logprob is None:  # only the entropy reaches the loss: the log-prob term is zero (one fill)
        grad_logprob = torch.zeros(target.shape, dtype=res.dtype, device=res.device)
    if grad_entropy is None or not ctx.need_entropy_grad:  # no entropy term: the call without its gradient
        grad_entropy = grad_logprob  # (not read)
        if ctx.need_entropy_grad:
            options = options[:3] + (False,) + options[4:]
            call = None if call is None else _bwd_call(logits, target, keep_mask, *options, keep_ids)
    if call is not None and torch._C._len_torch_dispatch_stack() == 0:  # (see above)
        if ctx.inplace:
            torch.autograd.graph.increment_version(logits)  # what the op's ADInplaceOrView kernel does
        with torch._C._AutoDispatchBelowAutograd():  # as the kernel runs under the op (eager engine: -15% CPU)
            return grad(logits, target, keep_mask, res, grad_logprob, grad_entropy, call, inplace=ctx.inplace,
                        keep_ids=keep_ids)
    if ctx.inplace:
        _BWD_INPLACE(logits, target, keep_mask, res, grad_logprob, grad_entropy, *options, keep_ids)
        return logits
    return _BWD(logits, target, keep_mask, res, grad_logprob, grad_entropy, *options, keep_ids)


_backward_once = torch.autograd.function.once_differentiable(_backward)


def _autograd_forward(ctx, below, logits, target, keep_mask, keep_ids, options):
    # options: the op's 9 arguments between keep_mask and keep_ids (one Python value through apply)
    args = (logits, target, keep_mask, *options, keep_ids)
    ctx.call = None
    with torch._C._AutoDispatchBelowAutograd():
        if below.highestPriorityTypeId() in _DIRECT:
            ctx.call = _call_of(*args)
            out = forward(logits, target, keep_mask, ctx.call, group_of(options[0]), keep_ids)
        else:
            out = _FWD.redispatch(below, *args)
    group_name, temperature, with_entropy, entropy_grad, ignore_index, _, inplace_grad, impl, _ = options
    ctx.save_for_backward(logits, target, keep_mask, out[2], keep_ids)
    ctx.options = (group_name, temperature, with_entropy, entropy_grad, ignore_index, impl)
    ctx.need_entropy_grad = with_entropy and entropy_grad
    ctx.inplace = inplace_grad
    # An output that does not reach the loss arrives in _backward as None, not as zeros: ``res`` never does
    # (materialising its gradient would launch a fill kernel on every backward), and _backward treats a None
    # log-prob or entropy gradient explicitly as zero (never by skipping a term it needs: docs/design.md).
    ctx.set_materialize_grads(False)
    return out


def _autograd_backward(ctx, grad_logprob, grad_entropy, grad_res):
    # create_graph=True: once_differentiable's wrapper, so that a second differentiation raises (the backward
    # ops have no derivative)
    g = (_backward_once if torch.is_grad_enabled() else _backward)(ctx, grad_logprob, grad_entropy)
    return None, g, None, None, None, None


#: The forward op's autograd node (``grad_fn`` is a ``dualvp_logprob_entropy_fwdBackward``), the one backward
#: definition of the logits op: the backward op (or its kernel) of the saved logits, target, mask and ``res``.
_Autograd = type("dualvp_logprob_entropy_fwd", (torch.autograd.Function,), {
    "forward": staticmethod(_autograd_forward), "backward": staticmethod(_autograd_backward)})


def _fwd_autograd(keyset, logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad,
                  ignore_index, validate, inplace_grad, impl, label_smoothing, keep_ids=None):
    below = keyset & _AFTER_AUTOGRAD
    options = (group_name, temperature, with_entropy, entropy_grad, ignore_index, validate, inplace_grad, impl,
               label_smoothing)
    if logits.requires_grad and torch.is_grad_enabled():
        return _Autograd.apply(below, logits, target, keep_mask, keep_ids, options)
    with torch._C._AutoDispatchBelowAutograd():
        if below.highestPriorityTypeId() in _DIRECT:
            return _fwd_impl(logits, target, keep_mask, *options, keep_ids)
        return _FWD.redispatch(below, logits, target, keep_mask, *options, keep_ids)


_LIB.impl("logprob_entropy_fwd", _fwd_autograd, "Autograd", with_keyset=True)


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
    logprob, entropy, _ = _FWD(logits, target, keep_mask, "" if group is None else group.group_name, opt.temperature,
                               opt.with_entropy, opt.entropy_grad, opt.ignore_index, validate, opt.inplace_grad,
                               call.engine, opt.label_smoothing, keep_ids)
    if not opt.with_entropy:
        return logprob, None
    return logprob, (entropy if opt.entropy_grad else entropy.detach())

