"""Drop-ins for verl's per-token functions: the unfused ones, the tensor-parallel ones of its Megatron
engine, and the fused ``linear_cross_entropy``.

Unfused (``verl/utils/torch_functional.py``; verl's FSDP and Automodel engines):

* :func:`logprobs_from_logits` ``(logits, labels, inplace_backward=True)``: the log-prob of each label,
  float32 (the dtype of verl's default flash-attn path; float64 for float64 logits); a label equal to
  ``-100`` gives 0 and no gradient, as flash-attn's cross-entropy; ``inplace_backward=True`` writes the
  gradient into the logits' storage where that is safe (see the function).
* :func:`entropy_from_logits` ``(logits)``, :func:`entropy_from_logits_with_chunking`
  ``(logits, chunk_size=2048)``, :func:`calculate_sum_pi_squared_from_logits` ``(logits)``.

Tensor-parallel (``verl/utils/megatron/tensor_parallel.py``; verl's Megatron engine, group: megatron-core's
tensor-parallel group, or ``tp_group=`` keyword):

* :func:`vocab_parallel_log_probs_from_logits` ``(logits, labels)``, :func:`vocab_parallel_entropy`
  ``(vocab_parallel_logits)``, :func:`vocab_parallel_entropy_with_chunking`
  ``(vocab_parallel_logits, chunk_size=2048)``, :func:`vocab_parallel_sum_pi_squared`
  ``(vocab_parallel_logits)``; and :func:`vocab_parallel_log_probs_and_entropy` (not in verl): the
  log-prob and the entropy from ONE call, for the engine's ``logits.clone()`` + separate entropy and
  log-prob calls.

Vocab-sharded DTensor logits (verl's FSDP-TP and Automodel engines call ``.full_tensor()`` on them
before these functions, verl #5407 and #6935): pass the DTensor as it is. The op runs on the local shard
with the vocab mesh dim's group; the vocabulary is never gathered; the results come back as plain
tensors (their O(T) ``full_tensor()``).

Output dtypes: verl's by default. The values are computed in float32 (float64 for float64 logits) and
rounded once: the entropies and the sum of squared probabilities in the logits' dtype (verl computes
them in it: bfloat16 logits give bfloat16 entropies), the log-probs and the chunked entropies in
float32. ``float32_output=True`` (keyword) returns the float32 values unrounded.

Deliberate differences: every label outside ``[0, V)`` other than ``-100`` raises ``ValueError`` (on
every rank) instead of giving an undefined value; the logits are never modified (verl's
``_VocabParallelEntropy`` restores them after modifying them, megatron-core's cross-entropy overwrites
float32 logits); float64 logits give float64 log-probs.

The sum of squared probabilities is the core op's ``with_sum_p2`` output (``dualvp_torch.function.sum_pi_squared``: one
call, one statistics all-gather, differentiable).

Fused: the drop-in for verl's ``linear_cross_entropy`` (``verl.utils.kernel.linear_cross_entropy``).

``linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
dist_process_group=None) -> (logprobs, entropy)`` with verl's semantics, on
:func:`dualvp_torch.linear_logprob_entropy`:

* ``hidden [..., H]`` (verl: ``[batch, tokens, H]`` or ``[T, H]``) and
  ``labels [...]`` are flattened to ``T`` rows; ``weight [V_local, H]`` is this
  rank's contiguous vocabulary shard (rank ``r`` owns the ids ``[r * V_local,
  (r + 1) * V_local)``), ``hidden`` and ``labels`` are the same on every rank
  of ``dist_process_group`` (``None``: unsharded).
* ``logprobs``: ``log softmax(hidden @ weight_full^T / temperature)[label]``
  (the log-probability, <= 0, not the loss), float32: ``[T]`` for
  ``reduction="none"``, the sum over the ``T`` rows for ``"sum"``, that sum
  divided by ``T`` for ``"mean"`` (0-d); ``reduction`` is matched
  case-insensitively, as verl does.
* ``entropy``: ``[T]`` float32, the entropy of the same distribution, with
  its gradient.
* Gradients: ``d_hidden`` in hidden's dtype and shape, **this rank's partial
  sum** (verl's callers all-reduce it over the tensor-parallel group, as its
  tensor-parallel test does); ``d_weight`` in weight's dtype, complete.

Known, deliberate differences: logits, products and sums are float32-accurate
(verl writes the logits gradient in bfloat16 and accumulates ``d_hidden``
across its splits in bfloat16), any ``H`` and any vocabulary size are exact
(verl asserts ``H % 128 == 0``), CPU tensors work, float64 inputs give float64
results; a label equal to ``-100`` gives log-prob 0 and no gradient (verl has
no ignore index: its result for such a label is undefined), and every other
label outside ``[0, V)`` raises ``ValueError`` on every rank. ``impl``
(keyword only, not in verl) selects the op's implementation
(:func:`dualvp_torch.linear_logprob_entropy`).
"""

