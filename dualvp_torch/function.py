"""The public logits op, :func:`logprob_entropy`: checks, then the custom op of :mod:`dualvp_torch.library`.

One call, whatever the engine (``group`` with ``W`` ranks; ``T`` rows; shard ``V_local``)::

    DTensor logits           dtensor.logprob_entropy unwraps them and calls the local op below
    the op as is             arguments of the op's schema types (op_library.eligible)
    library.logprob_entropy  other argument types: checks.logits_call first, then the op
    dualvp::logprob_entropy_fwd   the op (library): checks.logits_call (cached per call metadata), the
                             engine (engines.select); engine stats [T, V_local] -> [T, 6]; validate=True:
                             the agreement ([W, 10] int64, 1 host sync); all-gather -> [W, T, 6];
                             merge -> logprob, entropy, res [5, T] (identical on every rank)
    dualvp::logprob_entropy_bwd   (autograd) engine grad [T, V_local] -> gradient (no collective)

Inside a caller's ``torch.compile`` an eligible call (plain tensors, options
of their documented Python types, ``inplace_grad`` included) goes to the custom
op directly, which runs the same checks in its body: one node of the caller's
graph (``fullgraph=True`` holds). With ``inplace_grad=True`` the backward graph
holds the in-place backward op on the saved logits: inductor runs it in place
(logits that are an input of the compiled function hold the gradient after
backward, and another node that saved them raises the "modified by an inplace
operation" error, as eagerly); AOTAutograd's functionalization without
inductor (``backend="aot_eager"``) writes it into a copy instead (same values,
the memory of a fresh gradient). Anything else (DTensor, arguments of other
types) runs as one graph break.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch


from . import checks, library, op_library
from . import dtensor as _dtensor
from . import extended as _extended_op
from .checks import argument_names, kind
from .engine_names import Engine

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["logprob_entropy", "logprob_entropy_or_raise", "logprobs_k", "sum_pi_squared", "entropy_only"]

#: The logits op (:mod:`dualvp_torch.library` registers it): an eligible call runs it as it is.
_FWD = torch.ops.dualvp.logprob_entropy_fwd.default

#: The ignore id of the calls below that fill a target (the op's default ``ignore_index``).
IGNORE_INDEX = -100


def logprob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: Optional[ProcessGroup] = None,
    keep_mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    validate: bool = True,
    inplace_grad: bool = False,
    impl: Optional[Engine] = None,
    keep_ids: Optional[torch.Tensor] = None,
    multi_target: bool = False,
    with_sum_p2: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of the target and entropy from vocab-sharded logits.

    Args:
      logits: ``[..., V_local]`` this rank's contiguous vocab shard (float32,
        bfloat16, float16 or float64), or a DTensor ``[..., V]`` whose
        vocabulary is ``Shard(-1)`` (:mod:`dualvp_torch.dtensor`). Rank ``r``
        of a ``W``-rank ``group`` owns the global columns
        ``[r*V_local, (r+1)*V_local)``.
      target: ``[...]`` integer *global* token ids (same leading shape).
      group: a ``torch.distributed.ProcessGroup`` that shards the vocabulary,
        or ``None`` (unsharded: no collectives at all).
      keep_mask: ``[..., V_local]`` bool, the tokens the sampler kept (top-p /
        top-k replay). The log-prob is under the distribution renormalised over
        ``keep_mask`` plus the target (always kept); the entropy is unmasked.
      keep_ids: ``[..., K]`` integer *global* token ids (padding -1), the
        kept set as the sampler returns it: the alternative to ``keep_mask``
        with its semantics (never both). The same tensor on every rank; each
        rank uses the ids in its shard; a repeated id counts once. Memory
        O(T K): no ``[..., V_local]`` mask is built (every engine runs
        unmasked, the kept set's part is a gather and a scatter of ``K + 1``
        columns per row beside it, :mod:`dualvp_torch.keep_ids`). With
        ``validate=True`` ids outside ``[0, V)`` other than -1 raise
        ``ValueError`` on every rank (one host sync more); with
        ``validate=False`` they lie in no shard and are ignored. With
        ``multi_target``, ``with_sum_p2`` or a temperature tensor as well
        (O(T K) beside the unmasked engine, :mod:`dualvp_torch.extended`).
      temperature: ``tau > 0``; the op uses ``softmax(logits / tau)`` without
        an extra buffer. A number, or a floating tensor broadcastable to the
        rows ``[...]`` (one temperature per row, e.g. verl's per-token
        temperature; the same on every rank), treated as a constant (no
        gradient flows to it); ``validate=True`` checks its values are finite
        and > 0 (one more host sync), else such rows give NaN.
      with_entropy: ``False`` returns ``None`` for the entropy (it costs
        nothing extra either way: the statistics are shared).
      entropy_grad: ``False`` returns the entropy with ``requires_grad=False``
        and keeps nothing alive for its gradient.
      ignore_index: rows whose target equals it get log-prob 0 and no
        log-prob gradient.
      validate: ``True`` checks the arguments, the target range and (with a
        group) that all ranks agree on options and shapes, through one small
        all-gather and one host sync; every rank then raises the same error.
        ``False`` skips the range check and the agreement collective (no sync);
        all ranks must then agree on ``validate`` itself and on every option
        and shape, and out-of-range targets give unspecified results.
        Local argument checks (types, shapes, dtypes) always run; they are
        host-only.
      inplace_grad: ``True`` writes the gradient into the logits' own storage
        in backward (O(T) extra memory instead of ``B``). The logits must be a
        contiguous non-leaf tensor; after backward they hold the gradient.
        If another autograd node saved the same logits, its backward fails
        with torch's "modified by an inplace operation" error instead of
        using overwritten values; modifying the logits between forward and
        backward fails the same way.
      impl: the engine (:mod:`dualvp_torch.engines`): ``"compiled"`` (the
        spec stages under ``torch.compile``), ``"eager"`` (the same op by
        op, no compiler) or ``"triton"`` (hand-written kernels: CUDA tensors,
        or CPU tensors under ``TRITON_INTERPRET=1``); ``None``: ``"triton"``
        on the device types of ``tuning.Tuning.triton_default_devices`` (none
        by default) when the ``triton`` package is installed, else
        ``DUALVP_COMPILE`` selects ``"compiled"`` (unset) or ``"eager"`` (0).
        ``multi_target``, ``with_sum_p2`` and a temperature tensor run on
        every engine; ``impl=None`` does not choose ``"triton"`` for them
        (not yet measured on a GPU): pass ``impl="triton"``.
      multi_target: ``True``: ``target`` is ``[..., K]`` (K >= 1 ids per row)
        and the log-prob ``[..., K]``, in ONE pass and one collective round
        whatever K (the row statistics are shared). Under ``keep_mask`` each
        target is kept for its own log-prob (target k's distribution is
        renormalised over the mask plus ``y_k``). The gradient is that of
        ``sum_k gL_k log p_k`` plus the entropy's.
      with_sum_p2: ``True``: a third output ``sum_v p_v^2`` ``[...]`` (verl's
        optimal-token baseline), from one more row statistic in the same
        collective round; differentiable (``2 p_v (p_v - S) / tau``).

    Returns:
      ``(logprob [...], entropy [...] or None)``, float32 (float64 for
      float64 input); ``logprob`` is ``[..., K]`` with ``multi_target``; with
      ``with_sum_p2`` a third output ``sum_p2 [...]``.

    Raises:
      TypeError / ValueError naming the argument for invalid input (with a
      group and ``validate=True``, on every rank, or ``RuntimeError`` on every
      rank when the ranks disagree).

    Example:
      >>> import torch
      >>> from dualvp_torch import logprob_entropy
      >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
      >>> lp, h = logprob_entropy(logits, torch.tensor([1, 0]), impl="eager")
      >>> [round(v, 4) for v in lp.tolist()], [round(v, 4) for v in h.tolist()]
      ([-1.3863, -0.3408], [1.3863, 0.9183])
    """
    if multi_target is False and with_sum_p2 is False and op_library.eligible(
            logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
            entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
            impl=impl, keep_ids=keep_ids):
        # the custom op as is, eagerly and as one node of a caller's graph alike; its body runs the checks
        logprob, entropy, _ = _FWD(logits, target, keep_mask, "" if group is None else group.group_name,
                                   float(temperature), with_entropy, entropy_grad, ignore_index, validate,
                                   inplace_grad, impl or "", 0.0, keep_ids)
        if not with_entropy:
            return logprob, None
        return logprob, (entropy if entropy_grad else entropy.detach())
    if multi_target is not False or with_sum_p2 is not False or checks.temperature_meta(temperature) is not None:
        kw = dict(group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
                  entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
                  impl=impl, keep_ids=keep_ids, multi_target=multi_target, with_sum_p2=with_sum_p2)
        if _extended_op.eligible(logits, target, **kw):  # the extended custom op as is (one node of a graph)
            return _extended_op.run_op(logits, target, **kw)
        run = torch.compiler.disable(_extended) if torch.compiler.is_compiling() else _extended
        return run(logits, target, group=group, keep_mask=keep_mask, temperature=temperature,
                   with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate,
                   inplace_grad=inplace_grad, impl=impl, multi_target=multi_target, with_sum_p2=with_sum_p2,
                   keep_ids=keep_ids)
    if torch.compiler.is_compiling():
        # outside the graph the call takes the branches below (is_compiling() is False there)
        return torch.compiler.disable(logprob_entropy)(
            logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
            entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
            impl=impl, keep_ids=keep_ids,
        )
    if not (type(logits) is torch.Tensor and type(target) is torch.Tensor
            and (keep_mask is None or type(keep_mask) is torch.Tensor)
            and (keep_ids is None or type(keep_ids) is torch.Tensor)) and \
            _dtensor.involves_dtensor(logits, target, keep_mask, keep_ids):
        return _dtensor.logprob_entropy(  # torch tensor parallelism: see dtensor.py
            logprob_entropy, logits, target, group=group, keep_mask=keep_mask, temperature=temperature,
            with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate,
            inplace_grad=inplace_grad, impl=impl, keep_ids=keep_ids,
        )
    # arguments of other types (a 0-d tensor temperature, an int flag, ...): checked, then the op
    return library.logprob_entropy(
        logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad, impl=impl,
        keep_ids=keep_ids,
    )


