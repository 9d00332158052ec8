"""What the drop-ins of :mod:`dualvp_torch.compat` share: group resolution, error wording, output dtypes,
and the K-target and sum-of-squared-probabilities calls of the core op.

The drop-ins stand on the public and shared layer of the torch op only: :func:`dualvp_torch.logprob_entropy`,
:mod:`dualvp_torch.checks` (the checked call, the error wording), :mod:`dualvp_torch.library` (the custom
op's ``forward`` / ``grad`` of a checked call), :func:`dualvp_torch.compiled.one_graph_break`; no private
name of the torch layer.

* :func:`logprobs_k`: ``K`` log-probs per position (TRL's ``index [..., K]``, NeMo-RL's
  ``ChunkedDistributedGatherLogprob``): ONE call of the core op with ``multi_target=True`` (one pass,
  one statistics all-gather whatever ``K``).
* :func:`sum_pi_squared`: ``sum_v p_v^2`` (verl's optimal-token baseline): ONE call of the core op with
  ``with_sum_p2=True`` (one statistics all-gather).
* A per-row temperature tensor is not needed by any drop-in here: every stack that has one (verl)
  divides the logits itself before calling the functions replaced; the core op takes one
  (``temperature=`` a tensor) for callers that want to skip that division.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives, library
from .. import dtensor as _dtensor
from ..checks import kind as _kind  # (the error wording of the helpers here and of trl.py)
from ..function import logprob_entropy

#: The ignore id of megatron-core, slime, verl and flash-attn's cross-entropy.
IGNORE_INDEX = -100
#: An ``ignore_index`` no token id can equal: for drop-ins of stacks without an ignore id (TRL, AReaL),
#: where ``-100`` is an out-of-range id like any other and raises.
NO_IGNORE = -(2**62)


def check_tp_group(tp_group, name: str = "tp_group") -> None:
    if tp_group is not None and not collectives.is_process_group(tp_group):
        raise TypeError(f"{name}: expected a torch.distributed.ProcessGroup or None, got {_kind(tp_group)}")


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


def logprob_entropy_or_raise(logits, target, *, caller_error: Optional[BaseException] = None, **options):
    """:func:`logprob_entropy`, or a drop-in's own argument error raised on every rank.

    ``caller_error`` (a ``TypeError`` / ``ValueError`` naming the drop-in's
    argument, found before the op runs) goes through the op's check routine
    (:func:`dualvp_torch.checks.logits_call`): with a group and
    ``validate=True`` the agreement all-gather carries it, so every rank
    raises and none waits in a collective. ``options``: the op's keywords.
    """
    if caller_error is None:
        return logprob_entropy(logits, target, **options)
    return library.logprob_entropy(logits, target, caller_error=caller_error, **options)  # raises


@contextlib.contextmanager
def argument_names(**names: str):
    """Re-word errors of :func:`logprob_entropy` with the caller's argument names (``inner=outer``).

    The errors are raised alike on every rank (agreement step), so the
    re-worded ones are too.
    """
    try:
        yield
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        for inner, outer in names.items():
            if msg.startswith(inner + ":"):
                raise type(exc)(outer + msg[len(inner) :]) from exc
        raise


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {_kind(value)}")
    return value


def check_chunk_size(chunk_size, name: str = "chunk_size", positive: bool = True) -> int:
    """An int (``positive``: >= 1). Rows are independent and the op needs no ``[T, V]`` scratch, so the
    drop-ins accept the stacks' chunk sizes and never split: results are identical for every value."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{name}: expected an int, got {_kind(chunk_size)}")
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


def replicated_to_plain(x):
    """A DTensor result of the op (O(T) values) as the plain tensor the stacks' callers expect.

    ``full_tensor()`` of an output that is replicated over the vocab mesh dim
    moves no vocabulary-sized data: at most O(T) values when other mesh dims
    shard the rows. Differentiable.
    """
    if x is None or not is_dtensor(x):
        return x
    return x.full_tensor()


def dtensor_vocab_local(logits):
    """``(local shard, group)`` of DTensor logits whose vocab dim is ``Shard(-1)`` over one mesh dim and
    every other mesh dim ``Replicate`` (the FSDP-TP layout of the loss logits); raises otherwise."""
    dt = _dtensor.dtensor_module()
    ndim = logits.ndim
    vocab_dims = []
    for i, p in enumerate(logits.placements):
        if isinstance(p, dt.Shard) and p.dim in (-1, ndim - 1):
            vocab_dims.append(i)
        elif not isinstance(p, dt.Replicate):
            raise ValueError(
                f"logits: expected a DTensor with the vocabulary (last) dim Shard(-1) and every other mesh dim "
                f"Replicate, got placements {tuple(logits.placements)}"
            )
    if len(vocab_dims) > 1:
        raise ValueError(f"logits: the vocabulary dim is sharded over {len(vocab_dims)} mesh dims; expected one")
    if vocab_dims and logits.shape[-1] % logits.device_mesh.size(vocab_dims[0]):
        raise ValueError(
            f"logits: vocabulary {logits.shape[-1]} not divisible by the vocab mesh dim's size "
            f"{logits.device_mesh.size(vocab_dims[0])} (equal shards needed)"
        )
    group = logits.device_mesh.get_group(vocab_dims[0]) if vocab_dims else None
    return logits.to_local(), group


