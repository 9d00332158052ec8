"""The op as two ``torch.library`` custom ops, for callers that ``torch.compile`` with ``fullgraph=True``.

Eagerly :func:`dualvp_torch.logprob_entropy` is a ``torch.autograd.Function``,
and inside a caller's ``torch.compile`` it is one graph break
(``torch.compiler.disable``), which ``fullgraph=True`` refuses. While dynamo
traces, an eligible call (plain tensors, options of their documented Python
types, no ``inplace_grad``) instead becomes one node of the caller's graph::

    dualvp::logprob_entropy_fwd(logits, target, keep_mask, group_name, options...)
        -> logprob, entropy, and the O(T) residuals (local, owns, valid, M, log_s, c, mk, log_sk)
    dualvp::logprob_entropy_bwd(logits, keep_mask, residuals..., grad_logprob, grad_entropy, options...)
        -> the gradient of the logits

with the backward registered through ``register_autograd``. Each runs the
eager op's own code: ``function._validated`` (the checks and, with a group,
the agreement step), ``function._forward`` and ``function._grad``. Values,
gradients, errors and collectives are those of an eager call, and the
compiler sees the ops as opaque. The group goes by name (a custom op takes
no ``ProcessGroup``) and is resolved in the op; the residuals are O(T)
copies (the outputs of a custom op may not alias one another). Anything
else (DTensor, ``inplace_grad=True``, arguments of other types, which the
eager checks then reject with their usual errors) keeps the graph break.

On the Triton path (``impl="triton"``, or ``None`` on the device types of
``tuning.Tuning.triton_default_devices``) the call becomes ``dualvp::logprob_entropy_triton_fwd``
(-> logprob, entropy, the merge kernel's residuals ``[5, T]``) and its
backward ``dualvp::logprob_entropy_triton_bwd`` (one launch) instead: the
same cached checks and kernels as the eager call; with ``validate=False``
no synchronisation and no data-dependent allocation, so a caller's CUDA
graph (``mode="reduce-overhead"``) can capture them.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from dualvp import validation

from . import collectives, kernels
from . import function as _function

__all__ = ["eligible", "logprob_entropy"]


def _group(name: str):
    if not name:
        return None
    return torch.distributed.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("dualvp::logprob_entropy_fwd", mutates_args=())
def _fwd(
    logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], group_name: str, temperature: float,
    with_entropy: bool, entropy_grad: bool, ignore_index: int, validate: bool, impl: str,
) -> list[Tensor]:
    group = _group(group_name)
    opt = _function._validated(
        logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=False,
        impl=impl or None,
    )
    logprob, entropy, local, owns, valid, comb = _function._forward(logits, target, keep_mask, opt, group, impl or None)
    # O(T) each; cloned because the statistics are views of one tensor
    return [t.clone() for t in (logprob, entropy, local, owns, valid, *comb[:5])]


@_fwd.register_fake
def _fwd_fake(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
              validate, impl):
    cdt = kernels.compute_dtype(logits.dtype)
    rows = (target.numel(),)
    return [logits.new_empty(target.shape, dtype=cdt), logits.new_empty(target.shape, dtype=cdt),
            logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.bool),
            logits.new_empty(rows, dtype=torch.bool)] + [logits.new_empty(rows, dtype=cdt) for _ in range(5)]


@torch.library.custom_op("dualvp::logprob_entropy_bwd", mutates_args=())
def _bwd(
    logits: Tensor, keep_mask: Optional[Tensor], local: Tensor, owns: Tensor, valid: Tensor, M: Tensor,
    log_s: Tensor, c: Tensor, mk: Tensor, log_sk: Tensor, grad_logprob: Tensor, grad_entropy: Tensor,
    temperature: float, with_entropy: bool, entropy_grad: bool, impl: str,
) -> Tensor:
    opt = validation.Options(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
    return _function._grad(logits, keep_mask, local, owns, valid, M, log_s, c, mk, log_sk, grad_logprob,
                           grad_entropy, opt, impl or None)


@_bwd.register_fake
def _bwd_fake(logits, *rest):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, _, keep_mask, _, temperature, with_entropy, entropy_grad, _, _, impl = inputs
    ctx.save_for_backward(logits, keep_mask, *output[2:])
    ctx.options = (temperature, with_entropy, entropy_grad, impl)


def _upstream(grads) -> tuple:
    # (g_logprob, g_entropy): an output that does not reach the loss arrives as None, a zero here
    g_logprob, g_entropy = grads[0], grads[1]
    g_logprob = torch.zeros_like(g_entropy) if g_logprob is None else g_logprob
    g_entropy = torch.zeros_like(g_logprob) if g_entropy is None else g_entropy
    return g_logprob, g_entropy


def _backward(ctx, grads):
    g = _bwd(*ctx.saved_tensors, *_upstream(grads), *ctx.options)
    return (g,) + (None,) * 9


_fwd.register_autograd(_backward, setup_context=_setup_context)


# --- the Triton path (impl="triton"; impl=None on Tuning.triton_default_devices) ----------------
#
# dualvp::logprob_entropy_triton_fwd -> logprob, entropy, res [5, T] (the merge kernel's residuals)
# dualvp::logprob_entropy_triton_bwd -> the gradient of the logits (one launch)
# Each runs triton_kernels.logits_op: the cached checks and plan, the kernels, with a group its
# collectives. With validate=False neither synchronises nor allocates by data: a caller's CUDA graph
# can capture them.


def _triton_plan(logits, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index, validate):
    from .triton_kernels import logits_op

    return logits_op.checked_plan(logits, target, keep_mask, group, temperature, with_entropy, entropy_grad,
                                  ignore_index, validate, False, "triton")


@torch.library.custom_op("dualvp::logprob_entropy_triton_fwd", mutates_args=())
def _tfwd(
    logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], group_name: str, temperature: float,
    with_entropy: bool, entropy_grad: bool, ignore_index: int, validate: bool,
) -> list[Tensor]:
    from .triton_kernels import logits_op

    group = _group(group_name)
    plan = _triton_plan(logits, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index,
                        validate)
    logprob, entropy, res = logits_op.forward(logits, target, keep_mask, plan, group)
    return [logprob.view(target.shape), entropy.view(target.shape), res]


@_tfwd.register_fake
def _tfwd_fake(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
               validate):
    cdt = kernels.compute_dtype(logits.dtype)
    return [logits.new_empty(target.shape, dtype=cdt), logits.new_empty(target.shape, dtype=cdt),
            logits.new_empty((5, target.numel()), dtype=cdt)]


@torch.library.custom_op("dualvp::logprob_entropy_triton_bwd", mutates_args=())
def _tbwd(
    logits: Tensor, target: Tensor, keep_mask: Optional[Tensor], res: Tensor, grad_logprob: Tensor,
    grad_entropy: Tensor, group_name: str, temperature: float, with_entropy: bool, entropy_grad: bool,
    ignore_index: int,
) -> Tensor:
    from .triton_kernels import logits_op

    plan = _triton_plan(logits, target, keep_mask, _group(group_name), temperature, with_entropy, entropy_grad,
                        ignore_index, False)
    z = logits.reshape(-1, plan.V)
    keep = None if keep_mask is None else keep_mask.reshape(-1, plan.V).view(torch.uint8)
    ge = grad_entropy.reshape(-1) if plan.need_entropy_grad else None
    return logits_op.grad(z, target.reshape(-1), keep, res, grad_logprob.reshape(-1), ge, plan).view(logits.shape)


@_tbwd.register_fake
def _tbwd_fake(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _tsetup_context(ctx, inputs, output):
    logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, _ = inputs
    ctx.save_for_backward(logits, target, keep_mask, output[2])
    ctx.options = (group_name, temperature, with_entropy, entropy_grad, ignore_index)


def _tbackward(ctx, grads):
    g = _tbwd(*ctx.saved_tensors, *_upstream(grads), *ctx.options)
    return (g,) + (None,) * 8


_tfwd.register_autograd(_tbackward, setup_context=_tsetup_context)


def eligible(logits, target, *, group=None, keep_mask=None, temperature=1.0, with_entropy=True,
             entropy_grad=True, ignore_index=-100, validate=True, inplace_grad=False, impl=None) -> bool:
    """Whether :func:`logprob_entropy` can take this call (else: one graph break, the eager op)."""
    return (
        type(logits) is Tensor and type(target) is Tensor and (keep_mask is None or type(keep_mask) is Tensor)
        and (group is None or collectives.is_process_group(group))
        and isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
        and all(isinstance(x, bool) for x in (with_entropy, entropy_grad, validate))
        and isinstance(ignore_index, int) and not isinstance(ignore_index, bool)
        and inplace_grad is False and (impl is None or isinstance(impl, str))
    )


def logprob_entropy(logits, target, *, group=None, keep_mask=None, temperature=1.0, with_entropy=True,
                    entropy_grad=True, ignore_index=-100, validate=True, inplace_grad=False, impl=None):
    """:func:`dualvp_torch.logprob_entropy` through the custom ops (an :func:`eligible` call)."""
    if impl == "triton" or impl is None and _function._triton_by_default(logits):
        out = _tfwd(logits, target, keep_mask, "" if group is None else group.group_name, float(temperature),
                    with_entropy, entropy_grad, ignore_index, validate)
    else:
        out = _fwd(logits, target, keep_mask, "" if group is None else group.group_name, float(temperature),
                   with_entropy, entropy_grad, ignore_index, validate, impl or "")
    logprob, entropy = out[0], out[1]
    if not with_entropy:
        return logprob, None
    return logprob, (entropy if entropy_grad else entropy.detach())


_function._IN_GRAPH[_function.logprob_entropy.__wrapped__] = (eligible, logprob_entropy)