def _extended(
    logits, target, *, group=None, keep_mask=None, temperature=1.0, with_entropy=True, entropy_grad=True,
    ignore_index=-100, validate=True, inplace_grad=False, impl=None, multi_target=False, with_sum_p2=False,
    label_smoothing: float = 0.0, caller_error: Optional[BaseException] = None, keep_ids=None,
):
    """The call with K targets, a temperature tensor or ``sum_p2``: :mod:`dualvp_torch.extended`."""
    if caller_error is None and _dtensor.involves_dtensor(logits, target, keep_mask, keep_ids, temperature):
        # unwrapped by dtensor.py into this function on the local shards and the vocab mesh dim's group
        return _dtensor.logprob_entropy(
            _extended, logits, target, group=group, keep_mask=keep_mask, temperature=temperature,
            with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate,
            inplace_grad=inplace_grad, impl=impl, multi_target=multi_target, with_sum_p2=with_sum_p2,
            label_smoothing=label_smoothing, keep_ids=keep_ids,
        )
    if caller_error is not None and _dtensor.involves_dtensor(logits, target, keep_mask, keep_ids, temperature):
        raise NotImplementedError(
            "logits: DTensor inputs through this caller's extended options are not supported; "
            "pass the local shard (to_local()) and the vocab mesh dim's group"
        )
    call = checks.logits_call(
        logits, target, keep_mask, group=group, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
        impl=impl, label_smoothing=label_smoothing, caller_error=caller_error, multi_target=multi_target,
        with_sum_p2=with_sum_p2, keep_ids=keep_ids,
    )
    lp, h, p2 = _extended_op.logprob_entropy(logits, target, keep_mask, temperature, call, group, keep_ids)
    return (lp, h, p2) if call.opt.with_sum_p2 else (lp, h)