from __future__ import annotations

import torch

from ..function import entropy_only, logprob_entropy, sum_pi_squared
from . import _core
from ._core import IGNORE_INDEX, argument_names, check_chunk_size, check_flag, stack_dtype
from .verl_fused import REDUCTIONS, linear_cross_entropy  # noqa: F401 (REDUCTIONS: re-exported)

__all__ = [
    "linear_cross_entropy",
    "logprobs_from_logits",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "calculate_sum_pi_squared_from_logits",
    "vocab_parallel_log_probs_from_logits",
    "vocab_parallel_entropy",
    "vocab_parallel_entropy_with_chunking",
    "vocab_parallel_sum_pi_squared",
    "vocab_parallel_log_probs_and_entropy",
]


def _resolve(tp_group, logits):
    """megatron-core's tensor-parallel group (verl's ``mpu.get_tensor_model_parallel_group()``) or
    ``tp_group``; ``None`` for DTensor logits (their mesh gives the group)."""
    if _core.is_dtensor(logits):
        _core.check_tp_group(tp_group)
        if tp_group is not None:
            raise ValueError("tp_group: expected None for DTensor logits (the group is the vocab mesh dim's)")
        return None
    return _core.resolve_megatron_group(tp_group)


def _rows(logits):
    local = logits.to_local() if _core.is_dtensor(logits) else logits
    return local


def logprobs_from_logits(logits, labels, inplace_backward=True, *, float32_output=False, tp_group=None):
    """verl's ``logprobs_from_logits``: ``log softmax(logits)[labels]``, ``[...]`` float32.

    Args:
      logits: ``[..., V]``, or a vocab-sharded DTensor (never gathered), or, with ``tp_group``, this
        rank's shard ``[..., V_local]``.
      labels: ``[...]`` ids; ``-100`` gives 0 and no gradient (flash-attn's cross-entropy).
      inplace_backward: ``True`` (verl's default) writes the gradient into the logits' storage, as
        flash-attn's kernel does, where that is safe: contiguous logits produced by an autograd graph
        (not a leaf); otherwise a new gradient buffer is used. Another autograd node that saved the
        same logits then fails in backward with torch's "modified by an inplace operation" error
        instead of reading the gradient (verl passes ``False`` when it also computes the entropy).
      float32_output: accepted for symmetry; the log-probs are float32 already (float64 for float64).
      tp_group: keyword, not verl's: the group that shards the vocabulary of plain-tensor logits.

    Deliberate differences: labels outside ``[0, V)`` other than ``-100`` raise ``ValueError``.
    """
    check_flag(inplace_backward, "inplace_backward")
    check_flag(float32_output, "float32_output")
    local = _rows(logits)
    inplace = bool(
        inplace_backward and isinstance(logits, torch.Tensor) and isinstance(local, torch.Tensor)
        and torch.is_grad_enabled() and logits.requires_grad
        and not logits.is_leaf and local.is_contiguous()
    )
    group = None if _core.is_dtensor(logits) else (_core.check_tp_group(tp_group) or tp_group)
    with argument_names(target="labels"):
        lp, _ = logprob_entropy(
            logits, labels, group=group, with_entropy=False, ignore_index=IGNORE_INDEX, inplace_grad=inplace
        )
    return _core.replicated_to_plain(lp)


def entropy_from_logits(logits, *, float32_output=False, tp_group=None):
    """verl's ``entropy_from_logits``: ``[...]`` entropy of ``softmax(logits)`` in the logits' dtype.

    Computed in float32 (float64 for float64) and rounded once (verl computes ``logsumexp - sum p z``
    in the logits' dtype: 0.067 nats off for bfloat16 and 1.7e-4 for float32 at V = 32k, against
    float64). ``float32_output=True`` returns the float32 values. DTensor logits: taken as they are.
    """
    check_flag(float32_output, "float32_output")
    group = None if _core.is_dtensor(logits) else (_core.check_tp_group(tp_group) or tp_group)
    ent = entropy_only(logits, group=group)
    return stack_dtype(ent, getattr(logits, "dtype", None), float32_output)


