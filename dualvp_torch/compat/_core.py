"""What the drop-ins of :mod:`dualvp_torch.compat` share: group resolution, argument checks, error wording,
output dtypes, DTensor results.

The drop-ins stand on the public and shared layer of the torch op only: :func:`dualvp_torch.logprob_entropy`
and the calls of it they share (:mod:`dualvp_torch.function`: ``logprobs_k``, ``sum_pi_squared``,
``entropy_only``, ``logprob_entropy_or_raise``), :mod:`dualvp_torch.checks` (the checked call, the error
wording), :mod:`dualvp_torch.library` (the custom op's ``forward`` / ``grad`` of a checked call),
:func:`dualvp_torch.compiled.one_graph_break`; no private name of the torch layer. This module sits below
those calls (it imports no op), so a drop-in is one level above the public function.

A per-row temperature tensor is not needed by any drop-in here: every stack that has one (verl) divides
the logits itself before calling the functions replaced; the core op takes one (``temperature=`` a
tensor) for callers that want to skip that division.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives
from .. import dtensor as _dtensor
from ..checks import argument_names, kind
from ..dtensor import replicated_to_plain, vocab_local as dtensor_vocab_local

__all__ = [
    "IGNORE_INDEX", "NO_IGNORE", "check_tp_group", "megatron_tp_group", "resolve_megatron_group",
    "resolve_world_group", "argument_names", "check_flag", "check_chunk_size", "stack_dtype", "is_dtensor",
    "replicated_to_plain", "dtensor_vocab_local", "kind",
]

#: The ignore id of megatron-core, slime, verl and flash-attn's cross-entropy.
IGNORE_INDEX = -100
#: An ``ignore_index`` no token id can equal: for drop-ins of stacks without an ignore id (TRL, AReaL),
#: where ``-100`` is an out-of-range id like any other and raises.
NO_IGNORE = -(2**62)


def check_tp_group(tp_group, name: str = "tp_group") -> None:
    if tp_group is not None and not collectives.is_process_group(tp_group):
        raise TypeError(f"{name}: expected a torch.distributed.ProcessGroup or None, got {kind(tp_group)}")


def megatron_tp_group():
    """megatron-core's tensor-parallel group, or ``None`` if its parallel state is not initialised.

    Only an already imported ``megatron.core.parallel_state`` can hold an
    initialised state, so megatron-core is never imported here.
    """
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    try:
        return ps.get_tensor_model_parallel_group(check_initialized=False)
    except TypeError:  # an old megatron-core without check_initialized
        return getattr(ps, "_TENSOR_MODEL_PARALLEL_GROUP", None)


def resolve_megatron_group(tp_group, name: str = "tp_group"):
    """``tp_group``, else megatron-core's tensor-parallel group, else ``None`` on a 1-rank world; else raises.

    The world group is never assumed: with pipeline or data parallelism it is
    the wrong group and the result would be silently wrong.
    """
    check_tp_group(tp_group, name)
    if tp_group is not None:
        return tp_group
    group = megatron_tp_group()
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{name}: expected the tensor-parallel process group; got None while torch.distributed has "
            f"{dist.get_world_size()} ranks and megatron-core's parallel state is not initialised. The world group "
            "is not assumed (with pipeline or data parallelism it is the wrong group and the loss would be "
            f"silently wrong): pass {name}=<the group that shards the vocabulary>, or call "
            "megatron.core.parallel_state.initialize_model_parallel(...) first"
        )
    return None


def resolve_world_group(tp_group, name: str = "tp_group"):
    """``tp_group``, else the world group when ``torch.distributed`` is initialised, else ``None`` (slime)."""
    check_tp_group(tp_group, name)
    if tp_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return tp_group


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {kind(value)}")
    return value


def check_chunk_size(chunk_size, name: str = "chunk_size", positive: bool = True) -> int:
    """An int (``positive``: >= 1). Rows are independent and the op needs no ``[T, V]`` scratch, so the
    drop-ins accept the stacks' chunk sizes and never split: results are identical for every value."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{name}: expected an int, got {kind(chunk_size)}")
    if positive and chunk_size < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {chunk_size}")
    return chunk_size


def stack_dtype(x: torch.Tensor, dtype: Optional[torch.dtype], float32_output: bool) -> torch.Tensor:
    """``x`` (the op's float32 / float64 result) rounded once to ``dtype``; unchanged for ``float32_output``.

    ``dtype=None`` means the op's own dtype (float32; float64 for float64 logits).
    """
    if float32_output or dtype is None or x.dtype == dtype:
        return x
    return x.to(dtype)


def is_dtensor(x) -> bool:
    return _dtensor.is_dtensor(x)
