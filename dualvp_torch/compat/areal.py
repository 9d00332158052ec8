"""Drop-ins for AReaL's ``areal.utils.functional`` log-prob functions (``vocab_parallel.py``).

Same signatures as AReaL's::

    gather_logprobs(logits, labels, temperature=1.0, tp_group=None, chunk_size=1024)         -> [...]
    gather_logprobs_entropy(logits, labels, temperature=1.0, tp_group=None, chunk_size=1024) -> ([...], [...])
    _vocab_parallel_logprobs(vocab_parallel_logits, labels, tp_group, temperature=1.0)
    _vocab_parallel_logprobs_entropy(vocab_parallel_logits, labels, tp_group, temperature=1.0)

(the last two are AReaL's private sharded entry points, which its tensor-parallel test calls).
``tp_group`` with more than one rank: ``logits`` is this rank's contiguous shard ``[..., V / W]`` (rank
``r`` holds ids ``[r V/W, (r+1) V/W)``); otherwise the full ``[..., V]``. The distribution is
``softmax(logits / temperature)``; the entropy has its gradient, as AReaL's.

Output dtype: float32, AReaL's (float64 for float64 logits, kept: deliberate). ``chunk_size`` is accepted
(an int >= 1) and not used: the op needs no ``[T, V]`` scratch, so the results are identical for every
value (AReaL's chunks save an fp32 softmax each; the op saves none).

Deliberate differences: a label outside ``[0, V)`` raises ``ValueError`` on every rank (AReaL's sharded
path gives a meaningless value, its unsharded path raises in ``gather``), ``-100`` included; an empty
input returns empty results (AReaL asserts ``T > 0``); the logits are never copied to float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _core
from ..function import logprob_entropy
from ._core import NO_IGNORE, argument_names, check_chunk_size

__all__ = ["gather_logprobs", "gather_logprobs_entropy"]


def _group(tp_group):
    _core.check_tp_group(tp_group)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        return tp_group
    return None


def _call(logits, labels, temperature, group, with_entropy, names=None):
    with argument_names(target="labels", **(names or {})):
        return logprob_entropy(
            logits, labels, group=group, temperature=temperature, with_entropy=with_entropy, ignore_index=NO_IGNORE
        )


def gather_logprobs(logits, labels, temperature=1.0, tp_group=None, chunk_size=1024) -> torch.Tensor:
    """AReaL's ``gather_logprobs``: ``[...]`` float32 ``log softmax(logits / temperature)[labels]``."""
    check_chunk_size(chunk_size)
    return _call(logits, labels, temperature, _group(tp_group), False)[0]


def gather_logprobs_entropy(logits, labels, temperature=1.0, tp_group=None, chunk_size=1024):
    """AReaL's ``gather_logprobs_entropy``: ``(logprobs, entropy)``, both ``[...]`` float32, one pass."""
    check_chunk_size(chunk_size)
    return _call(logits, labels, temperature, _group(tp_group), True)


def _vocab_parallel_logprobs(vocab_parallel_logits, labels, tp_group, temperature=1.0) -> torch.Tensor:
    """AReaL's ``_vocab_parallel_logprobs``: the sharded path of :func:`gather_logprobs`."""
    _core.check_tp_group(tp_group)
    return _call(vocab_parallel_logits, labels, temperature, tp_group, False,
                 {"logits": "vocab_parallel_logits"})[0]


def _vocab_parallel_logprobs_entropy(vocab_parallel_logits, labels, tp_group, temperature=1.0):
    """AReaL's ``_vocab_parallel_logprobs_entropy``: the sharded path of :func:`gather_logprobs_entropy`."""
    _core.check_tp_group(tp_group)
    return _call(vocab_parallel_logits, labels, temperature, tp_group, True, {"logits": "vocab_parallel_logits"})
