"""DTensor inputs for :func:`dualvp_torch.logprob_entropy` (``torch.distributed.tensor``).

torch's own tensor parallelism (``parallelize_module`` with
``ColwiseParallel(use_local_output=False)`` on the LM head, torchtitan-style
code) hands the loss logits as a ``DTensor`` ``[..., V]`` whose vocabulary
(last) dim is ``Shard(-1)`` over one mesh dim. This module unwraps such a
call into the local op and wraps the results back::

    logits  DTensor [..., V]   placements e.g. (Shard(0), Shard(-1)) on a (dp, tp) mesh
       | .to_local()                    (differentiable: the gradient comes back
       v                                 as a DTensor with the logits' placements)
    local op on [..., V / W_tp]  with group = mesh.get_group(tp)
       |
       v  DTensor.from_local(...)       (differentiable)
    logprob, entropy  DTensor [...]  placements (Shard(0), Replicate())

Placement rules (all checked on the DTensor's *global* metadata, which is the
same on every rank, so every rank raises the same error before any
collective):

* ``logits``: every placement is ``Shard`` or ``Replicate``. The vocabulary
  dim is sharded over at most one mesh dim (that dim's process group is the
  op's group; with no vocab sharding the op runs unsharded on every rank).
  Other mesh dims may shard any leading (row) dim, evenly or not, or
  replicate. ``Partial`` (unreduced logits), vocab sharded over two mesh dims,
  and a vocabulary that the vocab mesh dim does not divide
  (``V % W != 0``: DTensor's uneven chunks do not match the op's
  equal-shard convention ``[r*V/W, (r+1)*V/W)``) raise ``ValueError``.
* ``target``: a DTensor ``[...]`` on the same mesh with the logits'
  placements, the vocab dim replaced by ``Replicate()`` (it holds *global*
  token ids); or a plain tensor holding this rank's rows
  (``logits.to_local().shape[:-1]``). With ``multi_target=True``: ``[..., K]``,
  the same placements (the K dim is never sharded).
* ``temperature`` (a tensor, one per row): a DTensor ``[...]`` placed like a
  one-target ``target``, or a plain tensor of this rank's rows.
* ``keep_mask``: a DTensor on the same mesh with exactly the logits'
  placements; or a plain bool tensor shaped like ``logits.to_local()``.
* ``group`` must be ``None`` (the group comes from the mesh).
* Outputs: DTensors ``[...]`` (global shape ``logits.shape[:-1]``) with the
  target's placements: replicated over the vocab mesh dim, sharded like the
  rows elsewhere; the log-prob ``[..., K]`` with ``multi_target``, and
  ``sum_p2 [...]`` third with ``with_sum_p2``.

Agreement across ranks: the op's collectives run over the vocab mesh dim's
group only, and its ``validate=True`` agreement step covers that group (local
shapes of plain ``target`` / ``keep_mask``, options, target ranges). Ranks of
*different* vocab groups (different data-parallel coordinates) hold different
rows and are not compared with each other; nothing the op does makes them
wait for each other either.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

# torch.distributed.tensor costs ~1 s to import; a DTensor can only exist once
# it has been imported, so nothing here imports it before a DTensor is seen.
_DT_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")

__all__ = ["dtensor_module", "is_dtensor", "involves_dtensor", "logprob_entropy", "replicated_to_plain", "vocab_local"]


def dtensor_module():
    """The module defining DTensor, Shard, Replicate, Partial (public on torch >= 2.5)."""
    try:
        import torch.distributed.tensor as dt
    except ImportError:  # pragma: no cover - torch 2.4
        import torch.distributed._tensor as dt
    return dt


def is_dtensor(x) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (never imports it)."""
    if not isinstance(x, torch.Tensor) or type(x) is torch.Tensor:
        return False
    for name in _DT_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and isinstance(x, getattr(mod, "DTensor", ())):
            return True
    return False


def involves_dtensor(logits, target, keep_mask, keep_ids=None, temperature=None) -> bool:
    """Whether any tensor argument is a DTensor (then this module handles the call)."""
    return (is_dtensor(logits) or is_dtensor(target) or is_dtensor(keep_mask) or is_dtensor(keep_ids)
            or is_dtensor(temperature))


def _norm(placements, ndim: int) -> tuple:
    """Placements with ``Shard(d)`` dims made non-negative (``Shard(-1)`` == ``Shard(ndim-1)``)."""
    Shard = dtensor_module().Shard
    out = []
    for p in placements:
        if type(p) is Shard and p.dim < 0:
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def _mesh_dim_name(mesh, i: int) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return f"{i} ({names[i]!r})" if names else str(i)


