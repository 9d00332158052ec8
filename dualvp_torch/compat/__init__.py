"""Drop-in replacements for the per-token log-prob / entropy functions of existing training stacks.

One module per stack, each exporting that stack's names and signatures:

* :mod:`~dualvp_torch.compat.trl`: ``selective_log_softmax``, ``entropy_from_logits``, ``install()``.
* :mod:`~dualvp_torch.compat.verl`: ``logprobs_from_logits``, ``entropy_from_logits``,
  ``calculate_sum_pi_squared_from_logits``, the Megatron engine's ``vocab_parallel_*`` functions and the
  fused ``linear_cross_entropy``.
* :mod:`~dualvp_torch.compat.nemo_rl`: ``DistributedLogprob``, ``ChunkedDistributedLogprob``,
  ``ChunkedDistributedGatherLogprob``, ``ChunkedDistributedEntropy`` (``.apply`` as NeMo-RL's).
* :mod:`~dualvp_torch.compat.areal`: ``gather_logprobs``, ``gather_logprobs_entropy``.
* :mod:`~dualvp_torch.compat.megatron`: ``vocab_parallel_cross_entropy``.
* :mod:`~dualvp_torch.compat.slime`: ``calculate_log_probs_and_entropy``.

The names importable from ``dualvp_torch.compat`` itself (``vocab_parallel_cross_entropy``,
``calculate_log_probs_and_entropy``, ``linear_cross_entropy``) are kept for existing code. The stack
modules, and those three names with theirs, are imported on first use (``dualvp_torch.compat.trl``
etc.); none imports its stack.
"""

from __future__ import annotations

import importlib

__all__ = ["calculate_log_probs_and_entropy", "linear_cross_entropy", "vocab_parallel_cross_entropy"]

_STACKS = ("trl", "verl", "nemo_rl", "areal", "megatron", "slime")
#: the names kept from before the per-stack modules, and the module each comes from
_NAMES = {"vocab_parallel_cross_entropy": "megatron", "calculate_log_probs_and_entropy": "slime",
          "linear_cross_entropy": "verl"}


def __getattr__(name):
    if name in _STACKS:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_STACKS) | set(_NAMES))
