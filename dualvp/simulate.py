"""Run :mod:`dualvp.spec` over ``W`` simulated vocab shards with NumPy.

This is the specification executed exactly as a sharded backend executes it
(per-shard statistics, an "all-gather" that is a stack, the reduce and
finalize, the local gradient), in one process; optionally each shard is
further split into column blocks whose statistics merge with the same
:func:`dualvp.spec.reduce_stats` (as the fused LM-head op's vocab chunks do). The tests hold it against
:mod:`dualvp.reference`,
and ``dualvp verify`` reports it as the ``spec`` row (through
:func:`dualvp.testing.run` with backend ``"spec"``).
"""

from __future__ import annotations

import numpy as np

from . import spec

__all__ = ["over_shards"]


def over_shards(
    logits,
    target,
    world_size: int,
    *,
    keep_mask=None,
    temperature=1.0,
    ignore_index: int = -100,
    grad_logprob=None,
    grad_entropy=None,
    dtype=np.float64,
    block=None,
    kept_shift: str = "kept",
    entropy_terms: str = "clamp",
    indicator: str = "compare",
    keep_ids=None,
):
    """Spec forward (and backward) over ``world_size`` equal shards.

    Args:
      logits: ``[..., V]`` full logits, ``V`` divisible by ``world_size``.
      target: ``[...]`` global ids. keep_mask: ``[..., V]`` bool or ``None``.
      grad_logprob, grad_entropy: ``[...]`` upstream gradients; the gradient is
        computed when ``grad_logprob`` is given.
      dtype: the NumPy dtype the spec runs in.
      block: ``None`` (one block per shard) or the column-block width: each
        shard's statistics are then made per block, reduced within the shard,
        and its gradient is assembled block by block.
      kept_shift: as in :func:`dualvp.spec.block_stats`; with ``"max"`` the
        rows a block marks are recomputed with ``"kept"``, as the torch CPU
        kernels do.
      entropy_terms: as in :func:`dualvp.spec.block_stats` (``"select"``:
        as dualvp_jax's forward).
      indicator: as in :func:`dualvp.spec.block_grad` (``"arith"``: as
        dualvp_jax's backward).
      keep_ids: ``[..., K]`` global ids (padding -1), the kept set as ids
        (instead of ``keep_mask``): each shard's unmasked statistics with the
        kept pair of :func:`dualvp.spec.kept_columns` /
        :func:`dualvp.spec.kept_pair`, and the gradient
        :func:`dualvp.spec.block_grad_base` with :func:`dualvp.spec.kept_grad`
        written at the kept columns, block by block.

    Returns:
      ``(logprob, entropy, grad)`` with ``grad`` ``[..., V]`` or ``None``.
    """
    z = np.asarray(logits).astype(dtype)
    y = np.asarray(target).astype(np.int64)
    v = z.shape[-1]
    if v % world_size:
        raise ValueError(f"world_size: V={v} is not divisible by world_size={world_size}")
    vr = v // world_size
    shards = [z[..., r * vr : (r + 1) * vr] for r in range(world_size)]
    keeps = [None if keep_mask is None else np.asarray(keep_mask)[..., r * vr : (r + 1) * vr]
             for r in range(world_size)]
    locs = [spec.target_to_local(np, y, r, vr, ignore_index) for r in range(world_size)]
    if keep_ids is not None:
        if keep_mask is not None:
            raise ValueError("keep_ids: expected None when keep_mask is given")
        ids = np.asarray(keep_ids).astype(np.int64)
        kept = [spec.kept_columns(np, ids, y, r, vr, ignore_index) for r in range(world_size)]
    width = vr if block is None else max(1, int(block))
    starts = list(range(0, vr, width)) or [0]

    def cols(a, s0):
        return None if a is None else a[..., s0 : s0 + width]

    def block_of(r, s0):
        args = (np, cols(shards[r], s0), locs[r][2], locs[r][1], cols(keeps[r], s0), temperature)
        st = spec.block_stats(*args, start=s0, kept_shift=kept_shift, entropy_terms=entropy_terms)
        if not spec.marked_rows(np, st).any():
            return st
        redone = spec.block_stats(*args, start=s0, entropy_terms=entropy_terms)
        return spec.redo_marked(np, st, redone)

    def stats_of(r):
        blocks = [block_of(r, s0) for s0 in starts]
        st = spec.reduce_stats(np, np.stack(blocks), axis=0, temperature=temperature)
        if keep_ids is None:
            return st
        zk = None
        for s0 in starts:  # the kept logits gathered block by block, as the fused op does
            c, u = spec.columns_in_block(np, *kept[r], s0, cols(shards[r], s0).shape[-1])
            zk = spec.gather_columns(np, cols(shards[r], s0), c, u, zk)
        return spec.with_kept_pair(np, st, *spec.kept_pair(np, zk, kept[r][1], temperature))

    def grad_of(r, s0, gl, ge):
        z = cols(shards[r], s0)
        if keep_ids is None:
            return spec.block_grad(np, z, locs[r][2], locs[r][1], cols(keeps[r], s0), comb, valid, gl, ge,
                                   temperature, start=s0, indicator=indicator)
        g = spec.block_grad_base(np, z, locs[r][2], locs[r][1], comb, valid, gl, ge, temperature, start=s0,
                                 indicator=indicator)
        c, u = spec.columns_in_block(np, *kept[r], s0, z.shape[-1])
        vals = spec.kept_grad(np, spec.gather_columns(np, z, c, u), kept[r][0], u, locs[r][2], locs[r][1], comb,
                              valid, gl, ge, temperature)
        return spec.set_at_columns(np, g, c, vals, u)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        stats = np.stack([stats_of(r) for r in range(world_size)])
        comb = spec.finalize(np, spec.reduce_stats(np, stats, axis=0, temperature=temperature), temperature)
        valid = locs[0][0]
        logprob, entropy = spec.outputs(np, comb, valid, temperature)
        grad = None
        if grad_logprob is not None:
            gl = np.asarray(grad_logprob).astype(dtype)
            ge = None if grad_entropy is None else np.asarray(grad_entropy).astype(dtype)
            grad = np.concatenate([grad_of(r, s0, gl, ge) for r in range(world_size) for s0 in starts], axis=-1)
    return logprob, entropy, grad