def _vocab_mesh_dim(logits) -> Optional[int]:
    """The mesh dim that shards the vocabulary (None: not sharded); raises on unsupported layouts."""
    dt = dtensor_module()
    Shard, Replicate, Partial = dt.Shard, dt.Replicate, dt.Partial
    ndim = logits.ndim
    if ndim < 1:
        raise ValueError(f"logits: expected a DTensor [..., V] with at least 1 dim, got shape {tuple(logits.shape)}")
    mesh = logits.device_mesh
    placements = _norm(logits.placements, ndim)
    vocab_dims = []
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"logits: expected Shard / Replicate placements, got {p} on mesh dim {_mesh_dim_name(mesh, i)} "
                f"(placements {tuple(logits.placements)}): partial (unreduced) logits are not a distribution; "
                f"reduce them first, e.g. logits.redistribute(placements=...)"
            )
        if type(p) is Shard:
            if p.dim == ndim - 1:
                vocab_dims.append(i)
        elif type(p) is not Replicate:
            raise ValueError(
                f"logits: expected Shard / Replicate placements, got {p!r} on mesh dim {_mesh_dim_name(mesh, i)} "
                f"(placements {tuple(logits.placements)})"
            )
    if len(vocab_dims) > 1:
        raise ValueError(
            f"logits: the vocabulary (last) dim is sharded over {len(vocab_dims)} mesh dims "
            f"{[_mesh_dim_name(mesh, i) for i in vocab_dims]} (placements {tuple(logits.placements)}); "
            f"expected Shard(-1) over exactly one mesh dim"
        )
    if not vocab_dims:
        return None
    d = vocab_dims[0]
    w = mesh.size(d)
    v = logits.shape[-1]
    if v % w:
        chunk = -(-v // w)
        sizes = [max(0, min(chunk, v - r * chunk)) for r in range(w)]
        raise ValueError(
            f"logits: the vocabulary dim of the DTensor of global shape {tuple(logits.shape)} (V = {v}) is "
            f"sharded unevenly over mesh dim {_mesh_dim_name(mesh, d)} of size {w} (local shards of {sizes} "
            f"columns); dualvp needs equal contiguous shards, V divisible by {w} (pad the vocabulary, "
            f"e.g. to {chunk * w})"
        )
    return d


def _check_group_order(mesh, d: int, group) -> None:
    """The group's rank order must be the mesh order along ``d`` (the op's rank r owns columns r*V/W...).

    Evaluated on the group's whole rank list and the mesh tensor, which every
    member of the group sees identically, so the outcome is the same on all
    of them.
    """
    import torch.distributed as dist

    coord = mesh.get_coordinate()
    index = tuple(slice(None) if i == d else c for i, c in enumerate(coord))
    along = mesh.mesh[index].tolist()
    ranks = dist.get_process_group_ranks(group)
    if list(ranks) != list(along):
        raise RuntimeError(
            f"logits: the process group of mesh dim {_mesh_dim_name(mesh, d)} orders its ranks as {ranks}, "
            f"the mesh as {along}; the op's shard convention needs the mesh order"
        )


def _check_companion(name: str, x, logits, expected: tuple, shape: tuple) -> None:
    if x.device_mesh != logits.device_mesh:
        raise ValueError(
            f"{name}: expected a DTensor on the logits' device mesh {logits.device_mesh}, got {x.device_mesh}")
    if tuple(x.shape) != shape:
        raise ValueError(
            f"{name}: expected global shape {shape} (from logits {tuple(logits.shape)}), got {tuple(x.shape)}")
    got = _norm(x.placements, x.ndim)
    if got != expected:
        raise ValueError(
            f"{name}: expected placements {expected} (consistent with logits placements "
            f"{tuple(logits.placements)}), got {tuple(x.placements)}"
        )


def _contiguous_stride(shape: tuple) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def logprob_entropy(local_op, logits, target, *, group=None, keep_mask=None, inplace_grad=False, keep_ids=None,
                    **options):
    """:func:`dualvp_torch.logprob_entropy` for DTensor logits (see the module docstring for the rules).

    Args:
      local_op: the op on local tensors (``dualvp_torch.logprob_entropy``),
        called once with this rank's shard and the vocab mesh dim's group.
      logits: DTensor ``[..., V]``, vocabulary ``Shard(-1)`` over at most one
        mesh dim (``V`` divisible by its size), other placements ``Shard`` of a
        leading dim or ``Replicate``.
      target: DTensor ``[...]`` with the logits' placements, vocab mesh dim
        ``Replicate()``; or a plain integer tensor of this rank's rows. Global ids.
      keep_mask: ``None``, a bool DTensor with the logits' placements, or a
        plain bool tensor shaped like ``logits.to_local()``.
      keep_ids: ``None``, an integer DTensor ``[..., K]`` of global ids with
        the target's placements (vocab mesh dim ``Replicate()``), or a plain
        tensor of this rank's rows: the ids are global and taken as they are.
      group: must be ``None``; the group is ``mesh.get_group(vocab mesh dim)``.
      inplace_grad: as in :func:`dualvp_torch.logprob_entropy` (checked here
        too: ``to_local()`` hides whether the DTensor is a leaf).
      **options: every other keyword of :func:`dualvp_torch.logprob_entropy`
        (temperature, with_entropy, entropy_grad, ignore_index, validate,
        impl, multi_target, with_sum_p2), passed to the local op unchanged
        (a temperature DTensor as its local rows), so the two signatures
        cannot drift apart.

    Returns:
      ``(logprob, entropy or None)`` (``+ (sum_p2,)`` with ``with_sum_p2``):
      DTensors of global shape ``logits.shape[:-1]`` (the log-prob
      ``[..., K]`` with ``multi_target``), replicated over the vocab mesh dim
      and sharded like the logits' rows elsewhere. Gradients reach ``logits``
      as a DTensor with the logits' placements.
    """
    temperature = options.get("temperature")
    if not is_dtensor(logits):
        which = next(n for n, x in (("target", target), ("keep_mask", keep_mask), ("keep_ids", keep_ids),
                                    ("temperature", temperature)) if is_dtensor(x))
        raise TypeError(
            f"{which}: got a DTensor while logits is a {type(logits).__name__}; pass the logits as a DTensor "
            f"(vocab Shard(-1)) too, or all of them as local tensors"
        )
    if group is not None:
        raise ValueError(
            "group: expected None for DTensor logits (the group is the vocab mesh dim's, "
            f"mesh.get_group(dim)), got a {type(group).__name__}"
        )
    dt = dtensor_module()
    DTensor, Replicate = dt.DTensor, dt.Replicate
    mesh = logits.device_mesh
    ndim = logits.ndim
    d = _vocab_mesh_dim(logits)
    placements = _norm(logits.placements, ndim)
    out_placements = tuple(Replicate() if i == d else p for i, p in enumerate(placements))
    out_shape = tuple(logits.shape[:-1])

    multi_target = options.get("multi_target") is True
    if is_dtensor(target):
        # multi_target: [..., K], the K ids of a row on its rank (the K dim never sharded)
        k = tuple(target.shape[-1:]) if multi_target and target.ndim == ndim else ()
        _check_companion("target", target, logits, out_placements, out_shape + k)
        target = target.to_local()
    if is_dtensor(temperature):  # one per row: placed like the rows of the outputs
        _check_companion("temperature", temperature, logits, out_placements, out_shape)
        options = dict(options, temperature=temperature.to_local())
    if is_dtensor(keep_mask):
        _check_companion("keep_mask", keep_mask, logits, placements, tuple(logits.shape))
        keep_mask = keep_mask.to_local()
    if is_dtensor(keep_ids):
        _check_companion("keep_ids", keep_ids, logits, out_placements, out_shape + tuple(keep_ids.shape[-1:]))
        keep_ids = keep_ids.to_local()
    if inplace_grad is True and logits.requires_grad and logits.is_leaf:
        # to_local() returns a non-leaf view of a leaf's storage: the local
        # op's own leaf check cannot see through it.
        raise ValueError(
            "inplace_grad: expected logits produced by an autograd graph (a non-leaf DTensor); got a leaf "
            "DTensor that requires grad, whose storage is the caller's own data and is never overwritten"
        )

    sub_group = None
    if d is not None:
        sub_group = mesh.get_group(d)
        _check_group_order(mesh, d, sub_group)

    outs = local_op(
        logits.to_local(),
        target,
        group=sub_group,
        keep_mask=keep_mask,
        inplace_grad=inplace_grad,
        keep_ids=keep_ids,
        **options,
    )

    def wrap(t, k=()):
        shape = out_shape + k  # k: the log-prob's K dim with multi_target (whole on every rank)
        return None if t is None else DTensor.from_local(
            t, mesh, out_placements, run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )

    logprob = outs[0]
    return (wrap(logprob, tuple(logprob.shape[-1:]) if multi_target else ()),) + tuple(wrap(t) for t in outs[1:])


def replicated_to_plain(x):
    """A DTensor result of the op (O(T) values) as the plain tensor the stacks' callers expect.

    ``full_tensor()`` of an output that is replicated over the vocab mesh dim
    moves no vocabulary-sized data: at most O(T) values when other mesh dims
    shard the rows. Differentiable.
    """
    if x is None or not is_dtensor(x):
        return x
    return x.full_tensor()


def vocab_local(logits):
    """``(local shard, group)`` of DTensor logits whose vocab dim is ``Shard(-1)`` over one mesh dim and
    every other mesh dim ``Replicate`` (the FSDP-TP layout of the loss logits); raises otherwise."""
    dt = dtensor_module()
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
