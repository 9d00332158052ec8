"""Drop-ins for NeMo-RL's vocab-parallel autograd functions (``nemo_rl/distributed/model_utils.py``).

Same call as NeMo-RL's (``.apply`` with the same positional arguments)::

    DistributedLogprob.apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group,
                             inference_only=False)                                 -> [B, S] log-probs
    ChunkedDistributedLogprob.apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                    chunk_size, tp_group, inference_only=False)    -> [B, S] log-probs
    ChunkedDistributedGatherLogprob.apply(vocab_parallel_logits, global_indices [B, S, K],
                                          vocab_start_index, vocab_end_index, chunk_size, tp_group,
                                          inference_only=False)                    -> [B, S, K] log-probs
    ChunkedDistributedEntropy.apply(vocab_parallel_logits, chunk_size, tp_group,
                                    inference_only=False)                          -> [B, S] sum_v p log p

``ChunkedDistributedEntropy`` returns ``sum_v p_v log p_v``, i.e. MINUS the entropy, as NeMo-RL's does.

Contract (checked): rank ``r`` of the group holds the contiguous shard ``[vocab_start_index,
vocab_end_index) = [r * V_local, (r + 1) * V_local)`` (NeMo-RL's layout); ``group=None`` means
unsharded. ``inference_only=True`` returns results without gradient and saves nothing, as NeMo-RL's.
``chunk_size`` is accepted (an int >= 1) and not used: the op needs no ``[T, V_local]`` scratch, so the
results are identical for every value.

Output dtype: float32, NeMo-RL's (float64 for float64 logits, kept in float64: deliberate). The
gradient reaches the logits in their dtype.

Deliberate differences: a target outside ``[0, V)`` raises ``ValueError`` on every rank (NeMo-RL gives 0,
since the id lies on no shard), except ``-100``, which gives 0 and no gradient as there. Bad
``vocab_start_index`` / ``vocab_end_index`` raise on every rank. The logits are never modified.

``ChunkedDistributedGatherLogprob`` (``K`` ids per position) runs the core op's K-target pass
(``dualvp_torch.function.logprobs_k``: one pass, one statistics all-gather whatever ``K``); a ``-100`` id gives 0 at its
own position only.
"""

from __future__ import annotations

import contextlib
import numbers

import torch

from .. import collectives
from ..checks import kind
from ..function import entropy_only, logprob_entropy_or_raise, logprobs_k
from ._core import IGNORE_INDEX, argument_names, check_chunk_size, check_flag

__all__ = ["DistributedLogprob", "ChunkedDistributedLogprob", "ChunkedDistributedGatherLogprob",
           "ChunkedDistributedEntropy"]

_NAMES = {"logits": "vocab_parallel_logits"}


def _range_error(logits, start, end, group):
    """The error of a bad ``[vocab_start_index, vocab_end_index)``, or ``None`` (rank-local; it goes
    through the op's agreement step so that every rank raises)."""
    for name, v in (("vocab_start_index", start), ("vocab_end_index", end)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            return TypeError(f"{name}: expected an int, got {kind(v)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return None  # the op names the logits
    rank, _ = collectives.group_rank_world(group)
    v_local = logits.shape[-1]
    if (int(start), int(end)) != (rank * v_local, (rank + 1) * v_local):
        return ValueError(
            f"vocab_start_index: expected the contiguous shard [rank * V_local, (rank + 1) * V_local) = "
            f"[{rank * v_local}, {(rank + 1) * v_local}) on rank {rank} (V_local = {v_local}), got "
            f"[{start}, {end})"
        )
    return None


def _check_group(group, name):
    if group is not None and not collectives.is_process_group(group):
        raise TypeError(f"{name}: expected a torch.distributed.ProcessGroup or None, got {kind(group)}")
    return group


def _grad_mode(inference_only):
    check_flag(inference_only, "inference_only")
    return torch.no_grad() if inference_only else contextlib.nullcontext()


def _logprob(logits, target, start, end, group, inference_only, group_name):
    _check_group(group, group_name)
    error = _range_error(logits, start, end, group)
    with _grad_mode(inference_only), argument_names(**_NAMES):
        lp, _ = logprob_entropy_or_raise(
            logits, target, group=group, keep_mask=None, temperature=1.0, with_entropy=False, entropy_grad=True,
            ignore_index=IGNORE_INDEX, validate=True, inplace_grad=False, impl=None, caller_error=error,
        )
    return lp


class DistributedLogprob:
    """NeMo-RL's ``DistributedLogprob``: ``.apply(vocab_parallel_logits [B, S, V_local], target [B, S],
    vocab_start_index, vocab_end_index, group, inference_only=False)`` -> ``[B, S]`` float32 log-probs."""

    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        return _logprob(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only,
                        "group")


class ChunkedDistributedLogprob:
    """NeMo-RL's ``ChunkedDistributedLogprob``: ``.apply(vocab_parallel_logits, target, vocab_start_index,
    vocab_end_index, chunk_size, tp_group, inference_only=False)`` -> ``[B, S]`` float32 log-probs."""

    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
              inference_only=False):
        check_chunk_size(chunk_size)
        return _logprob(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                        inference_only, "tp_group")


class ChunkedDistributedGatherLogprob:
    """NeMo-RL's ``ChunkedDistributedGatherLogprob``: ``.apply(vocab_parallel_logits [B, S, V_local],
    global_indices [B, S, K], vocab_start_index, vocab_end_index, chunk_size, tp_group,
    inference_only=False)`` -> ``[B, S, K]`` float32 log-probs.

    The core op's K-target pass: one pass over the logits, one statistics all-gather whatever ``K``.
    """

    @staticmethod
    def apply(vocab_parallel_logits, global_indices, vocab_start_index, vocab_end_index, chunk_size, tp_group,
              inference_only=False):
        check_chunk_size(chunk_size)
        _check_group(tp_group, "tp_group")
        error = _range_error(vocab_parallel_logits, vocab_start_index, vocab_end_index, tp_group)
        if error is not None:
            # raise on every rank: the agreement step of one op call carries the error
            with argument_names(**_NAMES):
                logprob_entropy_or_raise(
                    vocab_parallel_logits, torch.zeros(0, dtype=torch.int64), group=tp_group, keep_mask=None,
                    temperature=1.0, with_entropy=False, entropy_grad=True, ignore_index=IGNORE_INDEX,
                    validate=True, inplace_grad=False, impl=None, caller_error=error,
                )
        with _grad_mode(inference_only):
            return logprobs_k(
                vocab_parallel_logits, global_indices, group=tp_group, ignore_index=IGNORE_INDEX,
                names={"logits": "vocab_parallel_logits", "target": "global_indices"},
            )


class ChunkedDistributedEntropy:
    """NeMo-RL's ``ChunkedDistributedEntropy``: ``.apply(vocab_parallel_logits [B, S, V_local], chunk_size,
    tp_group, inference_only=False)`` -> ``[B, S]`` float32 ``sum_v p_v log p_v`` (MINUS the entropy, as
    NeMo-RL's)."""

    @staticmethod
    def apply(vocab_parallel_logits, chunk_size, tp_group, inference_only=False):
        check_chunk_size(chunk_size)
        _check_group(tp_group, "tp_group")
        with _grad_mode(inference_only):
            return -entropy_only(vocab_parallel_logits, group=tp_group, names=_NAMES)
