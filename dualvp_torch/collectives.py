"""The op's collectives over a ``torch.distributed`` process group.

Two collectives exist, both all-gathers of small tensors, both outside the
compiled kernels:

* :func:`gather_stats`: the per-shard ``[T, 6]`` statistics (float32, or
  float64 for float64 input) gathered into ``[W, T, 6]``; every rank then
  combines them locally with :func:`dualvp.spec.combine_stats`, so all ranks
  hold bit-identical combined statistics. This is the op's only collective
  in the forward, and the backward has none. It is issued for every call with
  a group, whatever ``with_entropy``, ``entropy_grad``, ``keep_mask`` or
  ``temperature`` are.
* the agreement step of ``validate=True`` (:func:`dualvp_torch.agreement.gather_checked`,
  through :func:`all_gather_rows`): one int64 record of the options, shapes and
  input fingerprints per rank, copied to the host with one ``.tolist()``: the only
  host-device synchronisation of the op.

On NCCL (and other backends that support it) ``all_gather_into_tensor`` is
used; on gloo, which does not implement it for every build, the list form of
``all_gather`` writes into views of one preallocated output.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["is_process_group", "group_rank_world", "all_gather_rows", "gather_stats", "comm_device"]


def is_process_group(group) -> bool:
    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def group_rank_world(group) -> tuple[int, int]:
    """``(rank, world size)`` of this process in ``group``; ``(0, 1)`` for ``None``."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except Exception:
        return ""


def comm_device(group, hint: Optional[torch.Tensor] = None) -> torch.device:
    """The device a small tensor must live on to travel over ``group``."""
    backend = _backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if hint is not None and hint.device.type != "cpu":
        return hint.device
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if hint is None else hint.device


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x`` from every rank of ``group`` into ``[W, *x.shape]`` (rank order)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    if _backend(group) == "gloo":
        dist.all_gather(list(out.unbind(0)), x, group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)
    return out


def gather_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """``[T, 6]`` shard statistics of every rank -> ``[W, T, 6]``."""
    return all_gather_rows(stats, group)


# --- collectives of the fused LM-head op (dualvp_torch/linear.py) -----------------------
#
# The fused op adds, only where its options ask for them (options that every
# rank agrees on through the agreement record): the all-gather of the
# sequence-parallel hidden rows (forward, and again in the backward instead of
# keeping the gathered copy alive), and the float32 reduction of ``dh`` in the
# backward (an all-reduce for replicated hidden states, a reduce-scatter with
# sequence parallelism: half the traffic of all-reduce-then-slice).

__all__ += ["all_gather_cat", "all_reduce_sum_", "reduce_scatter_rows"]


def all_gather_cat(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` from each rank -> ``[W * n, ...]``, rank ``r``'s rows at ``[r*n, (r+1)*n)``."""
    out = all_gather_rows(x, group)
    return out.reshape((-1,) + tuple(x.shape[1:]))


def all_reduce_sum_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` in place (in ``x``'s dtype); returns ``x``."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x [W * n, ...]`` over the ranks and return this rank's rows ``[n, ...]`` (``[r*n, (r+1)*n)``)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = list(x.chunk(world, dim=0))
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out
