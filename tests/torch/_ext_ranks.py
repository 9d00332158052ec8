"""Rank body of tests/torch/test_logits_extended.py: the extended op on W gloo ranks, and its collectives.

Each rank runs :data:`dualvp.testing.extended.EXT_CASES` entries on its vocab shard and returns its local
outputs (the parent joins the gradient shards and judges them against the float64 oracle), then counts
the ``torch.distributed`` collectives of one forward + backward at K = 1 and K = 8. :func:`ids_against_mask`
runs each problem twice per engine, the kept set as ``keep_ids`` and as the keep mask built from the same ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from dualvp import reference
from dualvp.testing import cases
from dualvp.testing import extended as ext
from dualvp_torch import logprob_entropy

_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all_single", "barrier", "all_gather_object")


def keep_ids_of(prob: ext.ExtProblem) -> np.ndarray:
    """The problem's keep mask as global ids ``[..., K]`` (padding -1, some ids repeated), the same on every rank."""
    return cases.ids_from_mask(np.random.default_rng(prob.case.base.seed + 7), prob.keep_mask)


def run_case(prob: ext.ExtProblem, rank: int, world: int, group, impl: str, ids: bool = False,
             inplace: bool = False, id_array: np.ndarray | None = None) -> dict:
    """This rank's ``(logprob, entropy, sum_p2, grad shard)`` as float64 NumPy arrays.

    ``ids``: the keep mask handed over as ``keep_ids`` (``id_array`` when given, else :func:`keep_ids_of`);
    ``inplace``: ``inplace_grad=True`` on a non-leaf copy of the logits.
    """
    c = prob.case
    z, keep = prob.shard(rank, world)
    cdt = torch.float64 if c.dtype == "float64" else torch.float32
    leaf = torch.tensor(z, dtype=torch.float64).to(_DT[c.dtype]).requires_grad_(True)
    x = leaf * 1 if inplace else leaf
    tau = torch.tensor(prob.temperature, dtype=cdt) if c.row_temperature else prob.temperature
    kw = {}
    if keep is not None:
        id_array = keep_ids_of(prob) if id_array is None else id_array
        kw = {"keep_ids": torch.tensor(id_array)} if ids else {"keep_mask": torch.tensor(keep)}
    out = logprob_entropy(x, torch.tensor(prob.target), group=group, temperature=tau, inplace_grad=inplace,
                          ignore_index=c.ignore_index, multi_target=c.targets > 0, with_sum_p2=c.sum_p2, impl=impl,
                          **kw)
    lp, h = out[0], out[1]
    loss = ((lp * torch.tensor(prob.grad_logprob, dtype=cdt)).sum()
            + (h * torch.tensor(prob.grad_entropy, dtype=cdt)).sum())
    if c.sum_p2:
        loss = loss + (out[2] * torch.tensor(prob.grad_sum_p2, dtype=cdt)).sum()
    loss.backward()
    f = lambda a: a.detach().to(torch.float64).numpy()  # noqa: E731
    return dict(logprob=f(lp), entropy=f(h), sum_p2=f(out[2]) if c.sum_p2 else None, grad=f(leaf.grad))


def count_collectives(rank: int, world: int, group, k: int, validate: bool) -> dict:
    """Collective calls of one forward + backward with every option on, K targets per row."""
    rng = np.random.default_rng(0)
    t, v_local = 6, 16
    z = torch.tensor(rng.normal(size=(t, world * v_local))[:, rank * v_local:(rank + 1) * v_local],
                     dtype=torch.float32, requires_grad=True)
    y = torch.tensor(rng.integers(0, world * v_local, size=(t, k)))
    keep = torch.tensor(rng.random((t, world * v_local)) < 0.5)[:, rank * v_local:(rank + 1) * v_local]
    tau = torch.tensor(rng.uniform(0.5, 2.0, size=t), dtype=torch.float32)
    counts: dict = {}
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*a, **kw):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **kw)
        return counted

    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        lp, h, p2 = logprob_entropy(z, y, group=group, keep_mask=keep, temperature=tau, multi_target=True,
                                    with_sum_p2=True, validate=validate, impl="eager")
        (lp.sum() + h.sum() + p2.sum()).backward()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return counts


def disagree(rank: int, group) -> dict:
    """Rank 0 asks for K = 1 target and sum p^2, rank 1 for K = 2 and none (and then a temperature tensor
    against a number): the statistics would differ in width; every rank must raise instead of hanging."""
    import time

    z = torch.zeros(3, 4)
    out = {}
    calls = {
        "targets per row": lambda: logprob_entropy(z, torch.zeros(3, 1 + rank, dtype=torch.int64), group=group,
                                                   multi_target=True, impl="eager"),
        "with_sum_p2": lambda: logprob_entropy(z, torch.zeros(3, dtype=torch.int64), group=group,
                                               with_sum_p2=rank == 0, impl="eager"),
        "temperature tensor": lambda: logprob_entropy(
            z, torch.zeros(3, dtype=torch.int64), group=group, impl="eager",
            temperature=torch.ones(3) if rank == 0 else 1.0),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = ("no error", "", time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    return out


def rank_suite(rank: int, world: int, names: tuple, impl: str) -> dict:
    group = dist.group.WORLD
    results = {name: run_case(ext.make_ext(ext.ext_case(name)), rank, world, group, impl) for name in names}
    counts = {(k, v): count_collectives(rank, world, group, k, v) for k in (1, 8) for v in (True, False)}
    return {"results": results, "counts": counts, "disagree": disagree(rank, group)}


def rank_cases(rank: int, world: int, probs: list, impl: str, ids: bool = False) -> list:
    """This rank's outputs of each problem (:func:`run_case`), nothing else."""
    return [run_case(p, rank, world, dist.group.WORLD, impl, ids) for p in probs]


def mask_of_ids(prob: ext.ExtProblem) -> tuple:
    """``(ids, problem)``: the problem's kept set as ids (:func:`keep_ids_of`) and the problem with the keep mask
    rebuilt from those ids by the oracle's own loop (``reference.mask_from_ids``), the mask both runs describe."""
    ids = keep_ids_of(prob)
    return ids, dataclasses.replace(prob, keep_mask=reference.mask_from_ids(ids, prob.logits.shape[-1]))


def ids_against_mask(rank: int, world: int, jobs: list) -> dict:
    """``jobs``: ``[(problem, engines)]``. ``"outputs"``: per job ``[(impl, with ids, with the mask)]``, this
    rank's :func:`run_case` outputs with the kept set as ``keep_ids`` and as the keep mask built from the same
    ids (:func:`mask_of_ids`) on each engine; ``"compile_failed"``: whether a compiled stage fell back to eager."""
    from dualvp_torch import compiled

    out = []
    for prob, impls in jobs:
        ids, masked = mask_of_ids(prob)
        out.append([(impl, run_case(masked, rank, world, dist.group.WORLD, impl, ids=True, id_array=ids),
                     run_case(masked, rank, world, dist.group.WORLD, impl)) for impl in impls])
    return {"outputs": out, "compile_failed": compiled.failed()}