def entropy_from_logits_with_chunking(logits, chunk_size: int = 2048, *, float32_output=False, tp_group=None):
    """verl's ``entropy_from_logits_with_chunking``: the entropy, float32 (verl's dtype here).

    ``chunk_size`` is accepted (an int >= 1) and not used: the op needs no ``[T, V]`` scratch, so the
    results are identical for every value. float64 logits give float64.
    """
    check_chunk_size(chunk_size)
    check_flag(float32_output, "float32_output")
    group = None if _core.is_dtensor(logits) else (_core.check_tp_group(tp_group) or tp_group)
    return entropy_only(logits, group=group)


def calculate_sum_pi_squared_from_logits(logits, *, float32_output=False, tp_group=None):
    """verl's ``calculate_sum_pi_squared_from_logits``: ``[...]`` ``sum_v softmax(logits)_v^2``, in the
    logits' dtype (computed in float32 and rounded once; ``float32_output=True``: float32).

    The core op's ``with_sum_p2`` output. DTensor logits (vocab ``Shard(-1)``, other mesh dims
    ``Replicate``) are taken as they are.
    """
    check_flag(float32_output, "float32_output")
    _core.check_tp_group(tp_group)
    out = sum_pi_squared(logits, tp_group)
    return stack_dtype(out, getattr(logits, "dtype", None), float32_output)


def vocab_parallel_log_probs_from_logits(logits, labels, *, tp_group=None):
    """verl's ``vocab_parallel_log_probs_from_logits`` (``-megatron vocab_parallel_cross_entropy``):
    ``[...]`` float32 log-probs from this rank's shard ``[..., V/W]``; the logits are never modified.

    Group: megatron-core's tensor-parallel group (``tp_group=`` overrides). ``-100`` gives 0.
    """
    group = _resolve(tp_group, logits)
    with argument_names(target="labels"):
        lp, _ = logprob_entropy(logits, labels, group=group, with_entropy=False, ignore_index=IGNORE_INDEX)
    return _core.replicated_to_plain(lp)


def vocab_parallel_entropy(vocab_parallel_logits, *, float32_output=False, tp_group=None):
    """verl's ``vocab_parallel_entropy``: ``[...]`` entropy from this rank's shard, in the logits' dtype
    (computed in float32, rounded once; ``float32_output=True``: float32). The logits are never
    modified. Group: megatron-core's tensor-parallel group (``tp_group=`` overrides)."""
    check_flag(float32_output, "float32_output")
    group = _resolve(tp_group, vocab_parallel_logits)
    ent = entropy_only(vocab_parallel_logits, group=group, names={"logits": "vocab_parallel_logits"})
    return stack_dtype(ent, getattr(vocab_parallel_logits, "dtype", None), float32_output)


def vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size: int = 2048, *, tp_group=None):
    """verl's ``vocab_parallel_entropy_with_chunking``: the entropy, float32 (verl's dtype here);
    ``chunk_size`` accepted and not used (identical results for every value)."""
    check_chunk_size(chunk_size)
    group = _resolve(tp_group, vocab_parallel_logits)
    return entropy_only(vocab_parallel_logits, group=group, names={"logits": "vocab_parallel_logits"})


def vocab_parallel_sum_pi_squared(vocab_parallel_logits, *, float32_output=False, tp_group=None):
    """verl's ``vocab_parallel_sum_pi_squared``: ``[...]`` ``sum_v p_v^2`` over the whole vocabulary, in
    the logits' dtype (computed in float32; ``float32_output=True``: float32); non-destructive.

    The core op's ``with_sum_p2`` output (one statistics all-gather).
    """
    check_flag(float32_output, "float32_output")
    group = _resolve(tp_group, vocab_parallel_logits)
    out = sum_pi_squared(vocab_parallel_logits, group, name="vocab_parallel_logits")
    return stack_dtype(out, getattr(vocab_parallel_logits, "dtype", None), float32_output)


def vocab_parallel_log_probs_and_entropy(logits, labels, *, entropy_grad=True, tp_group=None):
    """Not in verl: ``(log_probs, entropy)``, both float32, from ONE call of the op (one all-gather of O(T)
    statistics), for verl's Megatron ``_lm_head_logits_processor``, which clones the logits and calls
    the entropy and the log-prob functions separately. ``entropy_grad=False``: entropy without gradient.
    """
    group = _resolve(tp_group, logits)
    with argument_names(target="labels"):
        lp, ent = logprob_entropy(
            logits, labels, group=group, with_entropy=True, entropy_grad=entropy_grad, ignore_index=IGNORE_INDEX
        )
    return _core.replicated_to_plain(lp), _core.replicated_to_plain(ent)