# --------------------------------------------------------------------------------------------------------------
# K log-probs per position, and the sum of squared probabilities: the core op's K-target pass and sum_p2 output.
# --------------------------------------------------------------------------------------------------------------


def logprobs_k(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    group,
    ignore_index: int,
    temperature: float = 1.0,
    validate: bool = True,
    names: Optional[dict] = None,
) -> torch.Tensor:
    """``[..., K]`` log-probs of the ids ``index [..., K]`` (global) under ``softmax(logits / tau)``.

    ONE call of the core op with ``multi_target=True``: one pass over the logits, one statistics
    all-gather whatever ``K`` (plus the agreement's with ``validate=True``); float32 (float64 for
    float64 logits). An ``ignore_index`` entry gives 0 there (and no gradient); every other id outside
    ``[0, V)`` raises ``ValueError`` on every rank. Gradient: ``sum_k g_k (onehot(y_k) - p) / tau``,
    formed in float32 and rounded once to the logits' dtype.
    """
    names = names or {}
    if is_dtensor(logits) or is_dtensor(index):
        raise TypeError(
            f"{names.get('logits', 'logits')}: DTensor inputs are not supported with several ids per position "
            "yet; pass the local shard and the group"
        )
    if not isinstance(index, torch.Tensor) or index.dim() < 1:
        raise TypeError(f"{names.get('target', 'index')}: expected an integer tensor [..., K], got {_kind(index)}")
    with argument_names(**names):
        lp, _ = logprob_entropy(
            logits, index, group=group, keep_mask=None, temperature=temperature, with_entropy=False,
            entropy_grad=True, ignore_index=ignore_index, validate=validate, inplace_grad=False, impl=None,
            multi_target=True,
        )
    return lp


def sum_pi_squared(logits: torch.Tensor, group, name: str = "logits") -> torch.Tensor:
    """``[...]`` ``sum_v softmax(z)_v^2`` over the whole vocabulary from ``logits [..., V_local]``.

    ONE call of the core op with ``with_sum_p2=True`` (one statistics all-gather; every row's log-prob
    ignored), differentiable (``2 p_v (p_v - S)``); float32 (float64 for float64 logits); the input is
    never modified. DTensor logits (vocab ``Shard(-1)``, other mesh dims ``Replicate``) are taken as they
    are: the local shard and the vocab mesh dim's group, never gathered.
    """
    if is_dtensor(logits):
        logits, group = dtensor_vocab_local(logits)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"{name}: expected a floating torch.Tensor [..., V_local], got {_kind(logits)}")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name}: expected a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    target = torch.full(logits.shape[:-1], IGNORE_INDEX, dtype=torch.int64, device=logits.device)
    with argument_names(logits=name):
        _, _, s = logprob_entropy(
            logits, target, group=group, keep_mask=None, temperature=1.0, with_entropy=False, entropy_grad=True,
            ignore_index=IGNORE_INDEX, validate=True, inplace_grad=False, impl=None, with_sum_p2=True,
        )
    return s


def entropy_only(logits, *, group, entropy_grad: bool = True, names: Optional[dict] = None) -> torch.Tensor:
    """``[...]`` entropy of ``softmax(logits)`` over the whole vocabulary (one op call, every row's log-prob
    ignored). DTensor logits are taken as they are (their vocab mesh dim's group; ``group`` must then be
    ``None``); the result is a plain tensor."""
    names = names or {}
    local = logits.to_local() if is_dtensor(logits) else logits
    if not isinstance(local, torch.Tensor) or local.dim() < 1:
        with argument_names(**names):
            raise TypeError(f"logits: expected a torch.Tensor [..., V_local] of a floating dtype, got {_kind(logits)}")
    target = torch.full(local.shape[:-1], IGNORE_INDEX, dtype=torch.int64, device=local.device)
    if is_dtensor(logits):
        group = None
    with argument_names(**names):
        _, entropy = logprob_entropy(
            logits, target, group=group, with_entropy=True, entropy_grad=entropy_grad, ignore_index=IGNORE_INDEX
        )
    return replicated_to_plain(entropy)
