"""Drop-in for verl's fused ``linear_cross_entropy`` (``verl.utils.kernel.linear_cross_entropy``).

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

import numbers
from typing import Optional

import torch

from .linear import linear_logprob_entropy

__all__ = ["linear_cross_entropy"]

REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
    *,
    impl: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy``: ``(logprobs, entropy)`` of ``hidden @ weight^T / temperature``.

    See the module docstring for the shapes, the reductions and the
    tensor-parallel contract (``d_hidden`` left partial per rank).

    Raises:
      TypeError / ValueError naming the argument (``reduction``,
      ``temperature``, and those of :func:`dualvp_torch.linear_logprob_entropy`).
    """
    if not isinstance(reduction, str):
        raise TypeError(f"reduction: expected a str, got {type(reduction).__name__} {reduction!r}")
    mode = reduction.lower()
    if mode not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__} {temperature!r}")
    if isinstance(hidden, torch.Tensor) and isinstance(labels, torch.Tensor) and hidden.dim() >= 1:
        hidden_rows = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1)
    else:
        hidden_rows = hidden  # the op names the wrong argument
    logprobs, entropy = linear_logprob_entropy(
        hidden_rows, weight, labels, group=dist_process_group, temperature=float(temperature),
        reduce_hidden_grad=False, impl=impl,
    )
    if mode == "sum":
        logprobs = logprobs.sum()
    elif mode == "mean":
        logprobs = logprobs.sum() / logprobs.shape[0]
    return logprobs, entropy
