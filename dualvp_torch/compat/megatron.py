"""Drop-in for megatron-core's ``vocab_parallel_cross_entropy``.

``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target,
label_smoothing=0.0, tp_group=None)``: same positional order, same per-token loss (label smoothing
included).

``tp_group=None`` resolves as megatron-core does where it can: megatron-core's tensor-parallel group when
its parallel state is initialised (``megatron.core.parallel_state``; looked up only if that module is
already imported, so megatron-core stays optional); otherwise a ``ValueError`` when ``torch.distributed``
has more than one rank (the world group is never assumed: with pipeline or data parallelism it is the
wrong group and the loss would be silently wrong); otherwise (no ``torch.distributed``, or a 1-rank
world) unsharded.

Output dtype: float32, megatron-core's (float64 for float64 logits: computed and kept in float64, a
deliberate difference; there is no 16-bit output to switch off).

Known, deliberate differences from the original: the input logits are never modified (Megatron's
function overwrites float32 logits in place); a target equal to ``-100`` gives loss 0 and no gradient
(megatron-core treats it like any id outside the shard: loss ``logsumexp``), and every other id outside
``[0, V)`` raises ``ValueError`` on every rank instead of giving a meaningless number.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dualvp import spec

from .. import checks, library
from .. import dtensor as _dtensor
from ..compiled import one_graph_break
from ..function import logprob_entropy
from ..function import logprob_entropy_or_raise as _logprob_entropy_or_raise
from ..stages import compute_dtype, xp
from ._core import IGNORE_INDEX as _IGNORE_INDEX
from ._core import argument_names as _argument_names
from ._core import resolve_megatron_group as _resolve_megatron_group

__all__ = ["vocab_parallel_cross_entropy"]


def _check_label_smoothing(label_smoothing) -> float:
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(
            "label_smoothing: expected a float in [0, 1) (megatron-core's 3rd positional argument; "
            f"the group goes in tp_group=), got {checks.kind(label_smoothing)}"
        )
    value = float(label_smoothing)
    if not (0.0 <= value < 1.0):  # also rejects NaN
        raise ValueError(f"label_smoothing: expected a float in [0, 1), got {value!r}")
    return value


@one_graph_break
def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group=None,
) -> torch.Tensor:
    """megatron-core's ``vocab_parallel_cross_entropy``: the per-token loss.

    Without smoothing the loss is ``-log p_y`` (``p = softmax`` over the whole
    vocabulary ``V = W * V_local``). With ``label_smoothing = a > 0`` it is
    the cross-entropy against the smoothed target distribution
    ``(1 - a)`` on ``y`` and ``a / (V - 1)`` on every other id, which
    megatron-core writes as ``(1 - s) * (-log p_y) - s * mean_v log p_v`` with
    ``s = a * V / (V - 1)``; here as ``-log p_y + s * (z_y - mean_v z_v)``
    (equal, since ``log p_v = z_v - logsumexp z``), whose extra O(T)
    statistic is summed over the group with one all-reduce. The gradient is
    ``p_v - (1 - s) [v = y] - s / V``, as in megatron-core's backward.

    Under tensor parallelism ``V`` and the mean are over the *whole*
    vocabulary. megatron-core (through at least 0.16) uses the local shard
    for both when ``label_smoothing > 0`` and ``TP > 1`` (NVIDIA/Megatron-LM
    issues #737 and #7464), giving a different loss on every rank; at
    ``TP = 1`` the two agree.

    Args:
      vocab_parallel_logits: ``[..., V_local]`` (Megatron: ``[s, b, V/W]``);
        rank ``r`` of the group holds ids ``[r * V_local, (r+1) * V_local)``.
      target: ``[...]`` global token ids; ``-100`` gives loss 0 and no gradient.
      label_smoothing: a float in ``[0, 1)``; must be equal on every rank.
      tp_group: the tensor-parallel group. ``None``: megatron-core's
        tensor-parallel group if its parallel state is initialised, else
        unsharded when ``torch.distributed`` is absent or has one rank, else
        ``ValueError`` (never the world group; see the module docstring).

    Returns:
      ``[...]`` float32 loss (float64 for float64 logits); the input is never
      modified.

    Raises:
      TypeError / ValueError naming the argument (``tp_group``,
      ``label_smoothing``, ``logits``, ``target``, ...), on every rank.
    """
    group = _resolve_megatron_group(tp_group)
    try:
        smoothing, error = _check_label_smoothing(label_smoothing), None
    except (TypeError, ValueError) as exc:  # raised through the agreement step: on every rank, no hang
        smoothing, error = 0.0, exc
    with _argument_names(logits="vocab_parallel_logits"):
        if _dtensor.involves_dtensor(vocab_parallel_logits, target, None):
            if error is not None or smoothing:
                raise error or ValueError(
                    "label_smoothing: not supported for DTensor logits yet (got "
                    f"{smoothing!r}); pass the local shard and tp_group, or label_smoothing=0.0"
                )
            log_prob, _ = logprob_entropy(vocab_parallel_logits, target, with_entropy=False, ignore_index=_IGNORE_INDEX)
            return -log_prob
        if smoothing == 0.0 or not isinstance(vocab_parallel_logits, torch.Tensor):
            # (anything but a tensor raises here, on every rank)
            log_prob, _ = _logprob_entropy_or_raise(
                vocab_parallel_logits, target, caller_error=error, **_megatron_options(group)
            )
            return -log_prob
        needs_grad = torch.is_grad_enabled() and vocab_parallel_logits.requires_grad
        return _SmoothedCrossEntropy.apply(vocab_parallel_logits, target, group, smoothing, needs_grad)


#: Elements per row chunk of :func:`_row_sums` on CPU (a float32 chunk is 4 MiB) ...
_SUM_CHUNK_ELEMENTS = 1 << 20
#: ... and at most this fraction of the rows, so that the float32 copy of a chunk stays small next to B.
_SUM_CHUNK_FRACTION = 1 / 32


def _row_sums(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T]`` sums of ``z [T, V_local]`` over the vocabulary, accumulated in ``dtype``.

    On CPU, ``sum(dtype=float32)`` of 16-bit input first copies the whole
    input to float32 (twice the shard's bytes), so it runs over row chunks;
    CUDA's reduction casts on load and needs no chunking.
    """
    if z.dtype == dtype or z.device.type != "cpu":
        return z.sum(dim=-1, dtype=dtype)
    step = max(1, min(_SUM_CHUNK_ELEMENTS // max(1, z.shape[-1]), math.ceil(z.shape[0] * _SUM_CHUNK_FRACTION)))
    out = torch.empty(z.shape[0], dtype=dtype, device=z.device)
    for i in range(0, z.shape[0], step):
        torch.sum(z[i : i + step], dim=-1, dtype=dtype, out=out[i : i + step])
    return out


def _megatron_options(group) -> dict:
    # the op's keywords for megatron-core's loss (no keep mask)
    return dict(
        group=group, temperature=1.0, with_entropy=False, entropy_grad=True, ignore_index=_IGNORE_INDEX,
        validate=True, inplace_grad=False, impl=None,
    )


class _SmoothedCrossEntropy(torch.autograd.Function):
    """``-log p_y + s * (z_y - mean_v z_v)`` with ``s = a V / (V - 1)``; see :func:`vocab_parallel_cross_entropy`.

    The log-prob and its gradient are :func:`logprob_entropy`'s own: the
    checked call of :func:`dualvp_torch.checks.logits_call` (with
    ``label_smoothing`` in the agreement record: ranks that disagree on it,
    of which only the smoothed ones would enter the extra all-reduce, raise
    instead of hanging), then :func:`dualvp_torch.library.forward` (engine,
    agreement, gather, merge) and :func:`dualvp_torch.library.grad` from the
    row statistics ``res [5, T]``, saved with ``save_for_backward`` so that
    activation checkpointing drops and recomputes them as for the op. The
    smoothing term is linear in the logits, so its gradient
    ``s * g * ([v = y] - 1/V)`` is added in place to the op's gradient: the
    backward's peak stays one gradient buffer, as without smoothing (the op
    plus an autograd-traced linear term would sum two ``[T, V_local]``
    gradients).
    """

    @staticmethod
    def forward(ctx, logits, target, group, smoothing, needs_grad):
        call = checks.logits_call(logits, target, None, label_smoothing=smoothing, **_megatron_options(group))
        # checked on every rank; library.forward runs the agreement before any other collective
        log_prob, _, res = library.forward(logits, target, None, call, group)
        vocab, v_local = call.vocab, call.v_local
        if vocab < 2:
            raise ValueError(
                f"label_smoothing: needs a vocabulary of at least 2 ids, got V = {vocab} "
                f"(logits of shape {tuple(logits.shape)} on {call.world} rank(s))"
            )
        valid, owns, local = _rows(target, call)
        z = logits.detach().reshape(-1, v_local)
        cdt = compute_dtype(logits.dtype)
        z_y = torch.gather(z, 1, local[:, None])[:, 0].to(cdt)
        # this shard's part of z_y - mean_v z_v (z_y lives on one shard only)
        part = torch.where(owns, z_y, torch.zeros_like(z_y)) - _row_sums(z, cdt) / vocab
        if group is not None:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        s = smoothing * vocab / (vocab - 1)
        extra = torch.where(valid, part, torch.zeros_like(part)).reshape(log_prob.shape)
        loss = -log_prob + s * extra
        ctx.s, ctx.call = s, call
        if needs_grad:
            ctx.save_for_backward(logits, target, res)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        saved = ctx.saved_tensors  # once: under activation checkpointing a second unpack is an error
        if not saved:
            return None, None, None, None, None
        logits, target, res = saved
        call = ctx.call
        grad = library.grad(logits, target, None, res, -grad_loss, None, call)
        valid, owns, local = _rows(target, call)
        g = grad_loss.reshape(-1).to(compute_dtype(grad.dtype))
        g = torch.where(valid, g, torch.zeros_like(g))
        g2 = grad.view(-1, grad.shape[-1])
        # + s * g * [v = y] on the shard that owns y, then - s * g / V everywhere (in place: no 2nd buffer).
        # gather + index_copy_ into the flat view rather than scatter_add_ / scatter_: on CPU both work
        # on a float32 copy of the whole 16-bit gradient (2 B for bfloat16). One element per row, summed
        # in the compute dtype and rounded once.
        bump = ctx.s * torch.where(owns, g, torch.zeros_like(g))
        flat = torch.arange(g2.shape[0], device=g2.device) * g2.shape[1] + local
        new = (g2.view(-1).gather(0, flat).to(bump.dtype) + bump).to(g2.dtype)
        g2.view(-1).index_copy_(0, flat, new)
        g2.sub_(((ctx.s / call.vocab) * g).to(g2.dtype)[:, None])  # same dtype: no full-size temporary
        return grad, None, None, None, None


def _rows(target: torch.Tensor, call: checks.Call) -> tuple:
    """``(valid, owns, local)`` [T] of the global ids ``target`` on this rank's shard (``spec.target_to_local``)."""
    return spec.target_to_local(xp, target.reshape(-1).to(torch.int64), call.rank, call.v_local,
                                call.opt.ignore_index)