def _plain(logits, target, keep_mask) -> bool:
    return (type(logits) is torch.Tensor and type(target) is torch.Tensor
            and (keep_mask is None or type(keep_mask) is torch.Tensor))


# --- the calls of the op that the drop-ins share (dualvp_torch.compat) ------------------------------------------
#
# * logprobs_k: ``K`` log-probs per position (TRL's ``index [..., K]``, NeMo-RL's
#   ``ChunkedDistributedGatherLogprob``): ONE call of the op with ``multi_target=True`` (one pass, one
#   statistics all-gather whatever ``K``).
# * sum_pi_squared: ``sum_v p_v^2`` (verl's optimal-token baseline): ONE call with ``with_sum_p2=True``.
# * entropy_only: the entropy, every row's log-prob ignored.
# * logprob_entropy_or_raise: the op, or a drop-in's own argument error raised on every rank.


def logprob_entropy_or_raise(logits, target, *, caller_error: Optional[BaseException] = None, **options):
    """:func:`logprob_entropy`, or a drop-in's own argument error raised on every rank.

    ``caller_error`` (a ``TypeError`` / ``ValueError`` naming the drop-in's
    argument, found before the op runs) goes through the op's check routine
    (:func:`dualvp_torch.checks.logits_call`): with a group and
    ``validate=True`` the agreement all-gather carries it, so every rank
    raises and none waits in a collective. ``options``: the op's keywords.
    """
    if caller_error is None:
        return logprob_entropy(logits, target, **options)
    return library.logprob_entropy(logits, target, caller_error=caller_error, **options)  # raises


