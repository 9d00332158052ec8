"""dualvp_torch: the PyTorch backend of dualvp.

``logprob_entropy(logits, target, *, group=None, ...)`` computes the log-prob
of the target token and the entropy from this rank's vocab shard of the
logits, with exact gradients, one all-gather of O(T) statistics per call and
no ``[T, V_local]`` buffer in the forward. See :func:`logprob_entropy`.

``linear_logprob_entropy(hidden, weight, target, ...)`` is the fused LM-head
form: the same outputs from hidden states and the vocab-parallel weight,
without the ``[T, V_local]`` logits ever existing.

``dualvp_torch.compat`` offers drop-in replacements for slime's
``calculate_log_probs_and_entropy`` and Megatron's
``vocab_parallel_cross_entropy``; ``dualvp_torch.testing`` runs a function on
W gloo ranks.
"""

from .function import logprob_entropy
from .linear import linear_logprob_entropy
from .kl import kl_divergence

__all__ = ["logprob_entropy", "linear_logprob_entropy", "kl_divergence", "compat"]


def __getattr__(name):
    # ``dualvp_torch.compat`` (the drop-ins, a layer above the ops) is imported on first use, as its stack
    # modules are: importing the ops does not load every drop-in.
    if name == "compat":
        import importlib

        return importlib.import_module(f"{__name__}.compat")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
