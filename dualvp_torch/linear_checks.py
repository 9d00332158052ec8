"""Argument checks of the fused LM-head op (:func:`dualvp_torch.linear_logprob_entropy`).

Local checks (types, shapes, dtypes, devices, the options of the fused op),
then, with a group and ``validate=True``, the cross-rank agreement: every
rank returns the same options or every rank raises, before any collective of
the op can hang.
"""

from __future__ import annotations

import torch

from dualvp import validation

from . import agreement, collectives, linear_triton
from .function import _check_call, _check_target_keep, _count_bad_targets, _dtype_name

__all__ = ["IMPLS", "checked_options"]

#: ``impl`` values of the fused op: the torch tile path's spec stages
#: (``"compiled"``, ``"eager"``) or the fused Triton kernels.
IMPLS = ("compiled", "eager", "triton")


def _check_fused_options(hidden, impl, allow_tf32) -> None:
    if not isinstance(allow_tf32, bool):
        raise TypeError(f"allow_tf32: expected a bool, got {type(allow_tf32).__name__} {allow_tf32!r}")
    if impl == "triton":
        if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"impl: 'triton' takes float32, bfloat16 or float16 hidden states, got {hidden.dtype}")
        reason = linear_triton.unavailable(hidden.device)
        if reason is not None:
            raise ValueError(f"impl: 'triton' {reason}")


def _local_checks(hidden, weight, target, keep_mask, world, kw) -> validation.Options:
    target_keep = _check_target_keep(
        ("hidden", hidden, "a torch.Tensor [..., H] of a floating dtype"),
        ("weight", weight, "a torch.Tensor [V_local, H] of hidden's dtype"),
        target=target,
        keep_mask=keep_mask,
    )
    opt = validation.check_linear_args(
        hidden_shape=tuple(hidden.shape),
        hidden_dtype=_dtype_name(hidden.dtype),
        weight_shape=tuple(weight.shape),
        weight_dtype=_dtype_name(weight.dtype),
        **target_keep,
        world_size=world,
        **kw,
    )
    for name, x in (("weight", weight), ("target", target), ("keep_mask", keep_mask)):
        if x is not None and x.device != hidden.device:
            raise ValueError(f"{name}: expected a tensor on hidden's device {hidden.device}, got device {x.device}")
    return opt


def checked_options(hidden, weight, target, keep_mask, *, group, validate, impl, allow_tf32, kw) -> validation.Options:
    """The options of a call, after the local checks and (with a group and ``validate``) the agreement.

    ``kw``: the op's keyword arguments that :func:`validation.check_linear_args` takes.
    """
    rank, world = _check_call(group, validate, None)  # group, validate (the same on every rank)
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl: expected None or one of {IMPLS}, got {impl!r}")
    error = opt = None
    try:
        opt = _local_checks(hidden, weight, target, keep_mask, world, kw)
        _check_fused_options(hidden, impl, allow_tf32)
    except (TypeError, ValueError) as exc:
        error = exc

    fields = validation.LINEAR_RECORD_FIELDS
    if validate and group is not None:
        if error is None:
            grad_on = torch.is_grad_enabled()
            record = validation.agreement_record(
                error=None,
                n_rows=target.numel(),
                v_local=weight.shape[0],
                logits_dtype=_dtype_name(hidden.dtype),
                options=opt,
                fused=True,
                hidden_size=hidden.shape[-1],
                hidden_rows=hidden.numel() // max(1, hidden.shape[-1]),
                hidden_requires_grad=grad_on and hidden.requires_grad,
                weight_requires_grad=grad_on and weight.requires_grad,
            )
            bad = _count_bad_targets(target, kw["ignore_index"], world * weight.shape[0])
            device = collectives.comm_device(group, hidden)
        else:
            record = validation.agreement_record(error=error, fused=True)
            bad = None
            device = collectives.comm_device(group, hidden if isinstance(hidden, torch.Tensor) else None)
        agreement.gather_checked(  # + fingerprints of target and replicated hidden
            record, bad, group, device, target=target, fused=True, rank=rank, local_error=error, fields=fields,
            hidden=None if error or opt.sequence_parallel else hidden,
            vocab_size=None if error else world * weight.shape[0],
        )
    else:
        if error is not None:
            raise error
        if validate and target.numel():
            record = [0] * len(fields)
            record[-1] = int(_count_bad_targets(target, kw["ignore_index"], world * weight.shape[0]))  # the one sync
            validation.check_agreement([record], rank=0, vocab_size=world * weight.shape[0], fields=fields)
    return opt
