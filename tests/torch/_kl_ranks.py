"""Rank bodies of tests/torch/test_kl.py (module level: pickled to the gloo ranks).

``run_cases(rank, world, dtypes)`` runs every :data:`~dualvp.testing.kl.KL_CASES`
case in each dtype on this rank's vocab shard, with both inputs requiring a
gradient, counting the ``torch.distributed`` collectives of each forward
(``validate=False`` and ``True``) and backward by wrapping the module's
functions in this rank. ``run_disagreements`` makes one rank's call differ.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dualvp.testing.kl import KL_CASES, make_kl
from dualvp_torch import kl_divergence

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "all_gather_object", "broadcast_object_list")


class Counter:
    """Counts calls of the ``torch.distributed`` collectives while active."""

    def __init__(self):
        self.n = 0
        self._orig = {}

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def wrapped(*a, _fn=fn, **k):
                self.n += 1
                return _fn(*a, **k)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _shard(x: np.ndarray, rank: int, world: int) -> np.ndarray:
    v = x.shape[-1] // world
    return x[..., rank * v:(rank + 1) * v]


def run_engines(rank: int, world: int, dtypes_by_impl: dict) -> dict:
    """:func:`run_cases` for each engine in one spawn: ``{impl: run_cases(rank, world, dtypes, impl)}``."""
    return {impl: run_cases(rank, world, dtypes, impl) for impl, dtypes in dtypes_by_impl.items()}


def run_cases(rank: int, world: int, dtypes, impl=None) -> list:
    group = dist.group.WORLD
    out = []
    for case in KL_CASES:
        for dtype in dtypes:
            p = make_kl(case, dtype)
            dt = getattr(torch, dtype)
            z = torch.tensor(_shard(p.logits, rank, world), dtype=dt, requires_grad=True)
            r = torch.tensor(_shard(p.ref_logits, rank, world), dtype=dt, requires_grad=True)
            m = None if p.row_mask is None else torch.tensor(p.row_mask)
            kw = dict(group=group, row_mask=m, temperature=case.temperature, direction=case.direction, impl=impl)
            counts = {}
            with Counter() as c:
                kl_divergence(z.detach(), r.detach(), validate=False, **kw)
            counts["forward validate=False"] = c.n
            with Counter() as c:
                kl = kl_divergence(z, r, validate=True, **kw)
            counts["forward validate=True"] = c.n
            with Counter() as c:
                (kl * torch.tensor(p.grad, dtype=kl.dtype)).sum().backward()
            counts["backward"] = c.n
            out.append((case.name, dtype, kl.detach().double().numpy(), z.grad.double().numpy(),
                        r.grad.double().numpy(), counts))
    return out


def run_disagreements(rank: int, world: int) -> dict:
    """What each rank raised (type name, message) when one rank's call differs; every rank must raise."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    z, r = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    odd = rank == 1
    scenarios = {
        "row_mask differs": dict(row_mask=torch.tensor([True, odd, True, True])),
        "direction differs": dict(direction="reverse" if odd else "forward"),
        "temperature differs": dict(temperature=2.0 if odd else 1.0),
        "bad ref on one rank": dict(ref_logits=torch.randn(4, 7) if odd else r),
        "rows differ": dict(logits=torch.randn(3 if odd else 4, 8), ref_logits=torch.randn(3 if odd else 4, 8)),
    }
    seen = {}
    for name, change in scenarios.items():
        kw = dict(logits=z, ref_logits=r, group=group)
        kw.update(change)
        try:
            kl_divergence(kw.pop("logits"), kw.pop("ref_logits"), **kw)
            seen[name] = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            seen[name] = (type(exc).__name__, str(exc))
    return seen
