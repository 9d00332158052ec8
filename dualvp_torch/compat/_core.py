"""What the drop-ins of :mod:`dualvp_torch.compat` share: group resolution, error wording, output dtypes,
and three stop-gaps built on the public op until the core op has them.

The drop-ins stand on the public and shared layer of the torch op only: :func:`dualvp_torch.logprob_entropy`,
:mod:`dualvp_torch.checks` (the checked call, the error wording), :mod:`dualvp_torch.library` (the custom
op's ``forward`` / ``grad`` of a checked call), :func:`dualvp_torch.compiled.one_graph_break`; no private
name of the torch layer.

Stop-gaps (each marked "to be replaced by the core op's ..." where it is defined):

* :func:`logprobs_k`: ``K`` log-probs per position (TRL's ``index [..., K]``, NeMo-RL's
  ``ChunkedDistributedGatherLogprob``) from ONE op call on the first id of each row plus a gather of the
  ``K`` logits (one all-reduce of ``[T, K]`` under tensor parallelism, whatever ``K``):
  ``log p_k = log p_0 + (z_k - z_0) / tau``. To be replaced by the core op's K-target pass.
* :func:`sum_pi_squared`: ``sum_v p_v^2`` (verl's optimal-token baseline) in one sharded pass with two
  collectives (max, then the two sums together). To be replaced by the core op's sum-of-squared-
  probabilities output.
* A per-row temperature tensor is not needed by any drop-in here: every stack that has one (verl)
  divides the logits itself before calling the functions replaced.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives, library
from .. import dtensor as _dtensor
from ..checks import kind as _kind  # (the error wording of the helpers here and of trl.py)
from ..function import logprob_entropy
from ..stages import compute_dtype

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
# K log-probs per position. To be replaced by the core op's K-target pass.
# --------------------------------------------------------------------------------------------------------------


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) of per-rank parts of a replicated result; backward: the identity.

    Every rank then computes the same loss from the replicated result, so a
    rank's local gradient is the gradient of its own part (the convention of
    the op and of Megatron's vocab-parallel functions).
    """

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


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

    **To be replaced by the core op's K-target pass.** Today: ONE call of the
    op on ``index[..., 0]`` gives ``log p_0`` (its LSE pass, validation and
    agreement; one all-gather), then ``log p_k = log p_0 + (z_k - z_0) / tau``
    with ``z_k`` gathered from the owning shard (one all-reduce of ``[T, K]``
    under tensor parallelism): two collective rounds per call whatever ``K``,
    one pass over the logits. The combination is formed in float64 and
    rounded once. Rows whose id 0 is ``ignore_index`` give 0 for every ``k``
    (and no gradient); an ``ignore_index`` in a later column gives 0 there.
    Every other id outside ``[0, V)`` raises ``ValueError`` (on every rank:
    the check of columns ``1..K-1`` goes through the op's agreement step).

    Gradient: the op's gradient of ``log p_0`` plus the scatter of the
    ``z_k - z_0`` terms, exact; it needs a second ``[T, V_local]`` buffer
    while autograd sums the two (the core op's pass will not). The two
    cancel at the id ``y_0`` (``G (1 - p_0) - G + g_0``), which 16-bit
    arithmetic would ruin: for 16-bit logits that need a gradient and
    ``K > 1`` the op runs on a float32 copy of the logits (a ``[T, V_local]``
    float32 buffer), and the summed gradient is rounded once.
    """
    names = names or {}
    if is_dtensor(logits) or is_dtensor(index):
        raise TypeError(
            f"{names.get('logits', 'logits')}: DTensor inputs are not supported with several ids per position "
            "yet; pass the local shard and the group"
        )
    if not isinstance(index, torch.Tensor) or index.dim() < 1:
        raise TypeError(f"{names.get('target', 'index')}: expected an integer tensor [..., K], got {_kind(index)}")
    k = index.shape[-1]
    if k == 0 or not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        with argument_names(**names):
            if k == 0:
                raise ValueError(f"target: expected K >= 1 ids per position, got shape {tuple(index.shape)}")
            raise TypeError(f"logits: expected a torch.Tensor [..., V_local], got {_kind(logits)}")
    rank, world = collectives.group_rank_world(group) if group is not None else (0, 1)
    v_local = logits.shape[-1]
    caller_error = None
    rest = index[..., 1:]
    if validate and rest.numel() and not rest.is_floating_point():
        y = rest.to(torch.int64)
        bad = int(((y != ignore_index) & ((y < 0) | (y >= world * v_local))).sum())
        if bad:
            caller_error = ValueError(
                f"{names.get('target', 'target')}: {bad} id(s) outside [0, {world * v_local}) "
                f"(and not the ignore id {ignore_index}) in columns 1..{k - 1} of the ids"
            )
    if k > 1 and logits.dtype in (torch.float16, torch.bfloat16) and torch.is_grad_enabled() and logits.requires_grad:
        logits = logits.float()  # see the docstring: the gradients cancel at y_0
    with argument_names(**names):
        lp0, _ = logprob_entropy_or_raise(
            logits, index[..., 0], group=group, keep_mask=None, temperature=temperature, with_entropy=False,
            entropy_grad=True, ignore_index=ignore_index, validate=validate, inplace_grad=False, impl=None,
            caller_error=caller_error,
        )
    if k == 1:
        return lp0.unsqueeze(-1)
    y = index.to(torch.int64)
    local = y - rank * v_local
    owns = (local >= 0) & (local < v_local)
    z = torch.gather(logits, -1, local.clamp(0, v_local - 1))
    acc = torch.float64
    z = torch.where(owns, z.to(acc), torch.zeros((), dtype=acc, device=z.device))
    if group is not None and world > 1:
        z = _SumOverGroup.apply(z, group)
    out = lp0.to(acc).unsqueeze(-1) + (z - z[..., :1]) / float(temperature)
    valid = y != ignore_index
    out = torch.where(valid & valid[..., :1], out, torch.zeros((), dtype=acc, device=out.device))
    return out.to(lp0.dtype)


# --------------------------------------------------------------------------------------------------------------
# Sum of squared probabilities. To be replaced by the core op's sum-of-squared-probabilities output.
# --------------------------------------------------------------------------------------------------------------

#: Elements per row chunk of :class:`_SumPiSquared` (a float32 chunk is 4 MiB).
_CHUNK_ELEMENTS = 1 << 20


def _row_chunks(n_rows: int, v_local: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, v_local))
    return [(i, min(n_rows, i + step)) for i in range(0, n_rows, step)]


class _SumPiSquared(torch.autograd.Function):
    """``S = sum_v p_v^2 = s2 / s1^2`` with ``s1 = sum e``, ``s2 = sum e^2``, ``e = exp(z - M)``.

    Forward: row chunks in the compute dtype (float32; float64 for float64),
    one all-reduce MAX of ``M`` and one all-reduce SUM of ``[T, 2]``. Backward:
    ``dS/dz_v = 2 p_v (p_v - S)``, chunk by chunk, no collective.
    """

    @staticmethod
    def forward(ctx, logits, group, needs_grad):
        v_local = logits.shape[-1]
        z = logits.detach().reshape(-1, v_local)
        cdt = compute_dtype(logits.dtype)
        n = z.shape[0]
        m = torch.empty(n, dtype=cdt, device=z.device)
        for a, b in _row_chunks(n, v_local):
            m[a:b] = z[a:b].amax(dim=-1).to(cdt) if v_local else -math.inf
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = torch.empty(n, 2, dtype=cdt, device=z.device)
        for a, b in _row_chunks(n, v_local):
            e = torch.exp(z[a:b].to(cdt) - m_safe[a:b, None])
            s[a:b, 0] = e.sum(dim=-1)
            s[a:b, 1] = (e * e).sum(dim=-1)
        if group is not None:
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        out = s[:, 1] / (s[:, 0] * s[:, 0])
        if needs_grad:
            ctx.save_for_backward(logits, m_safe, s[:, 0].contiguous(), out)
        return out.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, g):
        logits, m, s1, out = ctx.saved_tensors
        v_local = logits.shape[-1]
        z = logits.detach().reshape(-1, v_local)
        gf = g.reshape(-1).to(out.dtype)
        grad = torch.empty_like(z)
        for a, b in _row_chunks(z.shape[0], v_local):
            p = torch.exp(z[a:b].to(out.dtype) - m[a:b, None]) / s1[a:b, None]
            grad[a:b] = (2 * gf[a:b, None] * p * (p - out[a:b, None])).to(grad.dtype)
        return grad.view(logits.shape), None, None


def sum_pi_squared(logits: torch.Tensor, group, name: str = "logits") -> torch.Tensor:
    """``[...]`` ``sum_v softmax(z)_v^2`` over the whole vocabulary from ``logits [..., V_local]``.

    **To be replaced by the core op's sum-of-squared-probabilities output.**
    float32 (float64 for float64 logits); the input is never modified. DTensor
    logits (vocab ``Shard(-1)``, other mesh dims ``Replicate``) are taken as
    they are: the local shard and the vocab mesh dim's group, never gathered.
    """
    if is_dtensor(logits):
        logits, group = dtensor_vocab_local(logits)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"{name}: expected a floating torch.Tensor [..., V_local], got {_kind(logits)}")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name}: expected a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    return _SumPiSquared.apply(logits, group, needs_grad)


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