def logprobs_k(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    group,
    ignore_index: int,
    temperature: float = 1.0,
    validate: bool = True,
    names: Optional[dict] = None,
) -> torch.Tensor:
    """``[..., K]`` log-probs of the ids ``index [..., K]`` (global) under ``softmax(logits / tau)``.

    ONE call of the core op with ``multi_target=True``: one pass over the logits, one statistics
    all-gather whatever ``K`` (plus the agreement's with ``validate=True``); float32 (float64 for
    float64 logits). An ``ignore_index`` entry gives 0 there (and no gradient); every other id outside
    ``[0, V)`` raises ``ValueError`` on every rank. Gradient: ``sum_k g_k (onehot(y_k) - p) / tau``,
    formed in float32 and rounded once to the logits' dtype.
    """
    names = names or {}
    if _dtensor.is_dtensor(logits) or _dtensor.is_dtensor(index):
        raise TypeError(
            f"{names.get('logits', 'logits')}: DTensor inputs are not supported with several ids per position "
            "yet; pass the local shard and the group"
        )
    if not isinstance(index, torch.Tensor) or index.dim() < 1:
        raise TypeError(f"{names.get('target', 'index')}: expected an integer tensor [..., K], got {kind(index)}")
    with argument_names(**names):
        lp, _ = logprob_entropy(
            logits, index, group=group, keep_mask=None, temperature=temperature, with_entropy=False,
            entropy_grad=True, ignore_index=ignore_index, validate=validate, inplace_grad=False, impl=None,
            multi_target=True,
        )
    return lp


def sum_pi_squared(logits: torch.Tensor, group, name: str = "logits") -> torch.Tensor:
    """``[...]`` ``sum_v softmax(z)_v^2`` over the whole vocabulary from ``logits [..., V_local]``.

    ONE call of the core op with ``with_sum_p2=True`` (one statistics all-gather; every row's log-prob
    ignored), differentiable (``2 p_v (p_v - S)``); float32 (float64 for float64 logits); the input is
    never modified. DTensor logits (vocab ``Shard(-1)``, other mesh dims ``Replicate``) are taken as they
    are: the local shard and the vocab mesh dim's group, never gathered.
    """
    if _dtensor.is_dtensor(logits):
        logits, group = _dtensor.vocab_local(logits)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"{name}: expected a floating torch.Tensor [..., V_local], got {kind(logits)}")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name}: expected a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    target = torch.full(logits.shape[:-1], IGNORE_INDEX, dtype=torch.int64, device=logits.device)
    with argument_names(logits=name):
        _, _, s = logprob_entropy(
            logits, target, group=group, keep_mask=None, temperature=1.0, with_entropy=False, entropy_grad=True,
            ignore_index=IGNORE_INDEX, validate=True, inplace_grad=False, impl=None, with_sum_p2=True,
        )
    return s


def entropy_only(logits, *, group, entropy_grad: bool = True, names: Optional[dict] = None) -> torch.Tensor:
    """``[...]`` entropy of ``softmax(logits)`` over the whole vocabulary (one op call, every row's log-prob
    ignored). DTensor logits are taken as they are (their vocab mesh dim's group; ``group`` must then be
    ``None``); the result is a plain tensor."""
    names = names or {}
    local = logits.to_local() if _dtensor.is_dtensor(logits) else logits
    if not isinstance(local, torch.Tensor) or local.dim() < 1:
        with argument_names(**names):
            raise TypeError(f"logits: expected a torch.Tensor [..., V_local] of a floating dtype, got {kind(logits)}")
    target = torch.full(local.shape[:-1], IGNORE_INDEX, dtype=torch.int64, device=local.device)
    if _dtensor.is_dtensor(logits):
        group = None
    with argument_names(**names):
        _, entropy = logprob_entropy(
            logits, target, group=group, with_entropy=True, entropy_grad=entropy_grad, ignore_index=IGNORE_INDEX
        )
    return _dtensor.replicated_to_plain(entropy)
