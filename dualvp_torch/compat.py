"""Drop-in replacements for the call sites of existing training code.

* :func:`calculate_log_probs_and_entropy`: the signature and return shapes of
  ``slime.utils.ppo_utils.calculate_log_probs_and_entropy`` (log-prob
  ``[T, 1]``, entropy ``[T]`` or ``None``).
* :func:`vocab_parallel_cross_entropy`: Megatron-style per-token loss
  ``-logprob`` from vocab-parallel logits.

Both resolve ``group=None`` (``tp_group=None``) to the default (world) process
group when ``torch.distributed`` is initialised, and to "unsharded" otherwise.
Unlike Megatron's fused cross-entropy, neither ever modifies the input logits.
"""

from __future__ import annotations

import torch.distributed as dist

from .function import logprob_entropy

__all__ = ["calculate_log_probs_and_entropy", "vocab_parallel_cross_entropy"]


def _resolve_group(group):
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def calculate_log_probs_and_entropy(
    logits,
    tokens,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask=None,
    with_entropy_grad: bool = True,
):
    """slime's ``calculate_log_probs_and_entropy`` on :func:`logprob_entropy`.

    Args:
      logits: ``[T, V_local]`` this rank's vocab shard (temperature already
        applied by the caller, as in slime).
      tokens: ``[T]`` global token ids.
      tp_group: the tensor-parallel group; ``None`` means the world group when
        ``torch.distributed`` is initialised, else unsharded.
      with_entropy: also return the entropy.
      chunk_size: accepted for compatibility. Rows are independent and the op
        already needs no ``[T, V_local]`` scratch, so the rows are not split;
        the results are identical for every ``chunk_size``. Must be an int.
      log_prob_keep_mask: ``[T, V_local]`` bool keep mask (top-p / top-k
        replay) for the log-prob, or ``None``.
      with_entropy_grad: ``False`` returns an entropy without gradient.

    Returns:
      ``(log_prob [T, 1], entropy [T] or None)``.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__} {chunk_size!r}")
    log_prob, entropy = logprob_entropy(
        logits,
        tokens,
        group=_resolve_group(tp_group),
        keep_mask=log_prob_keep_mask,
        with_entropy=with_entropy,
        entropy_grad=with_entropy_grad,
    )
    return log_prob.unsqueeze(-1), entropy


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, group=None, *, label_smoothing: float = 0.0):
    """Megatron-style ``vocab_parallel_cross_entropy``: per-token loss ``-logprob``.

    Args:
      vocab_parallel_logits: ``[..., V_local]`` (Megatron: ``[s, b, V/W]``).
      target: ``[...]`` global token ids.
      group: the tensor-parallel group; ``None`` means the world group when
        ``torch.distributed`` is initialised, else unsharded.
      label_smoothing: only ``0.0`` is supported.

    Returns:
      ``[...]`` float32 loss (float64 for float64 logits); the input is never
      modified.
    """
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing: expected 0.0 (label smoothing is not supported), got {label_smoothing!r}")
    log_prob, _ = logprob_entropy(vocab_parallel_logits, target, group=_resolve_group(group), with_entropy=False)
    return -log_prob
