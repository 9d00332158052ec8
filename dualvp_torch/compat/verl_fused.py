"""verl's fused ``linear_cross_entropy`` on :func:`dualvp_torch.linear_logprob_entropy` (see
:mod:`dualvp_torch.compat.verl`, which exports it, for its semantics).

Apart from the unfused drop-ins: it stands on the fused op alone, so the former import path
:mod:`dualvp_torch.compat_verl` imports it without the logits op's drop-ins.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..linear import linear_logprob_entropy

__all__ = ["REDUCTIONS", "linear_cross_entropy"]

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
