"""Drop-in for slime's ``slime.utils.ppo_utils.calculate_log_probs_and_entropy``.

Same signature and the same return shapes in every case (``T = 0`` included). ``tp_group=None``
resolves as slime's own collectives resolve ``group=None``: the world group when ``torch.distributed``
is initialised, else unsharded.

Output dtype: float32, slime's (float64 for float64 logits, and float32 also for ``T = 0``, where slime
returns the logits' dtype: deliberate).

Known, deliberate differences from the original: a token equal to ``-100`` gives log-prob 0 and no
gradient (slime treats it like any id outside the shard), and every other id outside ``[0, V)`` raises
``ValueError`` on every rank instead of giving a meaningless number.
"""

from __future__ import annotations

import torch

from ..compiled import one_graph_break
from ..function import logprob_entropy
from ._core import IGNORE_INDEX as _IGNORE_INDEX
from ._core import argument_names as _argument_names
from ._core import resolve_world_group as _resolve_slime_group

__all__ = ["calculate_log_probs_and_entropy"]


@one_graph_break
def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: torch.Tensor | None = None,
    with_entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """slime's ``calculate_log_probs_and_entropy`` on :func:`logprob_entropy`.

    Args:
      logits: ``[T, V_local]`` this rank's vocab shard (temperature already
        applied by the caller, as in slime).
      tokens: ``[T]`` global token ids.
      tp_group: the tensor-parallel group; ``None`` means the world group when
        ``torch.distributed`` is initialised, else unsharded (as in slime).
      with_entropy: also return the entropy.
      chunk_size: accepted for compatibility. Rows are independent and the op
        already needs no ``[T, V_local]`` scratch, so the rows are not split;
        the results are identical for every ``chunk_size``. Must be an int.
      log_prob_keep_mask: ``[T, V_local]`` bool keep mask (top-p / top-k
        replay) for the log-prob, or ``None``.
      with_entropy_grad: ``False`` returns an entropy without gradient.

    Returns:
      As slime: ``(log_prob [T, 1], entropy [T] or None)`` for ``T > 0``, and
      ``(log_prob [0], entropy [0] or None)`` for ``T = 0``. float32 (float64
      for float64 logits), also for ``T = 0`` (where slime returns the
      logits' dtype); the ``T = 0`` results stay connected to ``logits``.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__} {chunk_size!r}")
    with _argument_names(
        target="tokens", keep_mask="log_prob_keep_mask", entropy_grad="with_entropy_grad"
    ):
        log_prob, entropy = logprob_entropy(
            logits,
            tokens,
            group=_resolve_slime_group(tp_group),
            keep_mask=log_prob_keep_mask,
            with_entropy=with_entropy,
            entropy_grad=with_entropy_grad,
            ignore_index=_IGNORE_INDEX,
        )
    if logits.shape[0] == 0:  # slime's own empty-batch branch: flat (0,) results
        return log_prob.reshape(0), None if entropy is None else entropy.reshape(0)
    return log_prob.unsqueeze(-1), entropy
